"""The first step of each contender against ours: losses, pre-clip gradient norms, the LoRA gradients."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .config import THREADS


def compare(work: Path, names: list[str]) -> dict[str, Any]:
    """Cosine and relative L2 difference of each contender's first-step LoRA gradients against the first's."""
    import torch

    def flat(name: str) -> torch.Tensor:
        grads = torch.load(work / f"grads_{name}.pt")
        return torch.cat([grads[k].flatten().double() for k in sorted(grads)])

    ref = flat(names[0])
    out = {}
    for name in names[1:]:
        g = flat(name)
        out[name] = {
            "cosine": float(torch.nn.functional.cosine_similarity(ref, g, dim=0)),
            "rel_l2_diff": float((g - ref).norm() / ref.norm()),
        }
    return out


def first_step_agreement(work: Path, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The expected first-step loss, and each contender's first step against ours."""
    import torch  # only now: the contenders have finished

    torch.set_num_threads(THREADS)
    batch = torch.load(work / "batch.pt")
    by_name = {r["name"]: r for r in results}
    gradients = compare(work, [r["name"] for r in results])
    for name, c in gradients.items():
        a, b = by_name["ours"]["first_step"], by_name[name]["first_step"]
        c["grad_norm_rel_diff"] = abs(b["grad_norm"] - a["grad_norm"]) / a["grad_norm"]
        c["loss_abs_diff"] = abs(b["loss"] - a["loss"])
    return {"expected_loss": -float(batch["advantages"].mean()), "gradients": gradients}
