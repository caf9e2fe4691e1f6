"""The trainer worker: claims a queued job from the store, trains one step, records the adapter.

    store (queued job) --claim--> load its groups' trajectories --> build samples and advantages
        --> Learner.step --> <data>/adapters/<policy>/<N>/ --> adapters row (state "trained") and its files

One worker trains every policy served (or those it is given), one step at a time: it claims the
queued job of the policy trained least recently (``store.Jobs.claim_next``), so a policy with ready
groups waits at most one step of each other policy, however many jobs a busy one queued. The base
model stays loaded; moving to another policy puts that policy's LoRA and AdamW state in place of the
last one's (``Learner.switch``), or builds the learner again when that cannot be done in place.

The proxy publishes what the worker records (``proxy.training._publisher``). The worker trains on top of the
version the policy serves: after a rollback or a failed publish it reloads that version's adapter first. It
never talks to vLLM or the proxy; the store is the only thing they share, so the worker can run on its own GPU
machine: the adapter's files are recorded in the store with it, and vLLM fetches them through the proxy.

A claimed job carries a lease that the worker renews while it trains. A worker that dies stops renewing: after
the lease any proxy replica queues the job again (``store._jobs``). A worker that restarts on the same host
gives back at once the claims of its dead predecessor, without waiting for the lease.

Under torchrun (``--procs N``) the ``Worker`` runs on rank 0 only and tells the other ranks
what to do; they run ``follow``, which never opens the store (``trainer._distributed``).

With ``share_gpu`` (one GPU for vLLM and the trainer) the step, saving and recording run
while vLLM sleeps: the worker asks for the GPU through the store (``trainer._handover``).
Every rank frees what a step held once it ends (``trainer._memory``), rank 0 before it gives the
GPU back, so that vLLM's workers on every GPU have their memory to wake into.

With ``--log-to`` the worker (rank 0) also writes the run: each recorded step's metrics, and the
evaluations posted to the store, to TensorBoard, W&B or MLflow (``trainer._run_log``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from store import Store
from trainer import _distributed
from trainer._adapters import files_for_store
from trainer._batch import TrajectoryData, build_batch
from trainer._config import TrainConfig
from trainer._distributed import Idle, Load, Ranks, Step, StepFailed, Stop, Word
from trainer._handover import Grant, gpu_handed_over, stop_when_revoked
from trainer._learner import Learner
from trainer._memory import release_learner_memory, release_step_memory
from trainer._retention import retain
from trainer._run_log import RunLogs
from trainer._sampling import SamplingDefaults
from trainer._step import TrainItem
from trainer._tokenizer import model_decode

log = logging.getLogger("tracetrain.trainer")

# The line the worker logs once it can train; `tracetrain serve` waits for it in the log.
READY_LINE = "trainer worker ready"
# A claim outlives a worker by this long; the worker renews it every third of it while it trains.
JOB_LEASE_S = 60.0
# How long a rank waits in a collective (the next word of rank 0, a gradient all_reduce) before it gives
# up: torch's default for NCCL. Rank 0 says a word at least every quarter of it while it waits for the GPU.
COLLECTIVE_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    database_url: str
    data_dir: Path
    policies: tuple[str, ...]  # the policies whose jobs to run; empty: every policy served
    base_model: Path  # the HF model directory vLLM serves as the base
    config: TrainConfig
    init_adapter: Path | None = None  # a LoRA to start from (an SFT warm start) instead of a fresh one
    device: str = "cpu"
    poll_s: float = 1.0
    lease_s: float = JOB_LEASE_S
    share_gpu: bool = False  # the GPU is vLLM's but for each step, which waits for the proxy's grant
    shard: bool = False  # under torchrun: the base and the LoRA split over the ranks (FSDP2), not replicated
    attn_implementation: str = "auto"  # trainer._attention.choose_attention's choice, or a name that forces one
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S  # under torchrun: the process group's timeout
    # retention: the newest versions that keep their files (trainer._retention), unless the policy says another
    keep_versions: int = 3
    # how a call's reward reaches the calls before it (tracetrain_core.call_advantages), unless the policy says another
    turn_discount: float = 1.0
    adapter_files: bool = True  # record each adapter's files in the store (a vLLM that cannot see this disk)

    def adapters_of(self, policy: str) -> Path:
        """``DATA_DIR/adapters/POLICY``: where the policy's step directories go."""
        return self.data_dir / "adapters" / policy


class Worker:
    """The worker of one process, or rank 0 of several (``group``): the only one that talks to the store."""

    def __init__(
        self, settings: WorkerSettings, store: Store, group: Ranks | None = None, run_log: RunLogs | None = None
    ) -> None:
        self.settings = settings
        self._store = store
        self._group = group
        self._name = f"{socket.gethostname()}:{os.getpid()}"
        self._held = HeldLearner(settings)
        self._run_log = run_log  # --log-to: each policy's steps and evaluations in TensorBoard, W&B, MLflow

    @classmethod
    async def open(cls, settings: WorkerSettings, group: Ranks | None = None, run_log: RunLogs | None = None) -> Worker:
        return cls(settings, await Store.open(settings.database_url, capture=False), group, run_log)

    async def prepare(self) -> None:
        """Requeue the jobs a dead worker of this host left running, and load the model now.

        Loading before the first job makes the first step as fast as the others, and lets
        ``tracetrain serve`` say the trainer is ready when it is (it waits for ``READY_LINE``).
        """
        await self._requeue_orphans()
        policy = await self._first_policy()
        if self._run_log is not None:  # its run starts now (one that cannot start is reported with each step)
            await asyncio.to_thread(self._run_log.of, policy)
        version = await self._store.adapters.version_to_train_on(policy)
        self._tell(Load(policy, version))
        await asyncio.to_thread(self._held.at, policy, version)
        if self._group is not None:
            await asyncio.to_thread(_distributed.barrier)  # every rank has loaded the model
        which = ", ".join(self.settings.policies) if self.settings.policies else "every policy served"
        log.info("%s: policies %s, base model %s, device %s", READY_LINE, which, self.settings.base_model,
                 self.settings.device)  # fmt: skip

    async def _first_policy(self) -> str:
        """The policy to load first: the first given, else the first served (its first step is then no slower)."""
        if self.settings.policies:
            return self.settings.policies[0]
        served = await self._store.policies.serving()
        return str(served[0]["name"]) if served else "agent"

    async def _requeue_orphans(self) -> None:
        host = socket.gethostname()
        for job in await self._store.jobs.running():
            worker_host, _, pid = str(job["worker"]).rpartition(":")
            dead = worker_host == host and pid.isdigit() and not _alive(int(pid))
            if dead and await self._store.jobs.release(job["id"], job["worker"]):
                log.warning("job %s: its worker %s is gone; queued again", job["id"], job["worker"])

    async def close(self) -> None:
        await self._store.close()

    async def run(self, *, once: bool = False) -> int:
        """Run jobs until cancelled (or, with ``once``, until no job is queued); returns jobs run."""
        done = 0
        while True:
            await self.log_evaluations()
            try:
                job = await self.claim()
            except Exception:  # the store is down or refuses writes (a full disk): wait, never exit
                log.exception("claiming a job failed; trying again in %.0f s", self.settings.poll_s)
                if once:
                    self._tell(Stop())
                    return done
                await asyncio.sleep(self.settings.poll_s)
                continue
            if job is None:
                if once:
                    self._tell(Stop())
                    return done
                self._tell(Idle())
                await asyncio.sleep(self.settings.poll_s)
                continue
            await self.run_job(job)
            done += 1

    async def claim(self) -> dict[str, Any] | None:
        """Take a queued job under a lease, of the policy trained least recently; None when there is none (or
        every policy with one has a job running).

        The claim gives the job the version its step records (``job["version"]``): past every adapter
        of the store, and past every step directory on this disk (a store reset leaves them there).
        """
        firsts = {}
        for root in (self.settings.data_dir / "adapters").glob("*"):
            steps = [int(p.name) for p in root.glob("*") if p.name.isascii() and p.name.isdigit()]
            firsts[root.name] = max(steps, default=0) + 1
        return await self._store.jobs.claim_next(self._name, self.settings.lease_s,
                                                 policies=self.settings.policies or None,
                                                 first_versions=firsts)  # fmt: skip

    async def run_job(self, job: dict[str, Any]) -> None:
        renewing = asyncio.create_task(self._renew_lease(job["id"]), name=f"lease-{job['id']}")
        error: str | None = None
        try:
            metrics, version = await self._train(job)
        except Exception as exc:
            log.exception("training job %s failed", job["id"])
            ok, metrics, version, error = False, {}, None, f"{type(exc).__name__}: {exc}"
            release_step_memory(exc)  # a GPU of its own too: the next step needs what this one left
        else:
            ok = True
            if self._run_log is not None:  # --log-to's trouble, shown with the step (the dashboard, /metrics)
                metrics |= await asyncio.to_thread(self._run_log.trouble, str(job["policy"]))
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewing
        try:
            finished = await self._store.jobs.finish(job["id"], self._name, ok=ok, metrics=metrics, version=version,
                                                     error=error)  # fmt: skip
        except Exception:  # the store refuses writes (a full disk): the lease runs out and the job is queued again
            log.exception("job %s: its end could not be recorded; it runs again once its lease expires", job["id"])
            return
        if not finished:
            log.warning("job %s: its lease ran out and another worker took it; this result is dropped", job["id"])
        elif ok and version is not None and self._run_log is not None:
            await asyncio.to_thread(self._run_log.log_step, str(job["policy"]), version, metrics)

    async def log_evaluations(self) -> None:
        """Log the evaluations posted since the last look (``--log-to``), each into its policy's run."""
        if self._run_log is not None:
            policies = list(self.settings.policies) or [p["name"] for p in await self._store.policies.all()]
            await self._run_log.log_evaluations(self._store, policies)

    async def _renew_lease(self, job_id: int) -> None:
        """Keep the claim alive while the step runs (in a thread, so this loop stays free)."""
        while True:
            await asyncio.sleep(self.settings.lease_s / 3)
            try:
                if not await self._store.jobs.renew(job_id, self._name, self.settings.lease_s):
                    log.warning("job %s: the claim was lost (lease expired?)", job_id)
                    return
            except Exception:  # the store may be briefly unreachable: try again at the next beat
                log.exception("job %s: renewing the lease failed", job_id)

    async def _train(self, job: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
        began = time.monotonic()
        policy = str(job["policy"])
        holds = self._held.holds
        base = await self._store.adapters.version_to_train_on(policy)
        stored = await self._store.jobs.rewarded_trajectories(job["group_ids"], policy=policy)
        config = self.settings.config
        defaults = SamplingDefaults.of_model(self.settings.base_model, temperature=config.default_temperature)
        trajectories = [TrajectoryData.from_store(t, defaults) for t in stored]
        decode = await asyncio.to_thread(model_decode, self.settings.base_model)
        discount = await self._turn_discount(policy)
        batch = build_batch(trajectories, config, trained_version=base, decode=decode, turn_discount=discount)
        if not batch.samples:
            log.warning("job %s: nothing to learn from (%s)", job["id"], batch.metrics)
            return {**batch.metrics, "skipped": "no sample carries a signal"}, None
        await self._store.jobs.renew(job["id"], self._name, self.settings.lease_s, progress=0.2)
        items = [
            TrainItem(sample, advantage, on_policy=sample.oldest_version >= base)
            for sample, advantage in zip(batch.samples, batch.advantages, strict=True)
        ]
        async with self._gpu(job["id"]) as grant:  # one GPU shared with vLLM: held from here to the record
            self._tell(Step(policy, base, holds, tuple(items)))
            # Loaded after the word: a sharded learner's set-up is collective, so every rank builds it together.
            learner = await asyncio.to_thread(self._held.at, policy, base)
            with stop_when_revoked(learner, grant):
                result = await asyncio.to_thread(learner.step, items)
            self._held.holds = (policy, -1)  # the weights moved: no version until they are saved as one
            version = int(job["version"])  # decided by the claim: no other worker records it
            metrics = {**batch.metrics, **result.to_dict(), "version": version, "trained_from": base,
                       **await self._times(stored, began)}  # fmt: skip
            # A lost claim's job is another worker's now, with this version: never write over its directory.
            if not await self._store.jobs.renew(job["id"], self._name, self.settings.lease_s, progress=0.8):
                return self._dropped(job, version, metrics)
            out_dir = self.settings.adapters_of(policy) / str(version)
            await asyncio.to_thread(learner.save, out_dir, metrics)
            self._held.holds = (policy, version)
            # The files go with the record: a vLLM that cannot see this disk fetches them through the proxy.
            try:
                files = await asyncio.to_thread(files_for_store, out_dir) if self.settings.adapter_files else []
                recorded = await self._store.adapters.record(policy, version, str(out_dir.resolve()), job["id"],
                                                             metrics, files, owner=self._name)  # fmt: skip
            except Exception:  # a version not on record is no version: nothing half-done stays (a full disk)
                await asyncio.to_thread(shutil.rmtree, out_dir, True)
                raise
            if not recorded:  # the claim was lost: the directory is the new claimant's to write
                return self._dropped(job, version, metrics)
        await self._retain(policy)
        log.info("job %s: trained %s@%d (loss %.4f, reward mean %.3f, %.1f s)", job["id"], policy, version,
                 result.loss, batch.metrics["reward_mean"], result.seconds)  # fmt: skip
        return metrics, version

    async def _turn_discount(self, policy: str) -> float:
        """The policy's own turn discount (its stored settings, checked when they were written), else the trainer's."""
        own = ((await self._store.policies.get(policy)) or {}).get("config") or {}
        return float(own.get("turn_discount", self.settings.turn_discount))

    async def _times(self, stored: list[Any], began: float) -> dict[str, float]:
        """How long sampling took (the step's first call to its last answer), and this job so far."""
        window = await self._store.jobs.sampling_window([t.id for t in stored])
        times = {"job_seconds": time.monotonic() - began}
        return times | ({"sampling_seconds": window[1] - window[0]} if window else {})

    def _dropped(self, job: dict[str, Any], version: int, metrics: dict[str, Any]) -> tuple[dict[str, Any], None]:
        log.warning("job %s: the claim was lost before %s@%d was recorded; the step is dropped", job["id"],
                    job["policy"], version)  # fmt: skip
        return {**metrics, "dropped": "the claim was lost"}, None

    async def _retain(self, policy: str) -> None:
        """Retention after a version is recorded (the policy's own ``keep_versions`` when it has one); its failure
        is logged, never the step's."""
        try:
            row = await self._store.policies.get(policy)
            keep = int((row or {}).get("config", {}).get("keep_versions") or self.settings.keep_versions)
            await retain(self._store, policy, self.settings.adapters_of(policy), keep)
        except Exception:
            log.exception("retention of %s's versions failed; the next step tries again", policy)

    def _tell(self, word: Word) -> None:
        if self._group is not None:
            _distributed.tell(word)

    def _gpu(self, job_id: int) -> contextlib.AbstractAsyncContextManager[Grant | None]:
        """The step's hold on a GPU shared with vLLM (asked from the proxy through the store); else nothing."""
        if not self.settings.share_gpu:
            return contextlib.nullcontext()
        # The other ranks wait for the step's word, which comes after the grant: an Idle keeps them in time.
        keepalive = (lambda: self._tell(Idle())) if self._group is not None else None
        return gpu_handed_over(self._store, job_id, self._name, keepalive=keepalive,
                               keepalive_s=self.settings.collective_timeout_s / 4)  # fmt: skip


class HeldLearner:
    """The learner a process holds, and the (policy, adapter version) its weights are."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.learner: Learner | None = None
        self.holds: tuple[str, int] = ("", -1)
        self.switches = 0  # moves to another policy's LoRA in place, the base kept (Learner.switch)
        self.builds = 0  # learners built (the base loaded)

    def at(self, policy: str, version: int) -> Learner:
        """The learner holding ``policy@version``'s weights: the one held when it holds them, else that one with
        the adapter switched in place (the base kept), else a new one.

        The learner it held is freed before a new one is built: two at once would double the
        trainer's resident memory (inside a hand-over, after a rollback or a failed publish),
        which the GPU plan does not leave room for.
        """
        if self.learner is not None and self.holds == (policy, version):
            return self.learner
        settings = self.settings
        adapter = settings.adapters_of(policy) / str(version) if version > 0 else settings.init_adapter
        if adapter is not None and not adapter.is_dir():
            raise FileNotFoundError(f"the adapter to train from is missing: {adapter}")
        if self.learner is not None and self.learner.switch(adapter):
            self.holds = (policy, version)
            self.switches += 1
            return self.learner
        if self.learner is not None:
            self.learner, self.holds = None, ("", -1)
            release_learner_memory()
        self.learner = Learner(settings.base_model, settings.config, adapter=adapter, device=settings.device,
                               attn_implementation=settings.attn_implementation, shard=settings.shard)  # fmt: skip
        self.holds = (policy, version)
        self.builds += 1
        return self.learner


def follow(settings: WorkerSettings) -> None:
    """A rank above 0: do what rank 0 says until it says stop. Never touches the store.

    Its weights are always rank 0's (same start, same summed gradients), so rank 0's
    version label for them is this rank's too. A step that fails fails on every rank
    (``ValueError`` from the batch's checks, ``StepFailed``); rank 0 records why and goes
    on, and so does this rank. Any other error ends the process, and torchrun the others.
    After every step it frees what the step held, as rank 0 does before giving a shared GPU back.
    """
    held = HeldLearner(settings)
    while True:
        word = _distributed.listen()
        if isinstance(word, Stop):
            return
        if isinstance(word, Load):
            held.at(word.policy, word.version)
            _distributed.barrier()
        elif isinstance(word, Step):
            held.holds = word.holds
            try:
                held.at(word.policy, word.version).step(word.items)
            except (ValueError, StepFailed) as exc:
                log.debug("the step failed on every rank: %s", exc)
                release_step_memory(exc)
            else:
                release_step_memory()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
