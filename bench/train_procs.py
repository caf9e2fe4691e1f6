"""The same GRPO steps on 1 and on 2 processes (torchrun, gloo): tokens/s side by side, and how equal the adapters are.

The parent never imports torch. A first subprocess builds a moderate random Llama (hidden
256, 4 layers, 8 heads of 32, vocabulary 8192: about 7M weights, big enough that a step is
mostly compute, small enough for a quick run) and the batch: ``--samples`` samples of
``--prompt`` + ``--completion`` random tokens in GRPO groups of ``--group-size`` that share
their prompt, advantages +-1, on-policy old log-probs. Then the contenders, each starting
from the same seeded LoRA and taking ``--steps`` optimizer steps after 1 warm-up step:

- ``1 process``: ``Learner.step`` with torch on ``--threads`` threads;
- ``2 processes``: ``python -m torch.distributed.run --standalone --nproc-per-node 2``, each
  rank on ``--threads / 2`` threads, taking every other micro-batch; gradients all-reduced;
- ``1 process, half the threads``: the reference for float noise. Another thread count adds
  the same numbers in another order, as two ranks do; its adapter differs from the first
  one's by about as much.

tokens/s is the batch's tokens over rank 0's step time (median). The adapters are compared
with the first contender's after the first step and after the last: max over LoRA tensors
of max|a - b| / max|a|. LoRA B starts at zero, so after a few steps of lr 1e-4 its entries
are small and AdamW's lr * m / (sqrt(v) + eps) amplifies float noise in gradients that sum
to nearly zero: the relative difference grows with the steps for every contender alike.

    .venv/bin/python bench/train_procs.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONTENDERS = ("1 process", "2 processes", "1 process, half the threads")
MODEL = {"vocab_size": 8192, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 2048}  # fmt: skip


def train_config(opts: argparse.Namespace) -> Any:
    from trainer import TrainConfig

    return TrainConfig(lora_r=16, lora_alpha=32, learning_rate=1e-4, dtype="float32",
                       micro_batch_tokens=opts.micro_batch_tokens)  # fmt: skip


def prepare(work: Path, opts: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer import Learner, Sample, TrainItem

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(work / "model")
    g = torch.Generator().manual_seed(0)
    n, p, c = opts.samples, opts.prompt, opts.completion
    ids = torch.randint(3, MODEL["vocab_size"], (n, p + c), generator=g)  # (N, P+C)
    ids[:, :p] = ids[:: opts.group_size, :p].repeat_interleave(opts.group_size, 0)[:n]  # (N, P) a group's prompt
    samples = [Sample(row, [False] * p + [True] * c, [0.0] * (p + c), 1, 0) for row in ids.tolist()]
    learner = Learner(work / "model", train_config(opts))
    old = [[v if m else 0.0 for v, m in zip(lp.tolist(), s.loss_mask, strict=True)]
           for lp, s in zip(learner.logprobs(samples), samples, strict=True)]  # fmt: skip
    items = [TrainItem(Sample(s.token_ids, s.loss_mask, o, 1, 0), float(k % 2 * 2 - 1))
             for k, (s, o) in enumerate(zip(samples, old, strict=True))]  # fmt: skip
    torch.save(items, work / "items.pt")


def step(work: Path, name: str, opts: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import save_file

    from trainer import Learner
    from trainer._distributed import Ranks, finish, start

    group = Ranks.from_env()
    if group is not None:
        start(group, "cpu")
    items = torch.load(work / "items.pt", weights_only=False)
    learner = Learner(work / "model", train_config(opts))
    leads = group is None or group.leads
    results = []
    for k in range(1 + opts.steps):
        results.append(learner.step(items))
        if leads and k in (0, opts.steps):
            lora = {n: p.detach().contiguous() for n, p in learner.model.named_parameters() if p.requires_grad}
            save_file(lora, work / f"{name}-{k + 1}.safetensors")
    if leads:
        (work / f"{name}.json").write_text(json.dumps([r.to_dict() for r in results[1:]]))
    finish()


def compare(work: Path, names: list[str], steps: int) -> dict[str, list[float]]:
    """Each contender's adapter against the first's, after the first and the last step.

    Worst LoRA tensor by max|a - b| / max|a|, then worst by ||a - b|| / ||a||.
    """
    from safetensors.torch import load_file

    out: dict[str, list[float]] = {}
    for name in names[1:]:
        out[name] = []
        for norm in ("max", "l2"):
            for k in (1, 1 + steps):
                a, b = (load_file(work / f"{n}-{k}.safetensors") for n in (names[0], name))
                if norm == "max":
                    out[name].append(max(float((a[t] - b[t]).abs().max() / a[t].abs().max()) for t in a))
                else:
                    out[name].append(max(float((a[t] - b[t]).norm() / a[t].norm()) for t in a))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--micro-batch-tokens", type=int, default=512, help="a group per micro-batch by default")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after 1 warm-up step")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="torch threads in all")
    parser.add_argument("--role", choices=["prepare", "step", "compare"], help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.role == "prepare":
        prepare(opts.work, opts)
        return 0
    if opts.role == "step":
        step(opts.work, opts.name, opts)
        return 0
    if opts.role == "compare":
        print(json.dumps(compare(opts.work, list(CONTENDERS), opts.steps)))
        return 0

    path = os.pathsep.join([str(REPO), str(REPO / "sdk"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(opts).items() if k not in ("role", "name", "work")]
    me = [sys.executable, str(Path(__file__).resolve())]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        subprocess.run([*me, "--role=prepare", f"--work={work}", *flags], env=env, check=True)
        half = max(1, opts.threads // 2)
        runs = dict(zip(CONTENDERS, [(me, opts.threads), ([*torchrun, *me[1:]], half), (me, half)], strict=True))
        for name, (command, threads) in runs.items():
            subprocess.run([*command, "--role=step", f"--name={name}", f"--work={work}", *flags],
                           env={**env, "OMP_NUM_THREADS": str(threads)}, check=True)  # fmt: skip
        results = {name: json.loads((work / f"{name}.json").read_text()) for name in runs}
        rel = json.loads(subprocess.run([*me, "--role=compare", f"--work={work}", *flags], env=env, check=True,
                                        capture_output=True, text=True).stdout)  # fmt: skip

    tokens = results["1 process"][0]["tokens"]
    speed = {name: tokens / statistics.median(r["seconds"] for r in steps) for name, steps in results.items()}
    first = {name: steps[0] for name, steps in results.items()}
    print(f"\nbatch: {opts.samples} samples x ({opts.prompt} + {opts.completion}) tokens in groups of "
          f"{opts.group_size}, {first['1 process']['micro_batches']} micro-batches of <= {opts.micro_batch_tokens} "
          f"tokens; {opts.steps} timed steps after 1 warm-up; {opts.threads} torch threads in all\n")  # fmt: skip
    last = 1 + opts.steps
    print(f"load average at the start: {load[0]:.1f} on {os.cpu_count()} cores (above ~0.5, other processes were "
          "running: torch's threads then wait for each other and the 1-process row suffers most)\n")  # fmt: skip
    print(f"| | tokens/s | vs 1 process | loss, grad norm (1st timed step) | adapter vs 1 process, max rel. diff "
          f"after step 1, {last} | the same by L2 norm |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name in runs:
        d = rel.get(name)
        diff = f"{d[0]:.1e}, {d[1]:.1e} | {d[2]:.1e}, {d[3]:.1e}" if d else "- | -"
        print(f"| {name} | {speed[name]:.0f} | {speed[name] / speed['1 process']:.2f}x | "
              f"{first[name]['loss']:.7f}, {first[name]['grad_norm']:.7f} | {diff} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
