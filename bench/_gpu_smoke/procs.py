"""``--trainer-procs 2``: two processes (NCCL on two GPUs; gloo with --model tiny on a CPU) record the adapter
one process records, for DDP and for FSDP (``--shard``).

The same queued job in two stores; ``python -m trainer --once`` on one process, then ``--procs 2``
(torchrun), and the adapters compared: max over LoRA tensors of max|a - b| / max|a|. The order of the
float additions differs (each rank sums its own micro-batches), so they agree to ~1e-4 relative, not bit
for bit (tests/test_trainer_distributed.py says why).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

from _gpu_smoke.handover import POLICY, _seed
from _gpu_smoke.model import REPO, vocab_size
from _gpu_smoke.report import Skip


def two_procs(ctx: dict[str, Any], figures: dict[str, Any]) -> str:
    device = ctx["device"]
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            raise Skip(f"--trainer-procs 2 over NCCL needs two GPUs; {torch.cuda.device_count()} here")
    elif ctx["model"] != "tiny":
        raise Skip("no GPU: two processes of a 1.5B model on a CPU take minutes (--model tiny runs gloo here)")
    try:
        import sqlalchemy  # noqa: F401
    except ImportError:
        raise Skip("the store's packages are not installed: pip install 'tracetrain[proxy]'") from None
    from safetensors.torch import load_file

    notes = []
    for flags in ([], ["--shard"]):
        name = "fsdp" if flags else "ddp"
        adapters, norms = {}, {}
        for procs in (1, 2):
            data = ctx["out_dir"] / f"procs-{name}-{procs}"
            url = f"sqlite+aiosqlite:///{data / 'store.db'}"
            data.mkdir(parents=True, exist_ok=True)
            asyncio.run(_seed_store(url, vocab_size(ctx["model_dir"])))
            command = [sys.executable, "-m", "trainer", "--database-url", url, "--data-dir", str(data), "--policy",
                       POLICY, "--base-model", str(ctx["model_dir"]), "--device", device, "--once", "--lora-r", "16",
                       "--micro-batch-tokens", str(ctx["micro_batch_tokens"]),
                       *(["--procs", "2", *flags] if procs == 2 else [])]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
            ran = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
            assert ran.returncode == 0, (ran.stdout + ran.stderr)[-3000:]
            saved = data / "adapters" / POLICY / "1"
            adapters[procs] = load_file(saved / "adapter_model.safetensors")
            norms[procs] = json.loads((saved / "metrics.json").read_text())["grad_norm"]
        worst = max(float((adapters[2][k].float() - v.float()).abs().max() / v.float().abs().max().clamp_min(1e-12))
                    for k, v in adapters[1].items())  # fmt: skip
        # AdamW's first update is nearly blind to the gradient's scale: the grad norm says the ranks summed.
        norm = abs(norms[2] - norms[1]) / norms[1]
        figures[f"{name}_max_relative_difference"] = worst
        figures[f"{name}_grad_norm_relative_difference"] = norm
        assert worst < 1e-2, f"{name}: the adapters of 1 and 2 processes differ by {worst:.2g} (relative)"
        assert norm < 1e-3, f"{name}: the grad norms of 1 and 2 processes differ by {norm:.2g} (relative)"
        notes.append(f"{name} {worst:.1g} (grad norm {norm:.1g})")
    return "2 processes record the adapter 1 process does: " + ", ".join(notes)


async def _seed_store(url: str, vocab: int) -> None:
    from store import Store

    store = await Store.open(url, capture=False)
    try:
        await _seed(store, "procs", vocab, completion=256)
    finally:
        await store.close()
