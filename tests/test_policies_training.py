"""Several policies trained side by side: each on its own groups, one trainer, one vLLM, fairly.

The fake vLLM serves; the real trainer ``Worker`` (the tiny model, its embedding as wide as the fake's
token ids) trains the jobs of both policies; the publisher loads ``support@1`` and ``sql@1`` into the
same vLLM. Fairness: the trainer claims the job of the policy trained least recently, so a policy with a
job queued waits at most one step of each other policy, however many jobs a busy one queued.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM
from fake_vllm_text import TOKEN_ID_LIMIT
from test_trainer_worker import run_worker

TASKS = {"support": "My order never arrived: what now?", "sql": "Which table holds the orders?",
         "flood": "Summarise the ticket.", "quiet": "Tag the ticket."}  # fmt: skip


@pytest.fixture
def wide_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-llama-wide", vocab_size=TOKEN_ID_LIMIT)


def rewarded_group(proxy: RunningProxy, policy: str, group: str, size: int = 2) -> None:
    """``size`` attempts of the policy's task in one group, rewarded apart (a group that carries signal)."""
    for k in range(size):
        client = proxy.client(default_headers={"X-Trajectory-Id": f"{group}-{k}", "X-Group-Id": group})
        client.chat.completions.create(model=policy, messages=[{"role": "user", "content": TASKS[policy]}])
    rewards = [{"trajectory_id": f"{group}-{k}", "reward": float(k % 2)} for k in range(size)]
    httpx.post(f"{proxy.v1}/rewards", json={"rewards": rewards}).raise_for_status()


def jobs(proxy: RunningProxy, **params: Any) -> list[dict[str, Any]]:
    return list(httpx.get(f"{proxy.url}/admin/jobs", params={"limit": 100, **params}).json()["data"])


def active(proxy: RunningProxy, policy: str) -> int:
    return int(httpx.get(f"{proxy.url}/admin/adapters", params={"policy": policy}).json()["active_version"])


def worker_settings(proxy: RunningProxy, model: Path, policies: tuple[str, ...] = ()) -> Any:
    from trainer import TrainConfig
    from trainer._worker import WorkerSettings

    return WorkerSettings(database_url=proxy.settings.resolved_database_url, data_dir=proxy.settings.data_dir,
                          policies=policies, base_model=model,
                          config=TrainConfig(lora_r=8, lora_alpha=16, dtype="float32"))  # fmt: skip


def test_two_policies_train_at_once_each_on_its_own_groups_and_are_served_side_by_side(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, wide_tiny_model: Path
) -> None:
    proxy = start_proxy(policies=("support", "sql"), min_group_size=2, batch_groups=1, unload_grace_s=0)
    rewarded_group(proxy, "support", "support-g1")
    rewarded_group(proxy, "sql", "sql-g1")
    queued = {job["policy"]: job["group_ids"] for job in jobs(proxy)}
    assert queued == {"support": ["support-g1"], "sql": ["sql-g1"]}  # a job holds one policy's groups

    assert asyncio.run(run_worker(worker_settings(proxy, wide_tiny_model))) == 2  # one trainer, both policies
    done = {job["policy"]: job for job in jobs(proxy)}
    assert {p: (j["state"], j["version"]) for p, j in done.items()} == {"support": ("succeeded", 1),
                                                                         "sql": ("succeeded", 1)}  # fmt: skip
    assert all(job["metrics"]["samples"] == 2 and job["metrics"]["loss_tokens"] > 0 for job in done.values())
    for policy in ("support", "sql"):
        assert (proxy.settings.data_dir / "adapters" / policy / "1" / "adapter_model.safetensors").is_file()
    deadline = time.monotonic() + 30
    while not (active(proxy, "support") == active(proxy, "sql") == 1):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert {"support@1", "sql@1"} <= set(fake.loras)  # one vLLM holds both policies' versions
    for policy in ("support", "sql"):
        reply = proxy.client().chat.completions.create(model=policy, messages=[{"role": "user", "content": "Hi"}])
        assert reply.model == f"{policy}@1"
    # Each policy's step trained its own LoRA from its own start: two different adapters.
    from safetensors.torch import load_file

    weights = [load_file(proxy.settings.data_dir / "adapters" / p / "1" / "adapter_model.safetensors")
               for p in ("support", "sql")]  # fmt: skip
    assert any(not weights[0][name].equal(weights[1][name]) for name in weights[0])


def test_a_policy_flooding_the_trainer_delays_another_by_one_step_at_most(
    start_proxy: Callable[..., RunningProxy], fake: FakeVLLM, wide_tiny_model: Path
) -> None:
    """The bound, measured on the real trainer: flood 4 jobs of one policy, queue one of the other behind them."""
    proxy = start_proxy(policies=("flood", "quiet"), min_group_size=2, batch_groups=1)
    for k in range(4):
        rewarded_group(proxy, "flood", f"flood-g{k}")
    rewarded_group(proxy, "quiet", "quiet-g0")  # queued last, behind all four
    assert [job["policy"] for job in sorted(jobs(proxy), key=lambda j: j["id"])] == ["flood"] * 4 + ["quiet"]

    assert asyncio.run(run_worker(worker_settings(proxy, wide_tiny_model))) == 5
    ran = sorted(jobs(proxy), key=lambda j: j["started_at"])
    assert all(job["state"] == "succeeded" for job in ran)
    order = [job["policy"] for job in ran]
    # Both never trained: the oldest job first (flood's), then the policy trained least recently (quiet's).
    assert order == ["flood", "quiet", "flood", "flood", "flood"]
    quiet = next(job for job in ran if job["policy"] == "quiet")
    waited = [job for job in ran if job["policy"] == "flood" and job["started_at"] < quiet["started_at"]]
    assert len(waited) == 1  # the bound: one step of each other policy with work
