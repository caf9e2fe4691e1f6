"""Training on two processes (torchrun, gloo on this CPU) takes the step one process takes.

Each test starts torchrun once (~15 s on 2 cores: every rank imports torch and loads the
tiny model); the one-process reference runs in this process.

Why the comparisons have a tolerance: one process adds the micro-batches' float32
gradients in sequence; two ranks each add their own share (4 and 3 of 7 micro-batches) and
all_reduce adds the two partial sums. Float addition is not associative, so the sums
differ in their last bits (relative 1e-7 or so), and so do the AdamW updates built from
them. The tolerance follows each tensor's magnitude: a sum that lost or doubled a rank's
share is off by far more. Two ranks of one run, in contrast, apply the same all-reduced
gradient and hold bit-identical weights.

Sharded (``--shard``, FSDP2 over gloo) the same holds: each rank keeps half of every weight
and moment, the LoRA gradients are summed in FSDP's reduce-scatter, and rank 0 gathers the
adapter and AdamW's state to write the files one process writes.

Why the grad norm is compared too: AdamW's first update is lr * g / (|g| + eps), nearly
blind to the gradient's scale, so averaging instead of summing the ranks' gradients
would still give the same adapter. The pre-clip grad norm would be half.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from sqlalchemy import insert, select
from test_trainer_worker import fetch

from store import connect
from store._tables import AdapterVersion, Call, Group, Policy, TrainingJob, Trajectory
from trainer import TrainConfig
from trainer._worker import Worker, WorkerSettings

TESTS = Path(__file__).parent
REPO = TESTS.parent
A, C, G, J, P, T = (t.__table__ for t in (AdapterVersion, Call, Group, TrainingJob, Policy, Trajectory))

# micro_batch_tokens 32 packs the good job's 3 groups of 5 into 7 micro-batches: rank 0 takes 4, rank 1 takes 3.
CONFIG = TrainConfig(lora_r=8, lora_alpha=16, learning_rate=1e-3, dtype="float32", micro_batch_tokens=32, seed=3)
METRICS = ("loss", "clip_fraction", "ratio_mean", "entropy", "grad_norm")


def child_env() -> dict[str, str]:
    path = os.pathsep.join([str(REPO), str(REPO / "sdk"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}  # 2 ranks on 2 cores: 1 thread each


def assert_same_lora(one: dict[str, torch.Tensor], two: dict[str, torch.Tensor], rtol: float = 1e-4) -> None:
    assert one.keys() == two.keys() and one
    for name, expected in one.items():
        atol = rtol / 10 * float(expected.abs().max())
        torch.testing.assert_close(two[name], expected, rtol=rtol, atol=atol, msg=name)


def assert_same_metrics(one: dict[str, Any], two: dict[str, Any]) -> None:
    for name in METRICS:
        assert two[name] == pytest.approx(one[name], rel=1e-5, abs=1e-7), name
    for name in ("tokens", "forwarded_tokens", "loss_tokens", "samples", "micro_batches"):
        assert two[name] == one[name], name


async def seed_jobs(url: str) -> None:
    """Job 1: a token id beyond the vocabulary (fails on every rank). Job 2: 3 groups of 5 that share a prompt."""
    g = torch.Generator().manual_seed(0)
    engine = await connect(url)
    now = time.time()
    async with engine.begin() as conn:
        await conn.execute(insert(P).values(name="agent", base_model="tiny", active_version=0, created_at=now,
                                            updated_at=now))  # fmt: skip
        jobs = {"bad": ["bad"], "good": ["g0", "g1", "g2"]}
        for groups in jobs.values():
            for n, group_id in enumerate(groups):
                await conn.execute(insert(G).values(id=group_id, policy="agent", state="training", created_at=now))
                prompt = torch.randint(3, 1000, (10 + n,), generator=g).tolist()
                for k in range(5 if group_id != "bad" else 2):
                    completion = torch.randint(3, 1000, (6 + k,), generator=g).tolist()
                    if group_id == "bad":
                        completion[-1] = 50_000
                    trajectory_id = f"{group_id}-{k}"
                    await conn.execute(insert(T).values(id=trajectory_id, group_id=group_id, policy="agent",
                                                        keyed_by="header", created_at=now, updated_at=now,
                                                        reward=float(k * k % 5), metrics={}))  # fmt: skip
                    await conn.execute(insert(C).values(
                        id=f"{trajectory_id}-0", trajectory_id=trajectory_id, group_id=group_id, policy="agent",
                        endpoint="chat.completions", model="agent", served_model="tiny", version=0, stream=False,
                        request={}, prompt_token_ids=prompt, completion_token_ids=completion,
                        logprobs=(-7.0 + torch.randn(len(completion), generator=g)).tolist(), other_choices=[],
                        status_code=200, latency_ms=1.0, started_at=now))  # fmt: skip
            await conn.execute(insert(J).values(policy="agent", state="queued", group_ids=groups, metrics={},
                                                progress=0.0, created_at=now))  # fmt: skip
    await engine.dispose()


async def run_one_process(settings: WorkerSettings) -> None:
    worker = await Worker.open(settings)
    try:
        await worker.prepare()
        await worker.run(once=True)
    finally:
        await worker.close()


@pytest.mark.parametrize("flags", [[], ["--shard"]], ids=["ddp", "fsdp"])
def test_two_processes_record_the_adapter_one_process_would(
    tmp_path: Path, tiny_model_dir: Path, flags: list[str]
) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    urls = {}
    for data in (one, two):
        data.mkdir()
        urls[data] = f"sqlite+aiosqlite:///{data / 'store.db'}"
        asyncio.run(seed_jobs(urls[data]))
    asyncio.run(run_one_process(WorkerSettings(urls[one], one, ("agent",), tiny_model_dir, CONFIG)))
    config = tmp_path / "train.json"
    config.write_text(CONFIG.model_dump_json())
    command = [sys.executable, "-m", "trainer", "--procs", "2", "--database-url", urls[two], "--data-dir", str(two),
               "--base-model", str(tiny_model_dir), "--config", str(config), "--once", *flags]  # fmt: skip
    ran = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    log = ran.stdout + ran.stderr
    assert log.count("trainer worker ready") == 1 and "[rank 0]" in log  # rank 0 alone says it
    assert ("sharded over 2 ranks (FSDP)" in log) == bool(flags)

    for data in (one, two):
        bad, good = asyncio.run(fetch(urls[data], select(J).order_by(J.c.id)))
        assert bad.state == "failed" and "vocabulary" in bad.error  # every rank refused it, and went on
        assert good.state == "succeeded" and good.version == 1, good.error
        adapters = asyncio.run(fetch(urls[data], select(A)))
        assert [(a.version, a.job_id, a.state) for a in adapters] == [(1, good.id, "trained")]
        assert sorted(p.name for p in (data / "adapters" / "agent").iterdir()) == ["1"]  # rank 0 alone wrote

    jobs = {data: asyncio.run(fetch(urls[data], select(J).where(J.c.state == "succeeded")))[0] for data in (one, two)}
    assert jobs[two].metrics["micro_batches"] == 7
    assert_same_metrics(jobs[one].metrics, jobs[two].metrics)
    saved = {data: data / "adapters" / "agent" / "1" for data in (one, two)}
    assert json.loads((saved[two] / "metrics.json").read_text())["grad_norm"] == jobs[two].metrics["grad_norm"]
    assert_same_lora(*(load_file(saved[data] / "adapter_model.safetensors") for data in (one, two)))


def test_every_rank_holds_the_same_lora_and_fails_together(tmp_path: Path, tiny_model_dir: Path) -> None:
    import distributed_learner

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    distributed_learner.main(tiny_model_dir, one)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(TESTS / "distributed_learner.py"), str(tiny_model_dir), str(two)]  # fmt: skip
    ran = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr

    ranks = [load_file(two / f"rank{r}.safetensors") for r in (0, 1)]
    assert all(torch.equal(ranks[0][name], ranks[1][name]) for name in ranks[0])  # bit for bit: one gradient
    assert_same_lora(load_file(one / "rank0.safetensors"), ranks[0])
    reports = [json.loads((two / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert_same_metrics(json.loads((one / "rank0.json").read_text())["result"], reports[0]["result"])

    # Rank 1 failed mid-step: both ranks raised, neither stepped, and the next step kept them equal.
    assert [r["failure"][0] for r in reports] == ["StepFailed", "StepFailed"]
    assert "rank 1: RuntimeError: deliberate failure" in reports[1]["failure"][1]
    after = [load_file(two / f"rank{r}-after-failure.safetensors") for r in (0, 1)]
    assert all(torch.equal(after[0][name], after[1][name]) for name in after[0])
    assert any(not torch.equal(after[0][name], ranks[0][name]) for name in after[0])


def test_a_sharded_learner_saves_and_resumes_as_one_process_does(tmp_path: Path, tiny_model_dir: Path) -> None:
    import distributed_learner

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    distributed_learner.main(tiny_model_dir, one, shard=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(TESTS / "distributed_learner.py"), str(tiny_model_dir), str(two), "--shard"]  # fmt: skip
    ran = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr

    reports = {"one": json.loads((one / "rank0.json").read_text()),
               **{f"rank{r}": json.loads((two / f"rank{r}.json").read_text()) for r in (0, 1)}}  # fmt: skip
    assert [r["sharded"] for r in reports.values()] == [False, True, True]
    assert all(r["restored_optimizer"] for r in reports.values())
    for r in (0, 1):  # every rank reports the whole batch's step
        assert_same_metrics(reports["one"]["first"], reports[f"rank{r}"]["first"])
        assert_same_metrics(reports["one"]["second"], reports[f"rank{r}"]["second"])
    assert not (two / "step2-rank1").exists()  # rank 0 alone writes
    # A resumed AdamW step divides by the root of the second moment, which tiny gradients keep small: the
    # 1e-7 relative float noise of the gradient sums (measured: 1e-4 relative in one weight of step 2) grows
    # there, so the second adapter is compared at 1e-3. The moments themselves (linear in the gradients) at 1e-4.
    for step, rtol in (("step1", 1e-4), ("step2-rank0", 1e-3)):
        saved = [load_file(data / step / "adapter_model.safetensors") for data in (one, two)]
        assert_same_lora(*saved, rtol=rtol)
        moments = [torch.load(data / step / "optimizer.pt", weights_only=True) for data in (one, two)]
        assert moments[0]["param_names"] == moments[1]["param_names"]
        for i, expected in moments[0]["optimizer"]["state"].items():
            got = moments[1]["optimizer"]["state"][i]
            assert got["exp_avg"].shape == expected["exp_avg"].shape  # gathered whole, not one rank's shard
            assert_same_lora(
                {k: expected[k] for k in ("exp_avg", "exp_avg_sq")}, {k: got[k] for k in ("exp_avg", "exp_avg_sq")}
            )
    # The step moved the adapter: equality is not the trivial one of two untouched initialisations.
    first, second = (load_file(one / s / "adapter_model.safetensors") for s in ("step1", "step2-rank0"))
    assert any(not torch.equal(first[name], second[name]) for name in first)


def test_procs_runs_the_same_command_under_torchrun_with_the_threads_shared() -> None:
    from trainer._distributed import torchrun_command

    argv = ["--database-url", "sqlite+aiosqlite:///s.db", "--procs", "2", "--once", "--procs=2"]
    command, env = torchrun_command(2, argv, {"OMP_NUM_THREADS": "4", "PATH": "/bin"})
    assert command == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       "-m", "trainer", "--database-url", "sqlite+aiosqlite:///s.db", "--once"]  # fmt: skip
    assert env == {"OMP_NUM_THREADS": "2", "PATH": "/bin"}
    assert torchrun_command(4, [], {"OMP_NUM_THREADS": "1"})[1]["OMP_NUM_THREADS"] == "1"


def test_serve_passes_trainer_procs_to_the_worker(tmp_path: Path) -> None:
    from proxy import Settings
    from tracetrain_cli._serve import trainer_argv

    settings = Settings(upstream="http://127.0.0.1:9/v1", data_dir=tmp_path)
    two = trainer_argv(settings, tmp_path, "cpu", ["--once"], procs=2)
    assert two[1:3] == ["-m", "trainer"] and two[two.index("--procs") + 1] == "2" and two[-1] == "--once"
    assert "--procs" not in trainer_argv(settings, tmp_path, "cpu", [])
    assert "--shard" in trainer_argv(settings, tmp_path, "cuda", [], procs=2, shard=True)
    assert "--shard" not in two and "--shard" not in trainer_argv(settings, tmp_path, "cuda", [], shard=True)


def test_ranks_above_0_outlast_a_wait_for_the_shared_gpu_longer_than_the_collective_timeout(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The step's word comes after the grant; a drain longer than the collective timeout must not kill rank 1."""
    from store import GpuHandover, Store

    url = f"sqlite+aiosqlite:///{tmp_path / 'store.db'}"
    asyncio.run(seed_jobs(url))
    config = tmp_path / "train.json"
    config.write_text(CONFIG.model_dump_json())
    command = [sys.executable, "-m", "trainer", "--procs", "2", "--database-url", url, "--data-dir", str(tmp_path),
               "--base-model", str(tiny_model_dir), "--config", str(config), "--once", "--share-gpu",
               "--collective-timeout", "2"]  # fmt: skip

    async def grant_late(trainer: subprocess.Popen[str]) -> list[float]:
        """What the proxy does, slowly: each request is granted 5 s after it is made (vLLM draining long calls)."""
        store, waited = await Store.open(url, capture=False), []
        try:
            while trainer.poll() is None:
                for job in await store.jobs.pending_gpu_requests("agent"):
                    if job["gpu_state"] == GpuHandover.REQUESTED:
                        asked = time.monotonic()
                        await asyncio.sleep(5.0)
                        assert await store.jobs.grant_gpu(job["id"])
                        waited.append(time.monotonic() - asked)
                await asyncio.sleep(0.1)
        finally:
            await store.close()
        return waited

    with subprocess.Popen(command, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as trainer:  # fmt: skip
        waited = asyncio.run(asyncio.wait_for(grant_late(trainer), 240))
        log = trainer.communicate(timeout=60)[0]
    assert trainer.returncode == 0, log
    assert len(waited) == 2 and min(waited) > 2  # both steps waited longer than the collective timeout
    bad, good = asyncio.run(fetch(url, select(J).order_by(J.c.id)))
    assert bad.state == "failed" and good.state == "succeeded" and good.version == 1, log
