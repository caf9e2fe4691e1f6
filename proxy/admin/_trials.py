"""What the dashboard and the admin API show of canary trials (``--canary``), and an admin's end of one."""

from __future__ import annotations

from typing import Any, Literal

from proxy.admin._service import Sources
from store import TRIAL_FIELDS

Ending = Literal["promoted", "rolled_back"]


def trial_view(row: dict[str, Any]) -> dict[str, Any]:
    """A trial as the API shows it: its row, and its last look (shares, each version's rewards, the test)."""
    return {"object": "trial", **{name: row[name] for name in TRIAL_FIELDS}}


async def list_trials(services: Sources, limit: int) -> dict[str, Any]:
    """The policy's trials, newest first; the running one, if any, first of all; the canary's settings."""
    s = services.settings
    rows = await services.store.trials.newest(s.policy, limit)
    running = next((trial_view(r) for r in rows if r["state"] == "running"), None)
    return {
        "object": "list",
        "policy": s.policy,
        "canary": {
            "fraction": s.canary,
            "margin": s.canary_margin,
            "alpha": s.canary_alpha,
            "max_groups": s.canary_groups,
            "max_minutes": s.canary_minutes,
        },
        "running": running,
        "data": [trial_view(r) for r in rows],
    }


async def end_trial(services: Sources, trial_id: int, decision: Ending) -> dict[str, Any]:
    """An admin promotes the running trial's version, or rolls it back (409 once it has ended)."""
    return trial_view(await services.canary.end(trial_id, decision))
