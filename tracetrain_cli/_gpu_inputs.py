"""What the GPU plan is made from: nvidia-smi's GPUs, the model directory's shape, the trainer's settings.

Read without torch: GPUs from ``nvidia-smi --query-gpu`` (a subprocess), the model from its
config.json and the headers of its safetensors files (8 bytes of length, then JSON naming each
tensor's dtype and shape; the data is never read), the trainer's LoRA and micro-batch settings
from the ``--trainer-arg`` flags serve passes it.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tracetrain_cli._gpu_estimate import Gpu, ModelShape, PlanError, TrainerNeeds
from tracetrain_core import TrainConfig, add_train_config_flags, train_config_from

NVIDIA_SMI = ("nvidia-smi", "--query-gpu=index,name,memory.total,memory.used", "--format=csv,noheader,nounits")

# Bytes per element as stored; a float tensor of 16 bits or more is loaded in bf16 (2 bytes).
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}  # fmt: skip
_FLOATS = {"F16", "BF16", "F32", "F64"}


def parse_nvidia_smi(text: str) -> tuple[Gpu, ...]:
    """GPUs from ``nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv,noheader,nounits``.

    >>> parse_nvidia_smi("0, NVIDIA H100 80GB HBM3, 81559, 1024\\n")[0].used_mib
    1024
    """
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        try:
            if len(fields) < 4:
                raise ValueError(line)
            gpus.append(Gpu(int(fields[0]), ", ".join(fields[1:-2]), int(fields[-2]), int(fields[-1])))
        except ValueError:
            raise PlanError(
                f"cannot read nvidia-smi's line {line.strip()!r} (expected index, name, total MiB, used MiB; "
                "a GPU in MIG mode reports no memory: plan it by hand with --vllm-gpus, --trainer-gpus and "
                "--gpu-memory-utilization)"
            ) from None
    return tuple(gpus)


def query_gpus() -> tuple[Gpu, ...]:
    """The GPUs nvidia-smi lists (all of them: CUDA_VISIBLE_DEVICES does not apply to it)."""
    try:
        done = subprocess.run(NVIDIA_SMI, capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        raise PlanError("--device cuda needs the NVIDIA driver's nvidia-smi on PATH; none was found") from None
    except subprocess.TimeoutExpired:
        raise PlanError("nvidia-smi did not answer within 60 s") from None
    if done.returncode != 0:
        raise PlanError(f"nvidia-smi failed (status {done.returncode}): {(done.stderr or done.stdout).strip()}")
    return parse_nvidia_smi(done.stdout)


def visible_gpus(gpus: Sequence[Gpu], cuda_visible_devices: str | None) -> tuple[Gpu, ...]:
    """The GPUs this process may use: all, or those CUDA_VISIBLE_DEVICES names (as nvidia-smi's indices)."""
    if cuda_visible_devices is None:
        return tuple(gpus)
    names = [n.strip() for n in cuda_visible_devices.split(",") if n.strip()]
    if not all(n.isdigit() for n in names):
        raise PlanError(
            f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}: the plan reads GPU indices only (not UUIDs or MIG "
            "names); unset it and choose GPUs with --vllm-gpus and --trainer-gpus"
        )
    by_index = {g.index: g for g in gpus}
    return tuple(by_index[int(n)] for n in names if int(n) in by_index)


def read_model_shape(model_dir: Path) -> ModelShape:
    """Parameters and linear-layer sizes from the safetensors headers when there are any, else from config.json."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot read {model_dir / 'config.json'}: {exc}") from None
    config = config.get("text_config", config)  # a multimodal model's language half

    def get(*names: str, default: int | None = None) -> int:
        for name in names:
            if isinstance(config.get(name), int):
                return int(config[name])
        if default is None:
            raise PlanError(f"{model_dir / 'config.json'} has no {names[0]}: the GPU plan cannot size the model")
        return default

    hidden = get("hidden_size", "n_embd", "d_model")
    heads = get("num_attention_heads", "n_head")
    shape = {
        "hidden": hidden,
        "layers": get("num_hidden_layers", "n_layer", "num_layers"),
        "intermediate": get("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden),
        "vocab": get("vocab_size"),
        "heads": heads,
        "kv_heads": get("num_key_value_heads", default=heads),
        "head_dim": get("head_dim", default=hidden // heads),
    }
    context = config.get("max_position_embeddings")
    max_context = context if isinstance(context, int) and context > 0 else None
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        params, weight_bytes, sizes = _from_safetensors(files)
        return ModelShape(params=params, weight_bytes=weight_bytes, linear_sizes=sizes,
                          source="safetensors headers", max_context=max_context, **shape)  # fmt: skip
    params, sizes = _from_config(**shape, tied=bool(config.get("tie_word_embeddings", False)))
    return ModelShape(params=params, weight_bytes=2 * params, linear_sizes=sizes, source="config.json",
                      max_context=max_context, **shape)  # fmt: skip


def _from_safetensors(files: Sequence[Path]) -> tuple[int, int, dict[str, int]]:
    params = weight_bytes = 0
    sizes: dict[str, int] = {}
    for path in files:
        for name, (dtype, dims) in _safetensors_header(path).items():
            count = math.prod(dims)
            params += count
            weight_bytes += count * (2 if dtype in _FLOATS else _DTYPE_BYTES.get(dtype, 2))
            if len(dims) == 2 and name.endswith(".weight"):  # a linear layer's (out, in)
                module = name.rsplit(".", 2)[-2]
                sizes[module] = sizes.get(module, 0) + dims[0] + dims[1]
    return params, weight_bytes, sizes


def _safetensors_header(path: Path) -> dict[str, tuple[str, list[int]]]:
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 256 * 1024**2:
                raise ValueError(f"a header of {length} bytes")
            header: dict[str, Any] = json.loads(f.read(length))
        return {k: (str(v["dtype"]), [int(d) for d in v["shape"]]) for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise PlanError(f"cannot read the safetensors header of {path}: {exc}") from None


def _from_config(
    *, hidden: int, layers: int, intermediate: int, vocab: int, heads: int, kv_heads: int, head_dim: int, tied: bool
) -> tuple[int, dict[str, int]]:
    """A Llama-style decoder's parameters (biases ignored) and each linear module's in + out, summed over layers."""
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }
    sizes = {name: layers * (i + o) for name, (i, o) in per_layer.items()}
    params = layers * (sum(i * o for i, o in per_layer.values()) + 2 * hidden) + hidden + vocab * hidden
    if not tied:
        params += vocab * hidden
        sizes["lm_head"] = hidden + vocab
    return params, sizes


def trainer_needs(trainer_args: Sequence[str], procs: int = 1) -> TrainerNeeds:
    """The settings that size the trainer, read by the trainer's own flags (``--trainer-arg``) into its own
    configuration (``TrainConfig``: its defaults where they say nothing), as ``python -m trainer`` reads them.

    An ``--init-adapter`` (a warm start) brings its own rank and targets, which then win, as in the learner.
    """
    config = trainer_config(trainer_args)
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--init-adapter", type=Path)
    try:
        args, _ = parser.parse_known_args(list(trainer_args))
        adapter: dict[str, Any] = (
            json.loads((args.init_adapter / "adapter_config.json").read_text()) if args.init_adapter else {}
        )
        return TrainerNeeds(
            lora_r=int(adapter.get("r") or config.lora_r),
            target_modules=tuple(adapter.get("target_modules") or config.target_modules),
            micro_batch_tokens=config.micro_batch_tokens,
            logprob_chunk_tokens=config.logprob_chunk_tokens,
            bytes_per_param=4 if config.dtype == "float32" else 2,
            procs=procs,
        )
    except (argparse.ArgumentError, OSError, ValueError, TypeError) as exc:
        raise PlanError(f"cannot read the trainer's settings from --trainer-arg: {exc}") from None


def trainer_config(trainer_args: Sequence[str]) -> TrainConfig:
    """The trainer's configuration its flags (``--trainer-arg``) make (``PlanError`` if they cannot be read)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    add_train_config_flags(parser)
    try:
        args, _ = parser.parse_known_args(list(trainer_args))
        return train_config_from(args, args.config.read_text() if args.config else None)
    except (argparse.ArgumentError, OSError, ValueError) as exc:
        raise PlanError(f"cannot read the trainer's settings from --trainer-arg: {exc}") from None


def host_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """This machine's RAM in bytes (MemTotal), or None where /proc/meminfo cannot be read (not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "MemTotal":
                return int(value.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None
