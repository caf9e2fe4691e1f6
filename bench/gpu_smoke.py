"""The GPU path at real sizes, in one command: what a GPU box must show before `serve --share-gpu` is trusted.

    python bench/gpu_smoke.py --out /tmp/smoke                 # on a GPU: Qwen2.5-1.5B's shape, random weights
    python bench/gpu_smoke.py --model tiny --device cpu        # the script's own paths on a CPU, in a minute

Sections, each ok, failed or skipped with the reason (a machine without a GPU skips what needs one):

- ``plan``: ``tracetrain serve --plan-only --device cuda`` on the model, with the real nvidia-smi;
- ``steps``: real training steps (bf16, LoRA r=16 on all seven projections, 4096-token micro-batches):
  the trainer's resident memory and step peak beside the plan's estimates, with the ratios;
- ``oom``: a step that runs out of GPU memory for real; the memory is back (torch and nvidia-smi)
  once ``release_step_memory`` ran, while the error is still referenced, and the next step works;
- ``handover``: two hand-overs driven by the real proxy's coordinator against the tests' fake vLLM,
  whose wake needs the trainer's memory back, with the real worker stepping on the GPU (a good step,
  then one that runs out of memory);
- ``tree_attention``: a split reasoning trajectory as one prefix tree under flash attention's varlen
  kernel against each sample alone under sdpa: log-probs within bf16's precision, tokens and step times;
- ``two_procs``: ``--trainer-procs 2`` over NCCL, DDP and FSDP, adapter equal to one process's (two GPUs);
- ``vllm_sleep``, ``vllm_streams``: real vLLM's sleep mode (memory held asleep against the plan's
  figure, fixed-seed output before and after sleep, the adapter after the wake) and 64 streams
  through a hand-over; they need ``vllm`` with CUDA.

Writes ``gpu_smoke.json`` and ``gpu_smoke.md`` under ``--out`` and prints the Markdown. Exit status 1
when a section failed (skips are not failures). docs/GPU.md says how to read it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "sdk"), str(Path(__file__).resolve().parent)]

from _gpu_smoke import handover, procs, train, tree, vllm  # noqa: E402
from _gpu_smoke.model import build_model  # noqa: E402
from _gpu_smoke.report import Result, Skip, run_section, write  # noqa: E402

SECTIONS = ("plan", "steps", "oom", "handover", "tree_attention", "two_procs", "vllm_sleep", "vllm_streams")


def plan(ctx: dict[str, Any], figures: dict[str, Any]) -> str:
    """``serve --plan-only`` with the real nvidia-smi; its shared plan's numbers into the figures."""
    import shutil

    if shutil.which("nvidia-smi") is None:
        raise Skip("no nvidia-smi: --plan-only --device cuda reads the GPUs from it")
    try:
        from tracetrain_cli import main
    except ImportError as exc:
        raise Skip(f"tracetrain serve's packages are not installed ({exc.name})") from None
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["serve", "--plan-only", "--device", "cuda", "--model", str(ctx["model_dir"]), "--data-dir",
                       str(ctx["out_dir"] / "plan-data")])  # fmt: skip
    text = out.getvalue()
    (ctx["out_dir"] / "plan.txt").write_text(text)
    print(text, flush=True)
    fraction = next((line.split("--gpu-memory-utilization ")[1].split()[0] for line in text.splitlines()
                     if "--gpu-memory-utilization " in line), None)  # fmt: skip
    if fraction is not None:
        ctx["fraction"] = float(fraction)
        figures["gpu_memory_utilization"] = float(fraction)
    assert status == 0 and "plan (--device cuda)" in text, text
    return text.splitlines()[1].strip() if len(text.splitlines()) > 1 else text


SECTION_FUNCTIONS = {"plan": plan, "steps": train.steps, "oom": train.oom, "handover": handover.handover,
                     "tree_attention": tree.tree_attention, "two_procs": procs.two_procs, "vllm_sleep": vllm.vllm_sleep,
                     "vllm_streams": vllm.vllm_streams}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="where the report goes (default: a temporary directory)")
    p.add_argument("--model", choices=["qwen2.5-1.5b", "tiny"], default="qwen2.5-1.5b")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--steps", type=int, default=3, help="timed training steps after a warm-up (default 3)")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="default 4096 (tiny: 256)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--work", type=Path, default=None, help="where the model is built (default: --out)")
    args = p.parse_args(argv)
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu-smoke-"))
    out.mkdir(parents=True, exist_ok=True)  # the sections write into it before the report does
    work = args.work or out
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "no GPU"
    command = " ".join(["python bench/gpu_smoke.py", *(argv if argv is not None else sys.argv[1:])])
    header = {"gpu": gpu, "device": device, "model": args.model, "torch": torch.__version__,
              "cuda": torch.version.cuda, "gpus": torch.cuda.device_count(), "python": platform.python_version(),
              "command": command}  # fmt: skip
    print(f"gpu_smoke: {gpu}, {args.model}, report under {out}", flush=True)
    tokens = args.micro_batch_tokens or (256 if args.model == "tiny" else 4096)
    ctx: dict[str, Any] = {"device": device, "model": args.model, "out_dir": out, "steps": args.steps,
                           "micro_batch_tokens": tokens}  # fmt: skip
    results: list[Result] = [run_section("model", lambda f: _model(ctx, work, f), {})]
    for name in args.sections.split(","):
        if results[0].status != "ok":
            results.append(Result(name, "skipped", "the model could not be built"))
            continue
        results.append(run_section(name, lambda f, name=name: SECTION_FUNCTIONS[name](ctx, f), {}))
    print(write(results, header, out), flush=True)
    return 1 if any(r.status == "failed" for r in results) else 0


def _model(ctx: dict[str, Any], work: Path, figures: dict[str, Any]) -> str:
    ctx["model_dir"] = build_model(ctx["model"], work / "models", ctx["device"])
    figures["size_gib"] = round(sum(f.stat().st_size for f in ctx["model_dir"].glob("*.safetensors")) / 1024**3, 2)
    return str(ctx["model_dir"])


if __name__ == "__main__":
    sys.exit(main())
