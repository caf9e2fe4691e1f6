"""How much GPU memory vLLM and the trainer need: the estimate ``tracetrain serve --device cuda`` plans with.

Nothing here imports torch (the serving process never does); ``_gpu_inputs.py`` reads the GPUs
and the model's shape, ``_gpu_plan.py`` places the two sides. In bytes, with P parameters (weights
in bf16), L LoRA parameters (rank x (in + out) summed over the targeted linear layers of every
layer), h the hidden size, i the intermediate size, V the vocabulary, T micro_batch_tokens and C
logprob_chunk_tokens:

    trainer resident   2 P  +  16 L           bf16 base; LoRA fp32 4, AdamW's two moments 8, gradients 4
    trainer step       T x layers x ((24 h + 8 i) + peft's fp32 inputs)  +  C x V x 16
                                              activations + one log-prob chunk
    vLLM, per GPU      (2 P + slots + KV(32768 tokens)) / TP  +  2 GiB runtime
                       slots: --max-loras x 2 bytes x --max-lora-rank x (in + out) of every linear layer
                       (--max-loras: every policy's --keep-versions summed, plus one)
    vLLM asleep        1.7 GiB per GPU        what level 1 keeps: CUDA context, graphs, NCCL buffers
    margin, per GPU    max(2 GiB, 5% of the GPU)                           never planned for either side
    host RAM           2 P pinned (vLLM's level-1 backup of its weights, while it sleeps)
                       + 2 P per trainer process (the base is read on the host before it moves to the GPU,
                       at start and at each rebuild of the learner: after a rollback or a failed publish)
                       + slots (vLLM's host copies of the adapters it holds, --max-cpu-loras = --max-loras)

Sharded over N trainer processes (FSDP, ``--trainer-shard``), each holds (2 P + 16 L) / N, and a step
adds what FSDP gathers whole: the root (embeddings and lm_head: 2 V h, twice if untied), which stays
gathered through the step, and two decoder layers (the running one and the prefetched next one).

Each constant below says why it has its value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tracetrain_core import TrainConfig

MiB = 1024**2
GiB = 1024**3

# Per token and decoder layer, what the backward keeps of a Llama-style layer in bf16, no
# gradient checkpointing, fused attention (sdpa/flash: no T x T matrix is kept): the two RMSNorms'
# fp32 copies of their input (2 x 4h), the attention block's normed input, q, rotated q and
# output, o_proj's input (~10h), the MLP's input (2h), rounded up for k, v and the LoRA
# intermediates (4h); the SwiGLU MLP's gate, up, act(gate) and product (4 x 2i).
# Korthikanti et al. 2022 count 34h for a GPT layer (4h GeLU MLP, dropout masks); SwiGLU keeps more.
ACTIVATION_BYTES_PER_HIDDEN = 24
ACTIVATION_BYTES_PER_INTERMEDIATE = 8
# peft runs each LoRA layer in its adapter's dtype (fp32): it casts the layer's bf16 input to fp32
# (``_cast_input_dtype``) and lora_A keeps that copy for the backward, 4 bytes per input feature of
# every targeted linear, per token and layer: q, k, v and gate, up each copy the hidden state (4h
# each), o_proj its attention output, down_proj the intermediate (4i). For Qwen2.5-1.5B with all
# seven targets: +67% over the bf16 activations above. A float32 base has no such copies.
PEFT_INPUT_BYTES = 4
# One log-prob chunk's (C, V) logits live as bf16 (2), their fp32 copy (4), the fp32 log-softmax (4)
# and, in the backward, its fp32 gradient (4); 16 rounds up (trainer/_logprobs.py).
LOGIT_BYTES = 16
# Per LoRA parameter: the fp32 weight, AdamW's exp_avg and exp_avg_sq, the fp32 gradient.
LORA_STATE_BYTES = 16
# The values vLLM 0.32 accepts for --max-lora-rank.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# What vLLM needs beyond weights and KV cache on each GPU: the profiled forward's activations,
# CUDA graphs, sampler buffers. vLLM takes them out of its fraction before sizing the KV cache.
VLLM_RUNTIME = 2 * GiB
# What a sleeping vLLM keeps (level 1 frees only weights and KV cache): its CUDA context, CUDA
# graphs, NCCL and sampler buffers. Users measure 1.1 to 1.7 GiB per GPU at TP 1 (vllm-project/vllm
# issues 32714, NVIDIA-NeMo/RL 223; more at TP > 1); the plan takes the high end.
VLLM_ASLEEP = 1740 * MiB
# The smallest KV cache worth serving with: a GRPO group of 8 samples of 4096 tokens decoding together.
MIN_KV_TOKENS = 32_768
# vLLM's own default share of a GPU it has to itself.
DEDICATED_PERCENT = 90
# Kept free on every GPU: two CUDA contexts, allocator fragmentation, the estimate's error.
MARGIN_MIN = 2 * GiB
MARGIN_PERCENT = 5

_TRAINER = TrainConfig()  # the trainer's defaults, from its own declaration
DEFAULT_TARGET_MODULES = _TRAINER.target_modules
# The input each targeted linear casts to fp32 under peft, in units of (hidden, attention output, intermediate).
_PEFT_INPUT = {"q_proj": "h", "k_proj": "h", "v_proj": "h", "o_proj": "q", "gate_proj": "h", "up_proj": "h",
               "down_proj": "i"}  # fmt: skip


class PlanError(ValueError):
    """A plan that cannot work; the message says what to change."""


@dataclass(frozen=True)
class Gpu:
    """One GPU as nvidia-smi lists it (its index is nvidia-smi's, i.e. PCI bus order)."""

    index: int
    name: str
    total_mib: int
    used_mib: int

    @property
    def total(self) -> int:
        return self.total_mib * MiB

    @property
    def free(self) -> int:
        return max(0, self.total_mib - self.used_mib) * MiB

    @property
    def margin(self) -> int:
        return max(MARGIN_MIN, self.total * MARGIN_PERCENT // 100)


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know of the base model."""

    params: int
    weight_bytes: int  # loaded in bf16: 2 bytes a parameter (a quantized tensor: its stored size)
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    linear_sizes: Mapping[str, int]  # module name (q_proj, ...) -> sum over the model of (in + out)
    source: str  # where params came from: "safetensors headers" or "config.json"
    max_context: int | None = None  # config.json's max_position_embeddings: vLLM's default --max-model-len

    def lora_params(self, rank: int, targets: Sequence[str]) -> int:
        return rank * sum(self.linear_sizes.get(name, 0) for name in set(targets))

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16

    def valid_tp(self, tp: int) -> bool:
        """vLLM splits attention heads evenly; KV heads are split, or replicated when fewer than TP."""
        return tp >= 1 and self.heads % tp == 0 and (self.kv_heads % tp == 0 or tp % self.kv_heads == 0)


@dataclass(frozen=True)
class VllmLora:
    """vLLM's LoRA limits, which every adapter the trainer writes must fit.

    ``max_rank`` (``--max-lora-rank``): the smallest rank vLLM accepts at or above the trainer's
    (a larger adapter fails to load). ``max_loras`` (``--max-loras``): every version kept loaded, of every
    policy (each one's ``--keep-versions``, summed), plus the one being loaded before the oldest is unloaded;
    more when asked (policies to be added at run time, a canary's version). vLLM keeps as many in host RAM
    (``--max-cpu-loras`` defaults to it); a policy beyond them still serves, its adapter moved in on use.
    """

    max_rank: int = 16
    max_loras: int = 4

    @classmethod
    def for_training(cls, lora_r: int, keep_versions: int, *, max_loras: int | None = None) -> VllmLora:
        """``keep_versions``: the versions kept loaded over every policy served (the policies' windows summed)."""
        fitting = [rank for rank in VLLM_LORA_RANKS if rank >= lora_r]
        if not fitting:
            raise PlanError(f"LoRA rank {lora_r}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}")
        if max_loras is not None and max_loras < 1:
            raise PlanError(f"--max-loras {max_loras}: at least 1")
        return cls(max_rank=fitting[0], max_loras=max_loras or keep_versions + 1)


@dataclass(frozen=True)
class TrainerNeeds:
    """The trainer's settings that size its memory (by default, TrainConfig's)."""

    lora_r: int = _TRAINER.lora_r
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    micro_batch_tokens: int = _TRAINER.micro_batch_tokens
    logprob_chunk_tokens: int = _TRAINER.logprob_chunk_tokens
    bytes_per_param: int = 2  # 4 with TrainConfig.dtype "float32"
    procs: int = 1


@dataclass(frozen=True)
class Memory:
    """The estimate, in bytes (see the module docstring)."""

    vllm_weights: int  # base + adapter slots, over the whole tensor-parallel group
    kv_min: int  # MIN_KV_TOKENS, over the whole group
    trainer_weights: int
    lora_state: int
    activations: int
    logprobs: int
    gathered: int = 0  # sharded: the weights FSDP gathers whole during a step (0 unsharded)
    shard_over: int = 1  # the trainer processes the base and the LoRA are sharded over (1: each holds all)
    peft_inputs: int = 0  # of ``activations``: peft's fp32 copies of the LoRA layers' inputs
    host_vllm_backup: int = 0  # pinned host RAM vLLM's level-1 sleep copies its weights into (all its GPUs)
    host_trainer_load: int = 0  # host RAM the trainer's processes read the base into, together, at a (re)build
    host_vllm_loras: int = 0  # vLLM's host copies of the adapters it holds (--max-cpu-loras: --max-loras of them)

    @property
    def trainer_resident(self) -> int:
        return self.trainer_weights + self.lora_state

    @property
    def step(self) -> int:
        return self.activations + self.logprobs + self.gathered

    def vllm_need(self, tp: int) -> int:
        return -(-(self.vllm_weights + self.kv_min) // tp) + VLLM_RUNTIME

    def host_peak(self, shared: bool) -> int:
        """Host RAM at its peak: the trainer rebuilding its learner while vLLM sleeps (shared), or just the former,
        beside vLLM's host copies of its adapters."""
        return self.host_trainer_load + self.host_vllm_loras + (self.host_vllm_backup if shared else 0)


def estimate_memory(
    model: ModelShape,
    trainer: TrainerNeeds | None,
    shard_over: int = 1,
    vllm_lora: VllmLora = VllmLora(),
) -> Memory:
    """Each side's memory; the trainer's per process, its weights and LoRA state split ``shard_over`` ways."""
    t = trainer or TrainerNeeds()
    lora = model.lora_params(t.lora_r, t.target_modules)
    slots = vllm_lora.max_loras * 2 * model.lora_params(vllm_lora.max_rank, DEFAULT_TARGET_MODULES)
    scale = t.bytes_per_param // 2  # fp32 weights also mean fp32 activations
    gathered = 0
    if trainer and shard_over > 1:
        root = model.vocab * model.hidden * 2 * (2 if "lm_head" in model.linear_sizes else 1)
        layer = max(0, model.weight_bytes - root) // model.layers
        gathered = (root + 2 * layer) * scale
    per_token = model.layers * (ACTIVATION_BYTES_PER_HIDDEN * model.hidden
                                + ACTIVATION_BYTES_PER_INTERMEDIATE * model.intermediate)  # fmt: skip
    peft = _peft_input_bytes(model, t.target_modules) * t.micro_batch_tokens if scale == 1 else 0
    return Memory(
        vllm_weights=model.weight_bytes + slots,
        kv_min=MIN_KV_TOKENS * model.kv_bytes_per_token,
        trainer_weights=model.weight_bytes * scale // shard_over if trainer else 0,
        lora_state=LORA_STATE_BYTES * lora // shard_over if trainer else 0,
        activations=t.micro_batch_tokens * per_token * scale + peft if trainer else 0,
        logprobs=min(t.logprob_chunk_tokens, t.micro_batch_tokens) * model.vocab * LOGIT_BYTES if trainer else 0,
        gathered=gathered,
        shard_over=shard_over,
        peft_inputs=peft if trainer else 0,
        host_vllm_backup=model.weight_bytes,
        host_trainer_load=model.weight_bytes * scale * t.procs if trainer else 0,
        host_vllm_loras=slots,
    )


def _peft_input_bytes(model: ModelShape, targets: Sequence[str]) -> int:
    """Per token: the fp32 copies peft makes of the targeted linears' inputs, over all layers."""
    width = {"h": model.hidden, "q": model.heads * model.head_dim, "i": model.intermediate}
    return model.layers * sum(
        PEFT_INPUT_BYTES * width[_PEFT_INPUT[name]] for name in set(targets) if name in _PEFT_INPUT
    )


def gib(n: int) -> str:
    """Bytes as GiB with one decimal."""
    return f"{n / GiB:.1f}"
