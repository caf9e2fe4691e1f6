"""What the dashboard and the admin API show of canary trials (a policy's ``canary``), and an admin's end of one."""

from __future__ import annotations

from typing import Any, Literal

from proxy._policy_keys import EVERY, Scope
from proxy.admin._service import Sources
from store import TRIAL_FIELDS

Ending = Literal["promoted", "rolled_back"]


def trial_view(row: dict[str, Any]) -> dict[str, Any]:
    """A trial as the API shows it: its row, and its last look (shares, each version's rewards, the test)."""
    return {"object": "trial", **{name: row[name] for name in TRIAL_FIELDS}}


def canary_settings(services: Sources, policy: str) -> dict[str, Any]:
    """A policy's canary settings, as it runs with them (its own over the server's)."""
    s = services.registry.get(policy).settings if policy in services.registry else services.settings
    return {
        "fraction": s.canary,
        "margin": s.canary_margin,
        "alpha": s.canary_alpha,
        "max_groups": s.canary_groups,
        "max_minutes": s.canary_minutes,
    }


async def list_trials(services: Sources, policy: str | None, limit: int) -> dict[str, Any]:
    """``policy``'s trials (None: every policy's), newest first; the running one of the policy in view, if any, first
    of all; that policy's canary settings. With one policy served, it is the one in view when none is named."""
    names = services.registry.names()
    in_view = policy if policy is not None else (names[0] if len(names) == 1 else None)
    rows = await services.store.trials.newest(policy, limit)
    running = None
    if in_view is not None:
        running = next((trial_view(r) for r in rows if r["state"] == "running" and r["policy"] == in_view), None)
    return {
        "object": "list",
        "policy": in_view,
        "canary": canary_settings(services, in_view) if in_view is not None else None,
        "running": running,
        "data": [trial_view(r) for r in rows],
    }


async def end_trial(services: Sources, trial_id: int, decision: Ending, policy: str | None = None) -> dict[str, Any]:
    """An admin promotes a running trial's version, or rolls it back (409 once it has ended). ``policy``: the
    trial must be that policy's (else a 404, as for an unknown trial)."""
    scope = EVERY if policy is None else Scope(frozenset({policy}))
    return trial_view(await services.canary.end(trial_id, decision, scope=scope))
