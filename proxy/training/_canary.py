"""Canary trials: a new version serves a share of new trajectories until its rewards promote it or roll it back.

    publisher (a policy's canary FRACTION) publishes N ──▶ its running trial: N against the version serving now (B)
        every replica's router splits new trajectories: N for about FRACTION of them, B for the rest
        (each trajectory keeps its version; ``policy@N`` pins bypass it: ``proxy.gateway._split``)
    this canary, every second on every replica, for each served policy's running trial (its own settings):
        complete groups holding both versions, and time windows of the trajectories outside them
        (proxy.training._canary_windows) ──▶ proxy.training._canary_verdict.decide
        ──▶ running | promoted | rolled_back   (the look is kept in the trial's row for the dashboard)
    promoted:    one store transaction ends the trial and flips the alias to N; the regression guard
                 watches N from then on (against B)
    rolled back: one store transaction ends the trial, marks N rolled back, discards the versions trained
                 since (all from N) and sets the policy's ``rolled_back_at`` (a step still running from N is
                 discarded when it records): training goes on from B, with every sample either version
                 served (each call's own sampling logprobs correct it). N is unloaded after the grace.

A version trained while a trial runs waits (``trained``, unpublished): the trainer goes on from N, and
one trial runs at a time per policy; each policy's trial is its own (its split, test and end), and never
moves another policy's calls. At the verdict the newest waiting version goes on trial (against N if N was
promoted; the versions between are passed over, their steps held in it), or, if N was rolled back, the
waiting versions (trained from N) are discarded. An admin ends a trial either way (``end``: the dashboard,
``POST /admin/trials/{id}/promote|roll-back``); an admin's activation of another version waits for the end.
If the alias moves off B during a trial (the regression guard rolled B back), the trial is rolled back. A
trial left running while ``--canary`` is off is promoted (the newest version then serves, as without one).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from proxy._periodic import every
from proxy._policy_config import PolicySettings
from proxy._policy_keys import EVERY, Scope
from proxy.errors import Conflict, NotFound
from proxy.gateway import PolicyRegistry
from proxy.observability._metrics import Metrics
from proxy.training._canary_verdict import CanaryConfig, Verdict, arm_view, decide
from proxy.training._canary_windows import Windows, window_strata
from proxy.training._publisher import Publisher
from proxy.training._regression import watch_record
from store import Store, TrialState

log = logging.getLogger("tracetrain.canary")


def canary_config(settings: PolicySettings) -> CanaryConfig | None:
    """A policy's canary trial, from its settings (``--canary*`` or its own); None: its versions go untried."""
    if settings.canary is None:
        return None
    # Outside mixed groups, a conversation unrewarded this long after its last call is left out of its window:
    # the policy's reward timeout where it has one (its rewards are late past it), else the windows' own wait.
    wait = settings.reward_timeout_s or Windows().wait_s
    return CanaryConfig(fraction=settings.canary, margin=settings.canary_margin, alpha=settings.canary_alpha,
                        max_groups=settings.canary_groups, max_s=settings.canary_minutes * 60,
                        windows=Windows(wait_s=wait))  # fmt: skip


class Canary:
    """Decides each served policy's running canary trial with its own settings; ``run()`` until cancelled."""

    def __init__(
        self, store: Store, publisher: Publisher, metrics: Metrics, registry: PolicyRegistry, *, poll_s: float = 1.0
    ) -> None:
        self._store = store
        self._publisher = publisher
        self._metrics = metrics
        self._registry = registry
        self._poll_s = poll_s

    async def run(self) -> None:
        await every(self._poll_s, self.check_all, log, "the canary's check failed; trying again")

    async def check_all(self) -> dict[str, Verdict]:
        """``check_once`` for every served policy; policy -> the verdict so far on its running trial."""
        verdicts = {}
        for served in self._registry:
            verdict = await self.check_once(served.settings)
            if verdict is not None:
                verdicts[served.name] = verdict
        return verdicts

    async def check_once(self, settings: PolicySettings) -> Verdict | None:
        """Look at the policy's running trial once: its verdict so far, acted on when it is one. A trial left
        running while the policy's canary is off is promoted."""
        policy, cfg = settings.name, canary_config(settings)
        trial = await self._store.trials.running(policy)
        if trial is None:
            return None
        if cfg is None:
            await self._end(trial, "promoted", "config", "--canary is off: the version on trial serves everything, "
                            "as without a canary", trial["verdict"], guard=settings.regression_guard)  # fmt: skip
            return None
        active = await self._store.policies.active_version(policy)
        if active != trial["baseline"]:
            reason = (f"the alias moved from @{trial['baseline']} to @{active} during the trial (the regression "
                      "guard rolled it back)")  # fmt: skip
            await self._end(trial, "rolled_back", "alias", reason, trial["verdict"], serving=active)
            return None
        now, started = time.time(), float(trial["started_at"])
        groups = await self._store.trials.evidence(trial, min_group_size=settings.min_group_size)
        windows = window_strata(await self._store.trials.units(trial), candidate=int(trial["candidate"]),
                                started_at=started, now=now, windows=cfg.windows)  # fmt: skip
        strata = sorted([*groups, *windows], key=lambda g: g.completed_at)
        verdict = decide(strata, cfg, elapsed_s=now - started)
        record = await self._record(trial, verdict)
        if verdict.decision == "running":
            if trial["verdict"] != record:  # a replica's look that changes nothing writes nothing
                await self._store.trials.look(trial["id"], record)
            return verdict
        await self._end(trial, verdict.decision, verdict.by or "test", verdict.reason, record,
                        guard=settings.regression_guard)  # fmt: skip
        return verdict

    async def end(self, trial_id: int, decision: str, *, scope: Scope = EVERY) -> dict[str, Any]:
        """An admin ends a running trial: ``promoted`` or ``rolled_back``. Returns the trial as it ended.
        A trial of a policy outside ``scope`` (the admin's picked policy) is a 404, as an unknown one is."""
        trial = await self._store.trials.get(trial_id)
        if trial is None or not scope.allows(str(trial["policy"])):
            raise NotFound(f"No canary trial {trial_id}.", param="trial_id", code="trial_not_found")
        if trial["state"] != TrialState.RUNNING:
            raise Conflict(f"Trial {trial_id} has ended already: {trial['state']} ({trial['reason']}).",
                           code="trial_ended")  # fmt: skip
        policy = str(trial["policy"])
        guard = self._registry.get(policy).settings.regression_guard if policy in self._registry else False
        reason = f"{decision.replace('_', ' ')} by an admin"
        if not await self._end(trial, decision, "admin", reason, trial["verdict"], guard=guard):
            ended = await self._store.trials.get(trial_id)
            assert ended is not None
            raise Conflict(f"Trial {trial_id} ended meanwhile: {ended['state']} ({ended['reason']}).",
                           code="trial_ended")  # fmt: skip
        ended = await self._store.trials.get(trial_id)
        assert ended is not None
        return ended

    async def _record(self, trial: dict[str, Any], verdict: Verdict) -> dict[str, Any]:
        """What the dashboard and /metrics show of a look: the test, each version's share and rewards."""
        arms = await self._store.trials.arms(trial)
        candidate, baseline = arm_view(arms[trial["candidate"]]), arm_view(arms[trial["baseline"]])
        served = candidate["trajectories"] + baseline["trajectories"]
        shares = {"candidate": candidate["trajectories"] / served, "baseline": baseline["trajectories"] / served} \
            if served else {"candidate": None, "baseline": None}  # fmt: skip
        return {"look": verdict.view(), "candidate": candidate, "baseline": baseline, "shares": shares}

    async def _end(
        self, trial: dict[str, Any], decision: str, by: str, reason: str, record: dict[str, Any] | None,
        serving: int | None = None, guard: bool = False,
    ) -> bool:  # fmt: skip
        """End ``trial`` (one store transaction, through the publisher); False when another end came first.

        ``serving``: the version the alias points at, when it moved off the trial's baseline. ``guard``: the
        regression guard watches a promoted version (the policy's setting)."""
        policy, candidate, baseline = str(trial["policy"]), int(trial["candidate"]), int(trial["baseline"])
        if decision == "promoted":
            watch = watch_record(baseline) if guard else None

            async def promote() -> bool:
                return await self._store.trials.promote(trial["id"], by=by, reason=reason, verdict=record, guard=watch)

            won = await self._publisher.promote(policy, candidate, promote)
        elif decision == "rolled_back":

            async def roll_back() -> bool:
                return await self._store.trials.roll_back(trial["id"], by=by, reason=reason, verdict=record)

            won = await self._publisher.roll_back(policy, candidate, baseline if serving is None else serving,
                                                  roll_back)  # fmt: skip
        else:
            raise ValueError(f"a trial ends promoted or rolled_back, not {decision}")
        if won:
            self._metrics.canary_verdicts.labels(policy, decision, by).inc()
            log.warning("canary: %s@%d %s against @%d (%s): %s", policy, candidate, decision.replace("_", " "),
                        baseline, by, reason)  # fmt: skip
        return won
