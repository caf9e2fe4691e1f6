"""``--reward-timeout``: a complete group whose rewards do not come is judged, or closed unrewarded.

Each policy has its own timeout (``--reward-timeout``, or the policy's ``reward_timeout_s``; unset: its
groups wait as long as it takes). Every few seconds the proxy asks the store for each such policy's
*overdue* groups (``store._timeouts``: open,
at least ``min_group_size`` trajectories, some unrewarded, nothing happened to them for the
timeout). Each one is

- judged, when the policy has a judge (``--judge-model``, or ``--reward-source judge|both``):
  the judge's scores become the rewards of every trajectory of the group (one source per
  group, so the advantages compare like with like), and the group turns ready;
- otherwise, or when the judge fails, closed ``unrewarded``: it never trains, a reward
  posted later is recorded but changes nothing, and the count is on the dashboard and in
  ``/metrics`` (``tracetrain_groups_unrewarded``, ``tracetrain_reward_timeouts``).

The batch never waits for such a group: a job is made from *ready* groups only
(``store._jobs``), and a group closed here frees its task for a new group.
"""

from __future__ import annotations

import logging

from proxy._periodic import every
from proxy._policy_config import PolicySettings
from proxy._settings import Settings
from proxy.errors import ProxyError
from proxy.gateway import PolicyRegistry
from proxy.judge._service import JudgeService
from proxy.observability._metrics import Metrics
from store import Store

log = logging.getLogger("tracetrain.rewards")


class RewardTimeout:
    """Closes or judges the overdue groups of every served policy that has a timeout; ``run()`` until cancelled."""

    def __init__(
        self, settings: Settings, store: Store, judging: JudgeService, metrics: Metrics, registry: PolicyRegistry
    ) -> None:
        self._store = store
        self._judging = judging
        self._metrics = metrics
        self._registry = registry
        # A quarter of the shortest timeout named at start (5 s at most; a policy added later is looked at as often).
        timeouts = [settings.reward_timeout_s, *(o.reward_timeout_s for o in settings.policy_configs.values())]
        self._poll_s = min(max(min((t for t in timeouts if t), default=20.0) / 4, 0.05), 5.0)

    async def run(self) -> None:
        await every(self._poll_s, self.check_once, log, "looking for groups past --reward-timeout failed")

    async def check_once(self) -> dict[str, str]:
        """Deal with every overdue group now; group id -> "judged" or "unrewarded" (the ones this call settled)."""
        settled: dict[str, str] = {}
        for served in self._registry:
            if served.settings.reward_timeout_s is not None:
                settled |= await self._policy(served.settings, served.settings.reward_timeout_s)
        return settled

    async def _policy(self, s: PolicySettings, timeout_s: float) -> dict[str, str]:
        settled: dict[str, str] = {}
        overdue = await self._store.reward_timeouts.overdue(s.name, min_group_size=s.min_group_size,
                                                           timeout_s=timeout_s)  # fmt: skip
        for group_id in overdue:
            why = "no judge is configured (--judge-model)"
            if s.judge_configured:
                try:
                    judgement = await self._judging.judge_group(group_id, trigger="timeout")
                except ProxyError as exc:  # the group moved on meanwhile (a job took it)
                    log.info("group %s past --reward-timeout was not judged: %s", group_id, exc.message)
                    continue
                if judgement["state"] == "ok":
                    settled[group_id] = "judged"
                    self._metrics.reward_timeouts.labels(s.name, "judged").inc()
                    log.info("group %s had no rewards after %.0f s: the judge's scores are its rewards", group_id,
                             timeout_s)  # fmt: skip
                    continue
                why = f"the judge failed: {judgement['error']}"
            if await self._store.reward_timeouts.close_unrewarded(group_id):
                settled[group_id] = "unrewarded"
                self._metrics.reward_timeouts.labels(s.name, "unrewarded").inc()
                log.warning("group %s had rewards missing after %.0f s and %s: closed unrewarded, never trained",
                            group_id, timeout_s, why)  # fmt: skip
        return settled
