"""What the estimate says will not fit of a GPU plan, in words that name the flags to change.

``_gpu_plan.py`` places vLLM and the trainer; these turn each shortfall into one sentence: what
needs how many GiB, what it gets, and the changes that would make it fit.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from tracetrain_cli._gpu_estimate import (
    MIN_KV_TOKENS,
    VLLM_ASLEEP,
    VLLM_RUNTIME,
    Gpu,
    Memory,
    ModelShape,
    TrainerNeeds,
    estimate_memory,
    gib,
)


def trainer_room(gpu: Gpu, with_vllm: bool, *, vllm_uses_free: bool = False) -> int:
    """What the trainer may use of ``gpu``: its free memory less the margin and, shared, a sleeping vLLM.

    ``vllm_uses_free``: the memory nvidia-smi counts as used is a vLLM of the user's (``--upstream``)
    that sleeps during each step, so the trainer's room is the GPU's total less what it keeps asleep.
    """
    available = gpu.total if vllm_uses_free else gpu.free
    return available - gpu.margin - (VLLM_ASLEEP if with_vllm else 0)


def vllm_problems(
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
        problems = [vllm_problem(gpu, tp, fraction, memory, shared)] if share < memory.vllm_need(tp) else []
        if share + (memory.trainer_resident if with_trainer else 0) + gpu.margin > gpu.free:
            beside = f" beside the trainer's resident {gib(memory.trainer_resident)} GiB" if with_trainer else ""
            problems.append(
                f"GPU {i}: vLLM's {fraction} ({gib(share)} GiB){beside} and the {gib(gpu.margin)} GiB margin "
                f"exceed its {gib(gpu.free)} GiB free: a smaller --gpu-memory-utilization"
            )
        if problems:
            return problems
    return []


def trainer_problems(
    by_index: Mapping[int, Gpu],
    trainer_gpus: tuple[int, ...],
    beside_vllm: Collection[int],
    memory: Memory,
    model: ModelShape,
    trainer: TrainerNeeds,
    *,
    vllm_uses_free: bool = False,
) -> list[str]:
    """What the estimate says will not fit of the trainer (a sleeping vLLM beside it), and what to change."""
    for i in trainer_gpus:
        gpu = by_index[i]
        room = trainer_room(gpu, i in beside_vllm, vllm_uses_free=vllm_uses_free)
        if memory.trainer_resident + memory.step > room:
            return [trainer_problem(gpu, room, memory, model, trainer, i in beside_vllm)]
    return []


def vllm_problem(gpu: Gpu, tp: int, fraction: float, memory: Memory, shared: bool) -> str:
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


def trainer_problem(
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
        procs = procs_to_shard(model, trainer, room)
        if procs is not None and procs > memory.shard_over:
            fixes.append(
                f"the base sharded over more trainer processes (--trainer-procs {procs} --trainer-shard, one GPU "
                "each; each process now holds " + ("the whole base)" if memory.shard_over == 1 else
                                                   f"1/{memory.shard_over} of it)")
            )  # fmt: skip
        fixes.append("a smaller --model")
    fixes.append("the trainer on a larger GPU elsewhere (--no-train here, python -m trainer there)")
    return text + ", ".join(fixes[:-1]) + (", or " if len(fixes) > 1 else "") + fixes[-1]


def procs_to_shard(model: ModelShape, trainer: TrainerNeeds, room: int) -> int | None:
    """The fewest trainer processes whose shards, and what a step gathers, leave room for activations."""
    for procs in (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
        m = estimate_memory(model, trainer, procs)
        if m.trainer_resident + m.gathered + m.logprobs < room:
            return procs
    return None
