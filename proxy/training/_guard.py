"""The regression guard: a published version that serves worse rewards is rolled back, and training pauses.

    publisher publishes N ──▶ adapters.guard = {"state": "watching", "baseline_version": the version it replaced}
    this guard, every few seconds, for the version each policy serves (with its own settings):
        groups of N (complete, rewarded, every call served by N), first ``max_groups``
        groups of the versions before (the baseline and older, never a rolled-back one), newest ``baseline_groups``
        proxy.training._regression.decide ──▶ watching | kept | rolled_back
    rolled_back: the publisher loads the baseline if needed; one store transaction flips the alias back,
                 marks N rolled_back, pauses the policy's training with the reason, cancels queued jobs
                 (their groups open again); N is unloaded from vLLM after the grace period.

While paused the scheduler creates no job and the publisher discards every adapter the
trainer records (a job already running finishes; its adapter is marked failed, not
published); after a resume, adapters whose step began before the rollback are discarded
too (they continued from N). An admin resumes from the dashboard or ``POST
/admin/training/resume``. A version superseded by the next one before a verdict is left
"superseded": the next version is then compared with it and the versions before.

The verdict and the reason are in ``adapters.guard`` (dashboard, ``GET /admin/adapters``),
the pause and its reason in ``policies`` (``/metrics``: ``tracetrain_training_paused``), and
the log says what happened.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from proxy._periodic import every
from proxy._policy_config import PolicySettings
from proxy.gateway import PolicyRegistry
from proxy.observability._metrics import Metrics
from proxy.training._publisher import Publisher
from proxy.training._regression import GuardConfig, Verdict, decide
from store import Store, TrainingState

log = logging.getLogger("tracetrain.guard")

_BASELINE_VERSIONS = 64  # how far back the baseline may reach, in versions


def guard_config(settings: PolicySettings) -> GuardConfig:
    """A policy's test, from its settings (``--regression-*`` or its own)."""
    return GuardConfig(margin=settings.regression_margin, alpha=settings.regression_alpha,
                       max_groups=settings.regression_groups)  # fmt: skip


class RegressionGuard:
    """Watches the version each served policy serves (those whose settings keep the guard on); ``run()`` until
    cancelled."""

    def __init__(
        self, store: Store, publisher: Publisher, metrics: Metrics, registry: PolicyRegistry, *, poll_s: float = 1.0
    ) -> None:
        self._store = store
        self._publisher = publisher
        self._metrics = metrics
        self._registry = registry
        self._poll_s = poll_s

    async def run(self) -> None:
        await every(self._poll_s, self.check_all, log, "the regression guard's check failed; trying again")

    async def check_all(self) -> dict[str, Verdict]:
        """``check_once`` for every served policy the guard watches; policy -> the verdict on the version it
        serves, where that one is watched."""
        verdicts = {}
        for served in self._registry:
            if served.settings.regression_guard:
                verdict = await self.check_once(served.name, guard_config(served.settings))
                if verdict is not None:
                    verdicts[served.name] = verdict
        return verdicts

    async def check_once(self, policy: str, cfg: GuardConfig) -> Verdict | None:
        """Look at every watched version of ``policy`` once; the verdict on the one served, if it is watched."""
        active = await self._store.policies.active_version(policy)
        verdict = None
        for row in await self._store.guards.watched(policy):
            version, record = int(row["version"]), dict(row["guard"])
            if version != active:
                record["state"] = "superseded"
                await self._store.guards.watch(policy, version, record)
                continue
            verdict = await self._look(policy, cfg, version, record)
        return verdict

    async def _look(self, policy: str, cfg: GuardConfig, version: int, record: dict[str, Any]) -> Verdict:
        baseline = int(record["baseline_version"])
        rolled_back = await self._store.guards.rolled_back_versions(policy)
        versions_before = [
            v for v in range(max(0, baseline - _BASELINE_VERSIONS), baseline + 1) if v not in rolled_back
        ]
        new = await self._store.guards.group_means(
            policy, [version], limit=cfg.max_groups, newest_first=False, since=float(record["since"]) - 1
        )
        before = await self._store.guards.group_means(
            policy, versions_before, limit=cfg.baseline_groups, newest_first=True
        )
        verdict = decide([m for _, m in new], [m for _, m in before], cfg)
        if record.get("n") == verdict.n and record.get("n_baseline") == verdict.n_baseline:
            return verdict  # nothing new since the last look
        record |= {k: v for k, v in dataclasses.asdict(verdict).items() if k != "decision"}
        record |= {"state": verdict.decision, "margin": cfg.margin, "looked_at": time.time()}
        if verdict.decision == "rolled_back":
            await self._roll_back(policy, version, baseline, verdict, record)
        else:
            await self._store.guards.watch(policy, version, record)
            if verdict.decision == "kept":
                log.info("regression guard: %s@%d is kept (%s)", policy, version, verdict.reason)
        return verdict

    async def _roll_back(self, policy: str, version: int, baseline: int, verdict: Verdict,
                         record: dict[str, Any]) -> None:  # fmt: skip
        reason = f"{policy}@{version} rolled back to @{baseline}: {verdict.reason}"

        async def commit() -> bool:
            return await self._store.guards.roll_back(policy, version, baseline, reason, record)

        if await self._publisher.roll_back(policy, version, baseline, commit):
            self._metrics.rollbacks.labels(policy).inc()
            log.warning("regression guard: %s; training of %s is paused until an admin resumes it (dashboard or "
                        "POST /admin/training/resume?policy=%s)", reason, policy, policy)  # fmt: skip


async def resume_training(store: Store, policy: str) -> dict[str, Any]:
    """An admin resumes a policy's training after the guard paused it. Returns the training state."""
    if await store.guards.resume(policy):
        log.warning("training of %s resumed by an admin", policy)
    state = await store.guards.training(policy)
    return {"object": "training", "policy": policy, **state, "paused": state["training"] == TrainingState.PAUSED}
