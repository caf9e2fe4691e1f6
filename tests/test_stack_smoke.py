"""The compose stack's smoke test waits for a training job it can kill while the trainer holds it: a job that ran to
its end between two looks is followed by another, and the wait ends in a clear failure after a few tries."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


def _smoke() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "docker" / "stack_smoke.py"
    spec = importlib.util.spec_from_file_location("stack_smoke", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("stack_smoke", module)
    spec.loader.exec_module(module)
    return module


class _Stack:
    """Jobs as the admin API lists them; each reward of two groups makes a job that runs for ``looks[i]`` looks
    (0: it ran to its end before the first look)."""

    def __init__(self, looks: list[int]) -> None:
        self.looks = looks
        self.jobs_made: list[dict[str, Any]] = [{"id": "1", "state": "succeeded"}]
        self.left = 0
        self.rewarded = 0

    def call(self, group: str, trajectory: str, task: str) -> str:
        return "yes"

    def reward(self, rewards: dict[str, float]) -> None:
        self.left = self.looks[self.rewarded]
        self.jobs_made.append({"id": str(len(self.jobs_made) + 1), "state": "running" if self.left else "succeeded",
                               "worker": "w", "progress": 0.2})  # fmt: skip
        self.rewarded += 1

    def jobs(self) -> list[dict[str, Any]]:
        return [dict(job) for job in self.jobs_made]


@pytest.fixture
def smoke(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    module = _smoke()
    monkeypatch.setattr(module.time, "sleep", lambda s: None)
    return module


def test_a_job_seen_running_is_the_one_killed(smoke: ModuleType) -> None:
    stack = _Stack([3])
    assert smoke.a_running_job(stack, {"1"})["id"] == "2"
    assert stack.rewarded == 1


def test_a_job_that_ended_out_of_sight_is_followed_by_another(smoke: ModuleType, capsys: Any) -> None:
    stack = _Stack([0, 0, 2])
    done = {"1"}
    assert smoke.a_running_job(stack, done)["id"] == "4"
    assert stack.rewarded == 3 and done == {"1", "2", "3"}  # the missed jobs are not taken for the killed one's end
    assert "job 2 ended before it was seen running" in capsys.readouterr().out


def test_no_job_seen_running_fails_with_the_reason(smoke: ModuleType) -> None:
    with pytest.raises(SystemExit, match="no job was seen running in 3 tries"):
        smoke.a_running_job(_Stack([0, 0, 0]), {"1"})
