"""Each training step's health, from its metrics in the store: the sampler/learner gap that stays high.

The trainer records every step's metrics with its job (``logprob_mismatch_on_policy``: the mean
|learner - sampler| log-prob over the tokens the trained version sampled itself, in nats). With
vLLM and the trainer computing alike that is rounding (~1e-3 and below); a dtype or kernel gap
makes it ~0.05 (bf16 sampling against an fp32 learner, docs/BENCHMARKS.md), and so does constrained
sampling (vLLM's logprobs are then renormalized over what the constraint allowed: ~0.27 on the demo's
tool task, whose first call is `tool_choice="required"`); RL then learns slower unless the loss
corrects for it. ``StepWatch`` warns once when the gap stayed above
``threshold`` for ``steps`` steps in a row, and says so again when it falls back.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable

from proxy._periodic import every
from store import JobState, Store

log = logging.getLogger("tracetrain.training")

MISMATCH_THRESHOLD = 0.01  # nats per token: 10x what fp32 against fp32 gives, a fifth of bf16 against fp32
MISMATCH_STEPS = 3


def stays_high(gaps: Iterable[float | None], threshold: float, steps: int) -> bool:
    """Whether the last ``steps`` measured gaps were all above ``threshold``.

    A step without on-policy tokens (None: everything it trained was sampled by an older version,
    as when sampling runs ahead of training) measures nothing and is skipped.

    >>> stays_high([0.002, 0.05, None, 0.06, 0.04], 0.01, 3), stays_high([0.05, 0.002, 0.06, 0.04], 0.01, 3)
    (True, False)
    """
    measured = [g for g in gaps if g is not None][-steps:]
    return len(measured) == steps and all(g > threshold for g in measured)


class StepWatch:
    """Reads the newest succeeded step every ``poll_s``; ``run()`` until cancelled."""

    def __init__(self, store: Store, *, threshold: float = MISMATCH_THRESHOLD, steps: int = MISMATCH_STEPS,
                 poll_s: float = 5.0) -> None:  # fmt: skip
        self._store, self._threshold, self._steps, self._poll_s = store, threshold, steps, poll_s
        self._gaps: deque[float] = deque(maxlen=steps)  # bounded: the last `steps` measured steps
        self._seen: int | None = None
        self.warned = False

    async def run(self) -> None:
        await every(self._poll_s, self.check_once, log, "reading the last training step failed")

    async def check_once(self) -> None:
        job = await self._store.jobs.last(JobState.SUCCEEDED)
        if job is None or job["id"] == self._seen:
            return
        self._seen = job["id"]
        gap = job["metrics"].get("logprob_mismatch_on_policy")
        if not isinstance(gap, int | float):
            return  # nothing on-policy in this step: it measures nothing
        self._gaps.append(last := float(gap))
        if not self.warned and stays_high(self._gaps, self._threshold, self._steps):
            self.warned = True
            correction = job["metrics"].get("sampler_correction", "unknown")
            log.warning(
                "the sampler's and the learner's log-probs differ by %.3g nats per token (above %.2g for %d steps "
                "in a row, up to version %s; sampler correction: %s): vLLM and the trainer do not compute alike "
                "(dtype, kernels), or vLLM constrained what it sampled (tool_choice required, a JSON schema, "
                "top-p), which slows learning unless the loss corrects for it. On a CPU run both in float32 "
                "(tracetrain serve --dtype float32, the default), and set the trainer's sampler_correction to tis "
                "for constrained sampling; see docs/TRAINING.md", last, self._threshold, self._steps,
                job["version"], correction,
            )  # fmt: skip
        elif self.warned and last <= self._threshold:
            self.warned = False
            log.info("the sampler/learner log-prob gap is back under %.2g nats per token", self._threshold)
