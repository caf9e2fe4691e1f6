"""Canary trials: a new version serves a share of new trajectories until its rewards promote it or roll it back.

    publisher (--canary FRACTION) publishes N ──▶ a running trial: N against the version serving now (B)
        every replica's router splits new trajectories: N for about FRACTION of them, B for the rest
        (each trajectory keeps its version; ``policy@N`` pins bypass it: ``proxy.gateway._split``)
    this canary, every second on every replica, for the policy's running trial:
        complete groups holding both versions ──▶ proxy.training._canary_verdict.decide
        ──▶ running | promoted | rolled_back   (the look is kept in the trial's row for the dashboard)
    promoted:    one store transaction ends the trial and flips the alias to N; the regression guard
                 watches N from then on (against B)
    rolled back: one store transaction ends the trial, marks N rolled back, discards the versions trained
                 since (all from N) and sets the policy's ``rolled_back_at`` (a step still running from N is
                 discarded when it records): training goes on from B, with every sample either version
                 served (each call's own sampling logprobs correct it). N is unloaded after the grace.

A version trained while a trial runs waits (``trained``, unpublished): the trainer goes on from N, and
one trial runs at a time. At the verdict the newest waiting version goes on trial (against N if N was
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
from proxy.errors import Conflict, NotFound
from proxy.observability._metrics import Metrics
from proxy.training._canary_verdict import CanaryConfig, Verdict, arm_view, decide
from proxy.training._publisher import Publisher
from proxy.training._regression import watch_record
from store import Store, TrialState

log = logging.getLogger("tracetrain.canary")


class Canary:
    """Decides the policy's running canary trial; ``run()`` until cancelled. ``cfg`` None: ``--canary`` is off."""

    def __init__(
        self,
        store: Store,
        publisher: Publisher,
        metrics: Metrics,
        cfg: CanaryConfig | None,
        *,
        policy: str,
        min_group_size: int,
        guard: bool,
        poll_s: float = 1.0,
    ) -> None:
        self._store = store
        self._publisher = publisher
        self._metrics = metrics
        self._cfg = cfg
        self._policy = policy
        self._min_group_size = min_group_size
        self._guard = guard  # the regression guard watches a promoted version
        self._poll_s = poll_s

    async def run(self) -> None:
        await every(self._poll_s, self.check_once, log, "the canary's check failed; trying again")

    async def check_once(self) -> Verdict | None:
        """Look at the running trial once: its verdict so far, acted on when it is one."""
        trial = await self._store.trials.running(self._policy)
        if trial is None:
            return None
        if self._cfg is None:
            await self._end(trial, "promoted", "config", "--canary is off: the version on trial serves everything, "
                            "as without a canary", trial["verdict"])  # fmt: skip
            return None
        active = await self._store.policies.active_version(self._policy)
        if active != trial["baseline"]:
            reason = (f"the alias moved from @{trial['baseline']} to @{active} during the trial (the regression "
                      "guard rolled it back)")  # fmt: skip
            await self._end(trial, "rolled_back", "alias", reason, trial["verdict"], serving=active)
            return None
        groups = await self._store.trials.evidence(trial, min_group_size=self._min_group_size)
        verdict = decide(groups, self._cfg, elapsed_s=time.time() - float(trial["started_at"]))
        record = await self._record(trial, verdict)
        if verdict.decision == "running":
            if trial["verdict"] != record:  # a replica's look that changes nothing writes nothing
                await self._store.trials.look(trial["id"], record)
            return verdict
        await self._end(trial, verdict.decision, verdict.by or "test", verdict.reason, record)
        return verdict

    async def end(self, trial_id: int, decision: str) -> dict[str, Any]:
        """An admin ends a running trial: ``promoted`` or ``rolled_back``. Returns the trial as it ended."""
        trial = await self._store.trials.get(trial_id)
        if trial is None or trial["policy"] != self._policy:
            raise NotFound(f"No canary trial {trial_id} of the policy '{self._policy}'.", param="trial_id",
                           code="trial_not_found")  # fmt: skip
        if trial["state"] != TrialState.RUNNING:
            raise Conflict(f"Trial {trial_id} has ended already: {trial['state']} ({trial['reason']}).",
                           code="trial_ended")  # fmt: skip
        reason = f"{decision.replace('_', ' ')} by an admin"
        if not await self._end(trial, decision, "admin", reason, trial["verdict"]):
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
        serving: int | None = None,
    ) -> bool:  # fmt: skip
        """End ``trial`` (one store transaction, through the publisher); False when another end came first.

        ``serving``: the version the alias points at, when it moved off the trial's baseline."""
        policy, candidate, baseline = self._policy, int(trial["candidate"]), int(trial["baseline"])
        if decision == "promoted":
            guard = watch_record(baseline) if self._guard else None

            async def promote() -> bool:
                return await self._store.trials.promote(trial["id"], by=by, reason=reason, verdict=record, guard=guard)

            won = await self._publisher.promote(candidate, promote)
        elif decision == "rolled_back":

            async def roll_back() -> bool:
                return await self._store.trials.roll_back(trial["id"], by=by, reason=reason, verdict=record)

            won = await self._publisher.roll_back(candidate, baseline if serving is None else serving, roll_back)
        else:
            raise ValueError(f"a trial ends promoted or rolled_back, not {decision}")
        if won:
            self._metrics.canary_verdicts.labels(policy, decision, by).inc()
            log.warning("canary: %s@%d %s against @%d (%s): %s", policy, candidate, decision.replace("_", " "),
                        baseline, by, reason)  # fmt: skip
        return won
