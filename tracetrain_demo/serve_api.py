"""What the demo asks the tracetrain serve it runs: its admin token, the training jobs, the version serving, the
regression guard's pause, and each version's success on the training attempts (as the proxy recorded them)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx

from tracetrain import Client


def admin_token(run_dir: Path) -> str:
    """The admin token serve uses: TRACETRAIN_ADMIN_TOKEN, else the one it made in DATA_DIR/demo/admin-token."""
    if token := os.environ.get("TRACETRAIN_ADMIN_TOKEN"):
        return token
    path = run_dir / "admin-token"
    if not path.is_file():
        raise SystemExit(
            f"tracetrain demo: no admin token for the dashboard API: set TRACETRAIN_ADMIN_TOKEN to the one the "
            f"tracetrain serve at --url uses (or run that serve with --data-dir {run_dir})"
        )
    return path.read_text().strip()


def admin_get(url: str, path: str, token: str, **params: Any) -> dict[str, Any]:
    response = httpx.get(f"{url}{path}", params=params, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    response.raise_for_status()
    return dict(response.json())


def resume_if_paused(url: str, token: str) -> str | None:
    """When the regression guard rolled a version back and paused training, resume it (the next step trains on the
    version restored) and return the guard's reason; else None. An operator would look first; the demo goes on."""
    training = admin_get(url, "/admin/training", token)
    if not training["paused"]:
        return None
    response = httpx.post(f"{url}/admin/training/resume", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    response.raise_for_status()
    return f"regression guard: {training['training_reason']}"


def jobs(url: str, token: str) -> list[dict[str, Any]]:
    return list(admin_get(url, "/admin/jobs", token, limit=200)["data"])


def active_version(url: str, token: str) -> int:
    return int(admin_get(url, "/admin/adapters", token)["active_version"])


def training_success(url: str) -> dict[int, float]:
    """Success of the rewarded training attempts, by the version that served their last call (as the proxy recorded
    it; the reward service posted each attempt's success with its reward)."""
    wins: dict[int, list[float]] = {}
    with Client(url) as proxy:
        for trajectory in proxy.iter_trajectories(rewarded=True, page_size=1000):
            if "success" in trajectory.metrics:
                wins.setdefault(trajectory.last_version, []).append(trajectory.metrics["success"])
    # A version that served only the stragglers of a round says nothing.
    return {v: sum(w) / len(w) for v, w in wins.items() if len(w) >= 16}
