"""What the demo asks the tracetrain serve it runs, policy by policy: its admin token, the training jobs, the version
serving, the regression guard's pause, each version's success on the training attempts (as the proxy recorded them),
and what it tells it: each held-out evaluation (``POST /admin/evaluations``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx

from tracetrain import Client
from tracetrain_demo.report import HeldOut


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
    params = {name: value for name, value in params.items() if value is not None}
    response = httpx.get(f"{url}{path}", params=params, headers=_bearer(token), timeout=30)
    response.raise_for_status()
    return dict(response.json())


def resume_if_paused(url: str, token: str, policy: str | None = None) -> str | None:
    """When the regression guard rolled a version of ``policy`` back and paused its training, resume it (the next
    step trains on the version restored) and return the guard's reason; else None. An operator would look first; the
    demo goes on."""
    training = admin_get(url, "/admin/training", token, policy=policy)
    if not training["paused"]:
        return None
    params = {"policy": policy} if policy is not None else {}
    response = httpx.post(f"{url}/admin/training/resume", params=params, headers=_bearer(token), timeout=30)
    response.raise_for_status()
    return f"regression guard: {training['training_reason']}"


def jobs(url: str, token: str) -> list[dict[str, Any]]:
    """The newest training jobs of every policy."""
    return list(admin_get(url, "/admin/jobs", token, limit=200)["data"])


def active_version(url: str, token: str, policy: str | None = None) -> int:
    return int(admin_get(url, "/admin/adapters", token, policy=policy)["active_version"])


def post_evaluation(url: str, token: str, policy: str, held: HeldOut) -> None:
    """Tell the server (and through it, the trainer's run loggers) one held-out success of ``policy``."""
    body = {"version": held.version, "scores": {"held_out_success": held.success}, "samples": held.attempts}
    response = httpx.post(f"{url}/admin/evaluations", params={"policy": policy}, json=body, headers=_bearer(token),
                          timeout=30)  # fmt: skip
    response.raise_for_status()


def training_success(url: str, policy: str | None = None) -> dict[int, float]:
    """Success of ``policy``'s rewarded training attempts, by the version that served their last call (as the proxy
    recorded it; the reward service posted each attempt's success with its reward)."""
    wins: dict[int, list[float]] = {}
    with Client(url) as proxy:
        for trajectory in proxy.iter_trajectories(policy=policy, rewarded=True, page_size=1000):
            if "success" in trajectory.metrics:
                wins.setdefault(trajectory.last_version, []).append(trajectory.metrics["success"])
    # A version that served only the stragglers of a round says nothing.
    return {v: sum(w) / len(w) for v, w in wins.items() if len(w) >= 16}


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}
