"""Adapter directories: written whole or not at all, found by step, resumed exactly.

``<data>/adapters/<policy>/<step>/`` holds what vLLM loads (peft's ``adapter_config.json``
and ``adapter_model.safetensors``), the config the adapter was trained with
(``trainer_config.json``), the step's metrics (``metrics.json``) and the AdamW state
(``optimizer.pt``) that lets a resumed run continue exactly where this one stopped.
A directory is written under a hidden temporary name beside its final one and renamed
into place, so a reader (vLLM, the worker after a crash) never sees half an adapter.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel

from store import AdapterFile
from trainer._config import TrainConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TRAINER_CONFIG = "trainer_config.json"
METRICS = "metrics.json"
OPTIMIZER = "optimizer.pt"
# What makes a step directory complete. optimizer.pt is optional: without it a resume
# starts AdamW's moments afresh (and an SFT warm start never has one).
REQUIRED_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, TRAINER_CONFIG, METRICS)


def files_for_store(adapter_dir: Path) -> list[AdapterFile]:
    """The files a vLLM elsewhere needs (all but the optimizer state, which only the trainer reads)."""
    return [AdapterFile(name, (adapter_dir / name).read_bytes()) for name in REQUIRED_FILES]


def write_adapter_dir(
    out_dir: Path,
    model: PeftModel,
    optimizer: torch.optim.Optimizer,
    param_names: Sequence[str],
    cfg: TrainConfig,
    metrics: Mapping[str, Any],
    *,
    lora_state: Mapping[str, torch.Tensor] | None = None,
    optimizer_state: Mapping[str, Any] | None = None,
) -> None:
    """Write the adapter, config, metrics and optimizer state to ``out_dir`` atomically.

    ``lora_state`` and ``optimizer_state`` replace what ``model`` and ``optimizer`` hold when those
    are sharded (``trainer._sharded``: gathered whole beforehand, by parameter name and as
    ``optimizer.state_dict()``). Raises FileExistsError if ``out_dir`` exists: a published adapter may already be
    loaded by vLLM under that name, so it is never rewritten in place.
    """
    if out_dir.exists():
        raise FileExistsError(f"adapter directory already exists, refusing to overwrite: {out_dir}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    try:
        if lora_state is None:
            model.save_pretrained(str(work))
        else:
            model.save_pretrained(str(work), state_dict=dict(lora_state))
        (work / TRAINER_CONFIG).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        (work / METRICS).write_text(json.dumps(dict(metrics), indent=2, sort_keys=True) + "\n")
        state = optimizer.state_dict() if optimizer_state is None else dict(optimizer_state)
        torch.save({"param_names": list(param_names), "optimizer": state}, work / OPTIMIZER)
        work.rename(out_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def load_optimizer_state(
    adapter_dir: Path,
    optimizer: torch.optim.Optimizer,
    param_names: Sequence[str],
    cfg: TrainConfig,
    place: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> bool:
    """Restore AdamW's state saved beside an adapter; False when there is none to restore.

    The learning rate and weight decay stay ``cfg``'s (a resumed run may change them);
    the moments and step counts are the saved ones. Raises ValueError when the state was
    saved for other trainable parameters (another LoRA rank or target set). ``place`` maps the
    saved state before it is loaded (sharded parameters: ``trainer._sharded.shard_optimizer_state``).
    """
    path = adapter_dir / OPTIMIZER
    if not path.is_file():
        return False
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if list(saved["param_names"]) != list(param_names):
        raise ValueError(f"{path} was saved for other trainable parameters than this adapter's")
    # load_state_dict moves the state to each parameter's device
    optimizer.load_state_dict(place(saved["optimizer"]) if place else saved["optimizer"])
    for group in optimizer.param_groups:
        group["lr"] = cfg.learning_rate
        group["weight_decay"] = cfg.weight_decay
    return True


def is_complete(adapter_dir: Path) -> bool:
    """Whether ``adapter_dir`` holds every file a published step directory must have."""
    return all((adapter_dir / name).is_file() for name in REQUIRED_FILES)


def newest_adapter(root: Path) -> tuple[int, Path] | None:
    """The highest complete integer step directory under ``root`` (``<data>/adapters/<policy>``).

    Entries that are not plain decimal names (the ``.N.tmp-PID`` dirs of a write in
    progress, stray files) and incomplete directories are ignored; None when there is none.

    >>> newest_adapter(Path("/nonexistent")) is None
    True
    """
    if not root.is_dir():
        return None
    steps = [
        (int(entry.name), entry)
        for entry in root.iterdir()
        if entry.name.isascii() and entry.name.isdecimal() and entry.is_dir() and is_complete(entry)
    ]
    return max(steps, default=None)
