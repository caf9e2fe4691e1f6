"""One GPU for vLLM and the trainer: vLLM sleeps while the trainer steps (``--share-gpu``).

    trainer worker                  store: training_jobs.gpu_state       proxy: this coordinator
    claims a job, builds its batch
    request_gpu, waits ───────────▶ requested ─────────────────────────▶ polls, finds it
                                                                         the gate closes: new calls wait in the proxy
                                                                         every vLLM: /pause?mode=wait (what runs ends),
                                                                                     /sleep?level=1&mode=wait
    sees the grant ◀────────────── granted ◀───────────────────────────── grant_gpu
    steps, saves, records adapter
    release_gpu ──────────────────▶ released ──────────────────────────▶ every vLLM: /wake_up, /is_sleeping is false
                                                                         the publisher loads the adapter, flips alias
                                                                         every vLLM: /resume; the gate opens

The store is the only channel (the proxy never imports the trainer). The held calls are
routed when the gate opens, so the version the step made serves them; none is aborted
(``mode=wait`` everywhere: vLLM's default, "abort", would end the agents' calls).

Whatever happens once vLLM is paused, it is woken and serving resumes (``try``/``finally``):
the step fails (the worker releases in its own ``finally``); the worker dies (its lease
runs out, the job is queued again and the hand-over revoked in one transaction,
``store._jobs``); the step outlives ``--handover-timeout`` (revoked here); pausing or
sleeping fails (the request stays pending and is tried again after a back-off, while the
trainer waits). After ``_MAX_FAILED_TRIES`` failures in a row the coordinator gives up: the
request is revoked, every policy's training is paused with the reason (the dashboard and the
admin API show it, ``/readyz`` names it, the log says it), and vLLM serves on. An admin's
resume (``POST /admin/training/resume``) lets it try again. A proxy restarted mid-step finds
the granted hand-over, puts vLLM to sleep again (its predecessor woke it as it stopped) and
waits for the release; one that finds vLLM asleep with no step running wakes it.

A vLLM that does not wake (``/wake_up`` fails, or ``/is_sleeping`` stays true) stops
serving honestly: held and new calls get a 503 with Retry-After at once, the error is
logged, ``tracetrain_vllm_not_awake`` is 1, ``/readyz`` fails, and ``on_stuck`` is called
(``tracetrain serve`` restarts its vLLM child). Waking is tried again every few seconds;
once it works (a restarted vLLM is awake) the adapters are loaded again and serving resumes.

The steps of every policy take turns on the one GPU: the coordinator serves the oldest open request,
whichever policy's job made it, one at a time (the trainer runs one step at a time anyway).

One proxy replica per vLLM: shared mode is for one box. Replicas sharing a vLLM would each
have to hold their calls, and they do not.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from proxy._periodic import every
from proxy.errors import ProxyError, UpstreamHTTPError
from proxy.gateway import Gate
from proxy.gateway.upstream import Upstream
from proxy.observability._metrics import Metrics
from proxy.training._publisher import Publisher
from store import GpuHandover, JobState, Store, TrainingState

log = logging.getLogger("tracetrain.handover")

_RETRY_MIN_S, _RETRY_MAX_S = 2.0, 60.0  # after a failed pause or sleep, doubling
# Failed hand-overs in a row before training stops (each closes the gate for its calls): 2 + 4 + 8 + 16 s apart.
_MAX_FAILED_TRIES = 5
_WAKE_RETRY_S = 5.0
# While calls are held, the release is looked for more often than new requests are: each poll of
# it is time serving stands still (one indexed read of one row).
_RELEASE_POLL_S = 0.05
_DEV_MODE_HINT = (
    " (vLLM serves /pause and /sleep only when started with VLLM_SERVER_DEV_MODE=1, and, on a GPU, "
    "--enable-sleep-mode: tracetrain serve --share-gpu starts it so)"
)


class HandoverCoordinator:
    """Serves the GPU requests of every policy's training jobs; ``run()`` until cancelled."""

    def __init__(
        self,
        store: Store,
        publisher: Publisher,
        replicas: Sequence[Upstream],
        gate: Gate,
        metrics: Metrics,
        *,
        timeout_s: float,
        poll_s: float = 0.2,
        on_stuck: Callable[[str], None] | None = None,
    ) -> None:
        self._store = store
        self._publisher = publisher
        self._replicas = list(replicas)
        self._gate = gate
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._poll_s = poll_s
        self._on_stuck = on_stuck
        self._retry_s = _RETRY_MIN_S
        self._retry_at = 0.0
        self._failed_tries = 0
        self.not_awake: str | None = None  # why serving stopped: a vLLM did not wake up
        self.gave_up: str | None = None  # why training stopped: vLLM would not pause or sleep
        self._paused: list[str] = []  # the policies whose training giving up paused

    async def run(self) -> None:
        try:
            await self._wake_what_was_left_asleep()
        except Exception:
            log.exception("looking for a vLLM left asleep failed")
        await every(self._poll_s, self.poll_once, log, "serving a GPU request failed; trying again")

    async def poll_once(self) -> None:
        """Serve the oldest open hand-over of any policy, if any (one at a time)."""
        if time.monotonic() < self._retry_at:
            return
        if self.gave_up is not None and not await self._still_given_up():
            return
        for job in await self._store.jobs.pending_gpu_requests():
            if job["state"] != JobState.RUNNING or self.gave_up is not None:  # finished, or training stopped
                await self._store.jobs.revoke_gpu(job["id"])
                continue
            await self._hand_over(job, adopted=job["gpu_state"] == GpuHandover.GRANTED)
            return

    async def _still_given_up(self) -> bool:
        """True while training stays paused after giving up; False (and ready to try again) once an admin
        resumed the training of a policy it paused."""
        states = [(await self._store.guards.training(policy))["training"] for policy in self._paused]
        if states and all(state == TrainingState.PAUSED for state in states):
            return True
        log.info("training was resumed: GPU requests are served again")
        self.gave_up, self._failed_tries, self._retry_s = None, 0, _RETRY_MIN_S
        return False

    async def _hand_over(self, job: dict[str, Any], *, adopted: bool) -> None:
        """Steps 2 to 4: hold calls, put vLLM to sleep, grant, wait for the release, wake, publish, resume."""
        job_id = int(job["id"])
        closed_at = time.monotonic()
        asleep_at: float | None = None
        outcome = "failed"
        async with self._publisher.held() as publish:
            try:
                await self._gate.close()  # returns once the calls already sent have their answer
                log.info("job %s %s the GPU: pausing vLLM (what runs finishes) and putting it to sleep", job_id,
                         "holds (granted by a proxy that stopped)" if adopted else "asks for")  # fmt: skip
                await self._each("pause", lambda u: u.pause("wait"))
                await self._each("sleep", lambda u: u.sleep(1, "wait"))
                asleep_at = time.monotonic()
                if not adopted:
                    if not await self._store.jobs.grant_gpu(job_id):
                        outcome = "withdrawn"
                        return
                    log.info("job %s: the GPU is the trainer's (%.2f s to pause and sleep)", job_id,
                             asleep_at - closed_at)  # fmt: skip
                outcome = await self._until_released(job)
                self._retry_s, self._failed_tries = _RETRY_MIN_S, 0
            except Exception as exc:
                await self._failed(job_id, exc.message if isinstance(exc, ProxyError) else repr(exc))
            finally:
                woke_at = await self._wake(publish)
                self._metrics.handovers.labels(outcome).inc()
                self._metrics.serving_held_seconds.observe(time.monotonic() - closed_at)
                if asleep_at is not None:
                    asleep_s = woke_at - asleep_at
                    self._metrics.handover_seconds.observe(asleep_s)
                    await self._store.jobs.record_gpu_asleep(job_id, asleep_s)
                    log.info("job %s: vLLM slept %.2f s and serves again (%s)", job_id, asleep_s, outcome)

    async def _failed(self, job_id: int, detail: str) -> None:
        """A hand-over that did not get vLLM to sleep: try again after a back-off, or give up after too many."""
        self._failed_tries += 1
        if self._failed_tries < _MAX_FAILED_TRIES:
            log.error("job %s: the GPU could not be handed over (%s); vLLM serves again, another try in %.0f s",
                      job_id, detail, self._retry_s)  # fmt: skip
            self._retry_at = time.monotonic() + self._retry_s
            self._retry_s = min(self._retry_s * 2, _RETRY_MAX_S)
            return
        self.gave_up = (
            f"the GPU could not be handed over to the trainer {self._failed_tries} times in a row (last: {detail}); "
            "vLLM serves on without training. Check that vLLM serves /pause and /sleep (VLLM_SERVER_DEV_MODE=1 and, "
            "on a GPU, --enable-sleep-mode), then resume training (dashboard, or POST /admin/training/resume)"
        )
        log.error("job %s: %s", job_id, self.gave_up)
        await self._store.jobs.revoke_gpu(job_id)
        self._paused = [row["name"] for row in await self._store.policies.serving()]
        for policy in self._paused:
            await self._store.guards.pause(policy, self.gave_up)

    async def _until_released(self, job: dict[str, Any]) -> str:
        """Wait for the worker's release; revoke when it is gone or took too long. Returns the outcome."""
        job_id, worker = int(job["id"]), job["worker"]
        deadline = time.monotonic() + self._timeout_s
        while True:
            row = await self._store.jobs.gpu_handover(job_id)
            if row is None or row["gpu_state"] in (GpuHandover.RELEASED, GpuHandover.REVOKED):
                if row is None or row["gpu_state"] == GpuHandover.REVOKED:
                    log.warning("job %s: the hand-over was revoked; the GPU goes back to vLLM", job_id)
                    return "revoked"
                return "released"
            if row["state"] != JobState.RUNNING or row["worker"] != worker:
                log.warning("job %s is no longer running on %s; the GPU goes back to vLLM", job_id, worker)
                await self._store.jobs.revoke_gpu(job_id)
            elif row["lease_expires_at"] is not None and row["lease_expires_at"] < time.time():
                # Its worker stopped renewing: queue the job again now (which revokes the hand-over).
                for expired, dead in await self._store.jobs.reclaim_expired():
                    log.warning("training job %d: its worker %s stopped renewing its lease; queued again", expired,
                                dead)  # fmt: skip
            elif time.monotonic() > deadline:
                log.error("job %s kept the GPU longer than %.0f s (--handover-timeout); the GPU goes back to vLLM",
                          job_id, self._timeout_s)  # fmt: skip
                await self._store.jobs.revoke_gpu(job_id)
            await asyncio.sleep(min(self._poll_s, _RELEASE_POLL_S))

    async def _wake(self, publish: Callable[[], Awaitable[None]]) -> float:
        """Wake every vLLM (until they are), publish what the step recorded, resume, open the gate.

        Returns when all were awake (monotonic). Never raises but for cancellation.
        """
        while problems := await self._wake_all():
            self._stuck("; ".join(problems))
            await asyncio.sleep(_WAKE_RETRY_S)
        woke_at = time.monotonic()
        if self.not_awake is not None:
            self._gate.hold()  # calls wait for the publish below instead of being refused
            log.warning("vLLM is awake again; serving resumes")
            self.not_awake = None
            self._metrics.vllm_not_awake.set(0)
        try:
            await publish()  # the new adapter is loaded and the alias flipped before any held call goes on
        except Exception:
            log.exception("publishing after the hand-over failed; the publisher tries again")
        await self._each("resume", lambda u: u.resume(), raise_=False)
        self._gate.open()
        return woke_at

    async def _wake_all(self) -> list[str]:
        problems = []
        for upstream in self._replicas:
            try:
                await upstream.wake_up()
                if await upstream.is_sleeping():
                    problems.append(f"{upstream.root_url} still sleeps after /wake_up")
            except ProxyError as exc:
                problems.append(f"{upstream.root_url}: /wake_up failed: {exc.message}")
        return problems

    def _stuck(self, problem: str) -> None:
        first = self.not_awake is None
        self.not_awake = problem
        self._metrics.vllm_not_awake.set(1)
        self._gate.fail(f"The model server did not wake up after a training step ({problem}); it is being "
                        "restarted. Try again shortly.")  # fmt: skip
        if first:
            log.error("vLLM did not wake up after a training step: %s; serving stops until it does", problem)
            if self._on_stuck is not None:
                self._on_stuck(problem)

    async def _each(self, what: str, call: Callable[[Upstream], Awaitable[Any]], *, raise_: bool = True) -> None:
        for upstream in self._replicas:
            try:
                await call(upstream)
            except ProxyError as exc:
                hint = _DEV_MODE_HINT if isinstance(exc, UpstreamHTTPError) and exc.status_code == 404 else ""
                message = f"/{what} on {upstream.root_url} failed: {exc.message}{hint}"
                if raise_:
                    raise ProxyError(message) from exc
                log.error("%s", message)

    async def _wake_what_was_left_asleep(self) -> None:
        """At start: a vLLM asleep or paused with no step running was left so by a proxy that stopped."""
        open_handovers = await self._store.jobs.pending_gpu_requests()
        if any(job["gpu_state"] == GpuHandover.GRANTED for job in open_handovers):
            return  # a step runs on the GPU: vLLM sleeps until its release (poll_once adopts it)
        for upstream in self._replicas:
            try:
                if await upstream.is_sleeping():
                    log.warning("%s was left asleep or paused (a proxy stopped mid-hand-over?); waking it",
                                upstream.root_url)  # fmt: skip
                    await upstream.wake_up()
                    await upstream.resume()
            except UpstreamHTTPError as exc:
                log.error("--share-gpu: %s does not answer /is_sleeping (%s)%s", upstream.root_url, exc.message,
                          _DEV_MODE_HINT)  # fmt: skip
            except ProxyError:
                pass  # not up yet: nothing was left asleep
