"""What vLLM samples in and what the trainer learns in: chosen here, once, and printed by ``serve``.

GRPO's importance ratio compares the trainer's log-probs with the ones vLLM returned when it
sampled. Where the two compute differently the ratio is off by their numerics, not by any
policy change: on a CPU with AVX512-BF16, vLLM's ``--dtype auto`` sampled in bf16 while the
trainer computed in fp32, a mean gap of 0.054 nats per token, and the demo learned +50 to +67
points where the same run with vLLM in fp32 learned +84 (docs/BENCHMARKS.md). So:

- on a CPU the sampler follows the learner: float32 unless the user asks for bfloat16 on both
  (``serve --dtype bfloat16``, or ``"dtype"`` in the trainer's config);
- on a GPU vLLM samples in its own dtype with its own kernels (bf16 for a bf16 checkpoint)
  while the trainer runs peft: they cannot agree exactly;
- ``--sampler-dtype`` forces vLLM's alone (to measure the gap, or to sample faster).

Wherever the two are not both float32, the trainer corrects for the gap (``TrainConfig``'s
``sampler_correction``: truncated importance sampling by default; docs/TRAINING.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Device = Literal["cpu", "cuda"]
BothDtype = Literal["auto", "float32", "bfloat16"]
SamplerDtype = Literal["auto", "bfloat16", "float16", "float32"]


@dataclass(frozen=True, slots=True)
class Precision:
    """vLLM's ``--dtype`` and the trainer's ``dtype``, and whether they compute alike."""

    sampler: SamplerDtype  # what vLLM is started with ("auto": vLLM's own choice, on a GPU)
    learner: BothDtype  # the trainer's TrainConfig.dtype ("auto": bf16 on a GPU that has it)
    why: str

    @property
    def agree(self) -> bool:
        """Both float32: the sampler's and the learner's log-probs differ by rounding only (~1e-5 nats)."""
        return self.sampler == "float32" and self.learner == "float32"

    def line(self) -> str:
        """The start-up line: what each side computes in, and what the loss does about it."""
        both = f"vLLM samples in {self.sampler}, the trainer learns in {self.learner}"
        if self.agree:
            return f"precision: {both}: they agree, no correction needed ({self.why})"
        return (f"precision: {both}: they differ ({self.why}); the loss corrects for the gap "
                "(truncated importance sampling, docs/TRAINING.md)")  # fmt: skip


def agree(
    device: Device, *, dtype: BothDtype = "auto", sampler_dtype: SamplerDtype | None = None,
    trainer_dtype: str | None = None,
) -> Precision:  # fmt: skip
    """The one choice of both dtypes.

    ``dtype``: serve's ``--dtype``, for both sides. ``sampler_dtype``: serve's ``--sampler-dtype``,
    vLLM's alone. ``trainer_dtype``: a ``dtype`` the trainer's own config names (``--trainer-arg``),
    which wins over ``dtype`` for the learner.

    >>> agree("cpu").sampler, agree("cpu", dtype="bfloat16").sampler
    ('float32', 'bfloat16')
    >>> agree("cpu", sampler_dtype="bfloat16").agree
    False
    """
    learner: BothDtype = dtype
    if trainer_dtype in ("auto", "float32", "bfloat16"):
        learner = trainer_dtype  # type: ignore[assignment]  # narrowed by the test above
    if device == "cpu":
        learner = "float32" if learner == "auto" else learner
        if sampler_dtype is not None and sampler_dtype not in ("auto", learner):
            return Precision(sampler_dtype, learner, "--sampler-dtype forced vLLM's")
        return Precision(learner, learner, "on a CPU the sampler follows the trainer")
    if sampler_dtype is not None:
        return Precision(sampler_dtype, learner, "--sampler-dtype forced vLLM's")
    sampler: SamplerDtype = "auto" if learner == "auto" else learner
    return Precision(sampler, learner, "on a GPU vLLM's kernels are not the trainer's")


def trainer_dtype(trainer_args: list[str]) -> str | None:
    """The dtype the trainer's own flags name (``--dtype``, else ``"dtype"`` in ``--config``'s JSON), if any."""
    from tracetrain_cli._gpu_estimate import PlanError
    from tracetrain_cli._gpu_inputs import trainer_config

    try:
        config = trainer_config(trainer_args)
    except PlanError as exc:
        raise SystemExit(f"tracetrain serve: {exc}") from None
    return config.dtype if "dtype" in config.model_fields_set else None
