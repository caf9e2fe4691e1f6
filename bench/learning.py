"""Held-out success against minutes: tracetrain's loop against TRL's GRPOTrainer, same task and budget.

Both sides learn the demo's task (tracetrain_demo/task.py) on SmolLM2-135M-Instruct with a LoRA
r=16/alpha 32 on all 7 projections, lr 3e-4 constant, clip 0.2, no KL, 4 requests x 8 attempts
per step, for the same wall-clock budget on this machine, one after the other:

- ``tracetrain``: ``tracetrain demo --minutes M`` as a user runs it: vLLM (one core) samples
  through the proxy while the trainer worker (the other core) trains the last round;
- ``trl``: TRL's ``GRPOTrainer`` (bench/_learn/trl_loop.py), sampling with transformers'
  ``generate`` and training in turn on both cores, as TRL does without a vLLM server.

Each side's clock starts when its training starts (model loading and vLLM's start excluded)
and keeps the adapters it produced with the seconds at which each was written. Afterwards
one judge (bench/_learn/evaluate.py: a fresh vLLM and the demo's agent on the 100 held-out
requests) measures, for every minute mark, the newest adapter each side had by then. The
table and one plot with both curves go to OUT (results.json, learning.png).

    .venv/bin/python bench/learning.py --minutes 6 --out .tracetrain/bench-learning
    .venv/bin/python bench/learning.py --task lookup --minutes 15 --out .tracetrain/bench-learning-lookup

``--task lookup`` races on the tool task (tracetrain_demo/lookup.py): tracetrain's agent is the
openai SDK's tool loop through the proxy (its first call with ``tool_choice="required"``, which vLLM
turns into a constrained, well-formed call); TRL runs ``GRPOTrainer(tools=[find_hotel])``, its
multi-turn tool mode (TRL 1.16: generate, parse the tool calls with the template's response parser,
run the tool, append the result, generate again, up to ``max_tool_calling_iterations``), with the
same chat template. TRL generates with transformers and cannot constrain the first call.

``--task agents-sdk`` races an OpenAI Agents SDK agent (tracetrain_demo/agents_sdk.py: ``Agent`` +
``function_tool`` + ``Runner.run`` through the proxy's ``/v1/responses``) against the same TRL tool mode:
TRL 1.16 has no mode that runs an agent program (its ``rollout_func`` needs token ids from a generation
server it serves itself, ``trl vllm-serve``, which supports vLLM 0.22-0.31), so the comparable is its
tool loop on the same instructions, requests, tool, template and checker (the tool task's). The judge asks
vLLM through Chat Completions what the proxy sends it for the SDK's Responses calls (the tool task's
agent: the same system turn, request, tool and tool result, rendered to the same prompt:
tests/test_demo_agents_sdk.py), since vLLM's own /v1/responses renders a conversation its own way.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

# bench/ is not a package: this script's folder is first on sys.path, so its helpers import as top-level names.
from _learn.evaluate import REPO, Judge

from tracetrain_demo.report import save_success_plot, success_axes

# A task whose agent speaks another API, and the chat task whose agent sends vLLM the same conversation: TRL
# trains on that one, and the judge measures with its agent.
_CHAT_TWIN = {"agents-sdk": "lookup"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Run it on a quiet machine: it takes about 2 x MINUTES + 10 minutes.",
                                )  # fmt: skip
    p.add_argument("--minutes", type=float, default=6.0, help="each side's training budget (default 6)")
    p.add_argument("--data-dir", type=Path, default=REPO / ".tracetrain", help="where the model is (and is pulled)")
    p.add_argument("--out", type=Path, default=REPO / ".tracetrain" / "bench-learning", help="results and plot")
    p.add_argument("--eval-attempts", type=int, default=2, help="attempts per held-out request (default 2)")
    p.add_argument("--reuse", action="store_true", help="skip a side whose adapters are already in OUT")
    p.add_argument("--task", choices=["city", "lookup", "agents-sdk"], default="city",
                   help="the demo's task (default city); lookup: a function tool over two calls or more, TRL in its "
                   "tools= mode; agents-sdk: the same lookup by an OpenAI Agents SDK agent, against TRL's tools= "
                   "mode")  # fmt: skip
    args = p.parse_args()
    args.out = args.out.resolve()  # adapter paths go to vLLM, whose working directory may differ
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = _pull(args.data_dir)

    ours = args.out / "tracetrain"
    if not (args.reuse and (ours / "steps.jsonl").exists()):
        _run_ours(args, ours)
    trl = args.out / "trl"
    if not (args.reuse and (trl / "steps.jsonl").exists()):
        _say(f"TRL GRPOTrainer for {args.minutes:g} minutes (log: {trl / 'trl.log'})")
        trl.mkdir(parents=True, exist_ok=True)
        with (trl / "trl.log").open("w") as log:
            subprocess.run([sys.executable, str(REPO / "bench" / "_learn" / "trl_loop.py"), "--model-dir",
                            str(model_dir), "--out", str(trl), "--minutes", str(args.minutes), "--task",
                            _CHAT_TWIN.get(args.task, args.task)],
                           stdout=log, stderr=subprocess.STDOUT, check=True)  # fmt: skip

    marks = [float(m) for m in range(int(args.minutes) + 1)]
    if marks[-1] < args.minutes:
        marks.append(args.minutes)
    sides = {"tracetrain": _steps(ours), "trl": _steps(trl)}
    rows = []
    _say(f"measuring held-out success at minutes {', '.join(f'{m:g}' for m in marks)} (a fresh vLLM)")
    with Judge(model_dir, args.out / "judge", args.eval_attempts, _CHAT_TWIN.get(args.task, args.task)) as judge:
        base = judge.success("base", None)
        for mark in marks:
            row: dict[str, float | int | None] = {"minute": mark}
            for side, steps in sides.items():
                done = [s for s in steps if s["seconds"] <= mark * 60]
                step = done[-1] if done else None
                row[f"{side}_steps"] = step["step"] if step else 0
                row[side] = judge.success(f"{side}-{step['step']}", Path(step["path"])) if step else base
            rows.append(row)
            _say(f"minute {mark:g}: tracetrain {row['tracetrain']:.0%} (step {row['tracetrain_steps']}), "
                 f"TRL {row['trl']:.0%} (step {row['trl_steps']})")  # fmt: skip
    (args.out / "results.json").write_text(json.dumps({"rows": rows, "sides": sides}, indent=2))
    _table(rows)
    _say(f"plot: {_plot(rows, args.out / 'learning.png', args.eval_attempts, args.task)}")
    return 0


def _run_ours(args: argparse.Namespace, out: Path) -> None:
    """``tracetrain demo`` for the budget; its adapters, copied as each appears, and their times go to ``out``.

    Copied while the demo runs: serve's retention (``--keep-versions``) deletes all but the newest
    versions' files, and every minute mark needs the version that was newest then.
    """
    _say(f"tracetrain demo for {args.minutes:g} minutes (log: {out / 'demo.log'})")
    out.mkdir(parents=True, exist_ok=True)
    run = args.data_dir / "demo"
    with (out / "demo.log").open("w") as log:
        demo = subprocess.Popen([sys.executable, "-m", "tracetrain_cli", "demo", "--data-dir", str(args.data_dir),
                                 "--minutes", str(args.minutes), "--eval-attempts", "0", "--task", args.task],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        while demo.poll() is None:
            _keep_adapters(run / "adapters" / "agent", out)
            time.sleep(1.0)
    if demo.returncode:
        raise subprocess.CalledProcessError(demo.returncode, demo.args)
    _keep_adapters(run / "adapters" / "agent", out)
    began = json.loads((run / "results.json").read_text())["training_began"]
    with sqlite3.connect(run / "tracetrain.db") as db:
        adapters = db.execute("SELECT version, created_at FROM adapters WHERE policy = 'agent' "
                              "ORDER BY version").fetchall()  # fmt: skip
    with (out / "steps.jsonl").open("w") as steps:
        for version, created_at in adapters:
            kept = out / f"step-{version}"
            if kept.is_dir():  # a version pruned before it was copied (a copy missed by the 1 s poll) is left out
                steps.write(json.dumps({"step": version, "seconds": created_at - began, "path": str(kept)}) + "\n")


def _keep_adapters(adapters: Path, out: Path) -> None:
    """Copy every adapter directory not copied yet (the trainer writes one in a hidden directory, then renames it)."""
    for version in sorted(adapters.iterdir()) if adapters.is_dir() else []:
        kept = out / f"step-{version.name}"
        if not version.name.isdigit() or kept.exists():
            continue
        try:
            shutil.copytree(version, out / f".copying-{version.name}", dirs_exist_ok=True)
        except (OSError, shutil.Error):  # pruned while being copied
            continue
        (out / f".copying-{version.name}").rename(kept)


def _steps(side: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (side / "steps.jsonl").read_text().splitlines() if line]


def _table(rows: list[dict[str, float | int | None]]) -> None:
    print(f"\n{'minute':>6} {'tracetrain':>10} {'steps':>5} {'TRL':>6} {'steps':>5} {'ahead by':>8}")
    for r in rows:
        ahead = (float(r["tracetrain"] or 0) - float(r["trl"] or 0)) * 100
        print(f"{r['minute']:>6g} {r['tracetrain']:>10.0%} {r['tracetrain_steps']:>5} {r['trl']:>6.0%} "
              f"{r['trl_steps']:>5} {ahead:>+7.0f}p")  # fmt: skip


def _plot(rows: list[dict[str, float | int | None]], path: Path, attempts: int, task: str) -> Path:
    fig, ax = success_axes()
    minutes = [r["minute"] for r in rows]
    for side, label in (("tracetrain", "tracetrain (vLLM samples while the trainer trains)"),
                        ("trl", "TRL GRPOTrainer (generate, then train)")):  # fmt: skip
        ax.plot(minutes, [r[side] for r in rows], marker="o", label=label)
    ax.set_xlabel("minutes of training (same machine, 2 CPU cores)")
    ax.set_ylabel(f"held-out success (100 requests x {attempts})")
    ax.set_title(f"The demo's {task} task on SmolLM2-135M + LoRA: held-out success")
    return save_success_plot(fig, ax, path)


def _pull(data_dir: Path) -> Path:
    done = subprocess.run([sys.executable, "-m", "trainer.pull", "--data-dir", str(data_dir)], cwd=REPO,
                          stdout=subprocess.PIPE, text=True, check=True)  # fmt: skip
    return Path(done.stdout.strip().splitlines()[-1])


def _say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
