"""The trainer's configuration: one frozen, validated object, saved beside each adapter, and the trainer's flags
that make it (``python -m trainer --loss ... --config FILE``).

Here, below the trainer and without torch, so that ``tracetrain serve`` reads the trainer's defaults and the
flags it passes the trainer (``--trainer-arg``) from this one declaration: its GPU plan sizes the LoRA and the
micro-batch the trainer will use, and its precision agrees with the trainer's dtype.

Every choice the training step makes is a field here, checked when the object is
built (a bad value fails at start-up or when a saved config is read, never inside a
step). The loss variant is one ``Literal``; ``trainer._losses`` dispatches on it once.
``to_dict()`` / ``from_dict()`` round-trip through JSON: ``<adapter dir>/trainer_config.json``
records what an adapter was trained with, and an old file with fewer keys still loads
(missing keys take today's defaults); an unknown key is an error, never silently dropped.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator

LossVariant = Literal["grpo", "dr_grpo", "gspo", "cispo"]
TrainDType = Literal["auto", "float32", "bfloat16"]
SamplerDType = Literal["auto", "float32", "bfloat16", "float16"]
# How the loss treats the gap between the sampler's log-probs and the learner's (trainer/_losses.py).
SamplerCorrection = Literal["auto", "none", "tis", "mis"]

_DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class TrainConfig(BaseModel):
    """How the trainer turns rewarded groups into a LoRA update. Build once; never mutate.

    >>> cfg = TrainConfig(loss="gspo", kl_coef=0.01)
    >>> TrainConfig.from_dict(cfg.to_dict()) == cfg
    True
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    # --- the objective (see trainer/_losses.py for each variant's formula) ---
    # grpo: PPO-clipped, token-level mean (DAPO); dr_grpo: clipped, summed over tokens / constant;
    # gspo: sequence-level ratio and clip; cispo: clipped, stop-gradient IS weight times log-prob.
    loss: LossVariant = "grpo"
    # PPO clip of the token ratio to [1 - clip_low, 1 + clip_high] (grpo, dr_grpo). DAPO's "clip higher": 0.28.
    clip_low: float = Field(default=0.2, gt=0, lt=1)
    clip_high: float = Field(default=0.2, gt=0)
    # gspo clips the sequence ratio (a geometric mean, so near 1) to [1 - low, 1 + high]; GSPO paper v2, §5.1.
    gspo_clip_low: float = Field(default=3e-4, gt=0, lt=1)
    gspo_clip_high: float = Field(default=4e-4, gt=0)
    # cispo caps the detached IS weight at 1 + cispo_clip_high (no lower bound, as MiniMax-M1 tuned it).
    # 4.0 caps it at 5, ScaleRL's epsilon_max and TRL's recommended CISPO cap.
    cispo_clip_high: float = Field(default=4.0, gt=0)
    # Divide advantages by the group's std. None: the variant's paper default (False for dr_grpo,
    # True otherwise); True or False overrides it for every variant. Read it through `scale_advantages`.
    scale_rewards: bool | None = None
    # Weight of the k3 KL estimate to the base model (adapter disabled); 0 skips the reference forward.
    kl_coef: float = Field(default=0.0, ge=0)
    # dr_grpo divides the summed token losses by (sequences x this constant) instead of by lengths.
    # Dr. GRPO uses the generation budget; a sample here can span several calls, so set it near the
    # largest number of sampled tokens one sample carries. Only the gradient's scale depends on it.
    dr_grpo_norm_tokens: int = Field(default=1024, ge=1)
    # |logp - old_logp| is clamped to this before exp, in every variant: e^20 keeps the ratio and its
    # gradient finite in float32 (exp overflows past 88) and is verl's bound. A token beyond it is a
    # broken sample, not a policy change (on-policy tokens differ by ~1e-3); it gets no gradient through
    # the ratio and is counted in `log_ratio_clamped`.
    log_ratio_clamp: float = Field(default=20.0, gt=0)

    # --- the adapter (peft LoRA) ---
    lora_r: int = Field(default=16, ge=1)
    lora_alpha: int = Field(default=32, ge=1)
    lora_dropout: float = Field(default=0.0, ge=0, lt=1)
    # Module names LoRA wraps; the default covers attention and MLP of Llama/Qwen/SmolLM-style models.
    target_modules: tuple[str, ...] = _DEFAULT_TARGET_MODULES

    # --- the optimizer (AdamW, one step per training batch) ---
    learning_rate: float = Field(default=3e-4, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    # Gradients are clipped to this global L2 norm before each optimizer step.
    max_grad_norm: float = Field(default=1.0, gt=0)

    # --- efficiency ---
    # Token budget of one packed forward (a micro-batch); a longer sample gets a micro-batch of its own.
    micro_batch_tokens: int = Field(default=4096, ge=1)
    # Lay the samples of a micro-batch as their prefix tree, so that a prefix several share (a GRPO group's
    # prompt, the prompts of a trajectory's split samples) is forwarded once. False: each sample laid whole
    # (the same step, slower; for comparison).
    share_prefix: bool = True
    # Vocabulary logits are materialized for this many positions at a time, never for the whole batch.
    logprob_chunk_tokens: int = Field(default=1024, ge=1)
    # auto: bfloat16 weights on CUDA with bf16 support, float32 elsewhere (on a CPU without bf16 units,
    # bfloat16 measured 10x slower here than float32).
    dtype: TrainDType = "auto"
    seed: int = Field(default=0, ge=0)

    # --- how the sampler sampled ---
    # What vLLM computes in, as `tracetrain serve` started it (tracetrain_cli/_precision.py); auto: not known.
    sampler_dtype: SamplerDType = "auto"
    # none: the PPO ratio is taken against the sampler's log-probs (the gap is clipped like a policy change).
    # tis: the ratio is taken against the learner's own log-probs before the step, and each token's loss is
    # weighted by min(exp(learner_old - sampler), sampler_ratio_cap), detached (truncated importance sampling).
    # mis: as tis, but a token whose weight exceeds the cap is masked out (weight 0) instead of truncated.
    # auto: tis unless sampler and learner are known to both compute in float32 (on a CUDA device, tis even
    # when the sampler's dtype is not known: vLLM's kernels are not peft's); see `resolved_correction`.
    sampler_correction: SamplerCorrection = "auto"
    # C in min(ratio, C): Yao et al.'s TIS used 2. Above 1: a weight never exceeds it.
    sampler_ratio_cap: float = Field(default=2.0, gt=1)
    # The temperature of calls whose request named none. None: what vLLM does by default
    # (`--generation-config auto`): the base model's generation_config.json temperature, else 1.0.
    # Set it when your vLLM runs with `--generation-config vllm` (1.0) or `--override-generation-config`.
    default_temperature: float | None = Field(default=None, ge=0)

    # --- which data trains ---
    # Calls served by a policy more than this many versions behind the one being trained are dropped.
    max_staleness: int = Field(default=2, ge=0)
    # A group with fewer rewarded trajectories is not trained on (a group of 1 has no baseline).
    min_group_size: int = Field(default=2, ge=2)

    @field_validator("target_modules")
    @classmethod
    def _modules_named(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value or any(not name.strip() for name in value):
            raise ValueError("target_modules must name at least one module, e.g. ('q_proj', 'v_proj')")
        return value

    @property
    def scale_advantages(self) -> bool:
        """Whether advantages are divided by the group std, after resolving the variant's default."""
        if self.scale_rewards is None:
            return self.loss != "dr_grpo"
        return self.scale_rewards

    def resolved_correction(self, *, learner_float32: bool, cuda: bool) -> Literal["none", "tis", "mis"]:
        """``sampler_correction`` with auto decided: none only where sampler and learner compute alike.

        >>> TrainConfig(sampler_dtype="bfloat16").resolved_correction(learner_float32=True, cuda=False)
        'tis'
        >>> TrainConfig(sampler_dtype="float32").resolved_correction(learner_float32=True, cuda=False)
        'none'
        """
        if self.sampler_correction != "auto":
            return self.sampler_correction
        if self.sampler_dtype == "auto":  # not known: a vLLM someone else runs
            return "tis" if cuda or not learner_float32 else "none"
        return "none" if learner_float32 and self.sampler_dtype == "float32" else "tis"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples become lists) that `from_dict` reads back to an equal config."""
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """Build and validate a config from `to_dict`'s output (or JSON of it); raises ValueError."""
        return cls.model_validate(data)


def add_train_config_flags(p: argparse.ArgumentParser) -> None:
    """TrainConfig: a JSON file of its fields, and the flags that override them."""
    p.add_argument("--config", type=Path, help="a JSON file of TrainConfig fields; the flags below override it")
    p.add_argument("--loss", choices=["grpo", "dr_grpo", "gspo", "cispo"], help="the objective (default grpo)")
    p.add_argument("--learning-rate", type=float, help="AdamW learning rate (default 3e-4)")
    p.add_argument("--lora-r", type=int, help="LoRA rank (default 16); vLLM's --max-lora-rank must be at least this")
    p.add_argument(
        "--max-staleness",
        type=int,
        help="skip samples served by a version more than this many versions old (default 2)",
    )
    p.add_argument("--kl-coef", type=float, help="weight of the KL to the base model (default 0: off)")
    p.add_argument(
        "--micro-batch-tokens",
        type=int,
        help="token budget of one packed forward (default 4096); smaller needs less GPU memory per step",
    )
    p.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16"], help="what the trainer computes in (default auto)"
    )
    p.add_argument(
        "--sampler-dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="what vLLM samples in (serve passes it); decides the default --sampler-correction (default auto: unknown)",
    )
    p.add_argument(
        "--sampler-correction",
        choices=["auto", "none", "tis", "mis"],
        help="correct the sampler/learner log-prob gap: tis (truncated importance sampling), mis (masked), none "
        "(default auto: tis unless both compute in float32)",
    )


_FLAGGED = ("loss", "learning_rate", "lora_r", "max_staleness", "kl_coef", "micro_batch_tokens", "dtype",
            "sampler_dtype", "sampler_correction")  # fmt: skip


def train_config_from(args: argparse.Namespace, config_json: str | None) -> TrainConfig:
    """The configuration ``add_train_config_flags``' flags make: ``config_json`` (the text of ``--config``'s file)
    under the flags given. Its ``model_fields_set`` names what was given. Raises ``ValueError``."""
    base = TrainConfig.model_validate_json(config_json).model_dump(exclude_unset=True) if config_json else {}
    flags = {name: value for name in _FLAGGED if (value := getattr(args, name, None)) is not None}
    return TrainConfig.from_dict({**base, **flags})
