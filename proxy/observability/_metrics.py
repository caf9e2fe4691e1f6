"""``/metrics`` for Prometheus: what the proxy counts itself, and what the store says.

Request, latency, token, capture and reward counters are kept in this process (each
proxy replica reports its own; Prometheus sums them). Training and serving state
(jobs by state, the active version, ready groups) lives in the store, which every
replica shares: it is read when Prometheus scrapes, so replicas report the same values.
Use ``max`` or one replica's series for those, not ``sum``.

Each app has its own registry, so several apps in one process (tests) do not collide.
"""

from __future__ import annotations

import functools
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from store import JobState, Store

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_HANDOVER_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class Metrics:
    """The proxy's Prometheus metrics; ``call_recorded`` is called once per captured call."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "tracetrain_requests", "Generation calls answered, by endpoint and status.", ["endpoint", "status"],
            registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            "tracetrain_request_latency_seconds", "Time from request to the last byte, by endpoint.", ["endpoint"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "tracetrain_time_to_first_token_seconds", "Streams: time to the first event.", ["endpoint"],
            buckets=_TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokens = Counter("tracetrain_tokens", "Tokens through the proxy.", ["kind"], registry=r)
        self.captures = Counter("tracetrain_captured_calls", "Calls committed to the store.", registry=r)
        self.capture_failures = Counter(
            "tracetrain_capture_failures", "Calls the store could not record (answered 503).", registry=r
        )
        self.rewards = Counter("tracetrain_rewards", "Rewards recorded, by source.", ["source"], registry=r)
        self.jobs = Gauge("tracetrain_training_jobs", "Training jobs in the store, by state.", ["state"], registry=r)
        self.steps = Gauge(
            "tracetrain_training_steps", "Training steps that produced an adapter (store).", ["policy"], registry=r
        )
        self.version = Gauge(
            "tracetrain_policy_active_version", "The adapter version each policy serves (store).", ["policy"],
            registry=r,
        )  # fmt: skip
        self.loaded = Gauge("tracetrain_versions_loaded", "Versions this proxy has loaded in vLLM.", registry=r)
        # The GPU hand-over around each training step (--share-gpu; proxy.training._handover).
        self.handover_seconds = Histogram(
            "tracetrain_gpu_handover_seconds", "Time vLLM slept for each training step (sleep to wake-up).",
            buckets=_HANDOVER_BUCKETS, registry=r,
        )  # fmt: skip
        self.serving_held_seconds = Histogram(
            "tracetrain_serving_held_seconds",
            "Time calls were held for each hand-over (the gate closed to the gate open: pause, sleep, step, wake).",
            buckets=_HANDOVER_BUCKETS, registry=r,
        )  # fmt: skip
        self.handovers = Counter(
            "tracetrain_gpu_handovers", "Hand-overs of the GPU to the trainer, by outcome: released (the step "
            "ended), revoked (its worker died or it outlived --handover-timeout), failed (vLLM would not pause or "
            "sleep), withdrawn (the job stopped before the grant).", ["outcome"], registry=r,
        )  # fmt: skip
        self.requests_held = Counter(
            "tracetrain_requests_held", "Calls that waited at the gate while a training step had the GPU.", registry=r
        )
        self.requests_held_timeout = Counter(
            "tracetrain_requests_held_timeout", "Held calls answered 503 after --handover-wait.", registry=r
        )
        self.vllm_not_awake = Gauge(
            "tracetrain_vllm_not_awake", "1 while a vLLM did not wake up after a hand-over (serving stopped).",
            registry=r,
        )  # fmt: skip
        self.langfuse = Gauge(
            "tracetrain_langfuse_items", "Langfuse export (--langfuse): items by outcome, since start.", ["outcome"],
            registry=r,
        )  # fmt: skip

    def call_recorded(self, call: dict[str, Any]) -> None:
        endpoint = str(call["endpoint"])
        requests, latency, ttft = self._children(endpoint, int(call["status_code"]))
        requests.inc()
        latency.observe(float(call["latency_ms"]) / 1000)
        if call.get("ttft_ms") is not None:
            ttft.observe(float(call["ttft_ms"]) / 1000)
        self._prompt_tokens.inc(int(call["prompt_tokens"]))
        self._completion_tokens.inc(int(call["completion_tokens"]))
        self.captures.inc()

    @functools.cached_property
    def _prompt_tokens(self) -> Any:
        return self.tokens.labels("prompt")

    @functools.cached_property
    def _completion_tokens(self) -> Any:
        return self.tokens.labels("completion")

    @functools.lru_cache(maxsize=64)  # noqa: B019 (one Metrics per app, alive as long as it)
    def _children(self, endpoint: str, status: int) -> tuple[Any, Any, Any]:
        """The labelled series of one call, looked up once: ``labels()`` takes a lock and builds a key each time."""
        return self.requests.labels(endpoint, str(status)), self.latency.labels(endpoint), self.ttft.labels(endpoint)

    def call_not_recorded(self, call: dict[str, Any]) -> None:
        self.requests.labels(str(call["endpoint"]), "503").inc()
        self.capture_failures.inc()

    def rewards_recorded(self, sources: list[str]) -> None:
        for source in sources:
            self.rewards.labels(source).inc()

    async def render(self, store: Store, loaded_versions: int, langfuse: dict[str, int] | None = None) -> bytes:
        """The exposition text, with the store's figures (and the Langfuse exporter's counters) read now."""
        jobs = await store.jobs.counts()
        for state in JobState:
            self.jobs.labels(state.value).set(jobs.get(state.value, 0))
        for policy in await store.policies.all():
            self.steps.labels(policy["name"]).set(await store.adapters.count(policy["name"]))
            self.version.labels(policy["name"]).set(int(policy["active_version"]))
        self.loaded.set(loaded_versions)
        for outcome, count in (langfuse or {}).items():
            self.langfuse.labels(outcome).set(count)
        return generate_latest(self.registry)
