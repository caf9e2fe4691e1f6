"""``/metrics`` for Prometheus: what the proxy counts itself, and what the store says.

Request, latency, token, capture and reward counters are kept in this process (each
proxy replica reports its own; Prometheus sums them). Training and serving state
(jobs by state, the active version, ready groups) lives in the store, which every
replica shares: it is read when Prometheus scrapes, so replicas report the same values.
Use ``max`` or one replica's series for those, not ``sum``.

Series about one policy carry a ``policy`` label (calls, tokens, captures, rewards, jobs, versions);
serving's own (latency, the upstreams, the GPU hand-over) do not.

Each app has its own registry, so several apps in one process (tests) do not collide.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from store import JobState, Store, TrainingState, TrialState

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# The newest step's metrics /metrics shows (a fixed set: the series do not grow with the steps).
COMPONENT_PREFIX = "reward_component_"  # a step's reward component means (trainer._batch.component_means)
LAST_STEP_METRICS = (
    "logprob_mismatch_mean", "logprob_mismatch_max", "logprob_mismatch_on_policy", "sampler_weight_mean",
    "calls_per_trajectory", "samples_per_trajectory", "samples_merged_retokenized", "samples_split_rerendered",
    "samples_split_not_extended", "trained_tokens", "trained_token_share", "forwarded_tokens",
    "forwarded_per_sampled_token", "constrained_tokens", "logprob_mismatch_constrained",
    "logprob_mismatch_unconstrained", "grammar_fallbacks", "mask_ms", "run_log_failing",
)  # fmt: skip
_HANDOVER_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class Metrics:
    """The proxy's Prometheus metrics; ``call_recorded`` is called once per captured call."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        for define in (self._calls, self._disk, self._training, self._handover, self._upstreams, self._guards,
                       self._canary, self._memory):  # fmt: skip
            define(self.registry)

    def _calls(self, r: CollectorRegistry) -> None:
        """Generation calls and their capture, counted by this process."""
        self.requests = Counter(
            "tracetrain_requests", "Generation calls answered, by policy, endpoint and status.",
            ["policy", "endpoint", "status"], registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            "tracetrain_request_latency_seconds", "Time from request to the last byte, by endpoint.", ["endpoint"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "tracetrain_time_to_first_token_seconds", "Streams: time to the first event.", ["endpoint"],
            buckets=_TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokens = Counter("tracetrain_tokens", "Tokens through the proxy, by policy.", ["policy", "kind"],
                              registry=r)  # fmt: skip
        self.captures = Counter("tracetrain_captured_calls", "Calls committed to the store, by policy.", ["policy"],
                                registry=r)  # fmt: skip
        self.capture_failures = Counter(
            "tracetrain_capture_failures", "Calls the store could not record, by reason: store_unavailable (answered "
            "503), refused (a record that can never be written, answered 400), disk_full (answered, not recorded: "
            "capture resumes once space is freed).", ["reason"], registry=r,
        )  # fmt: skip
        self.failed_captures = {
            "store_unavailable": 0,
            "refused": 0,
            "disk_full": 0,
        }  # the counter's values, for the dashboard
        self.rewards = Counter("tracetrain_rewards", "Rewards recorded, by policy and source.", ["policy", "source"],
                               registry=r)  # fmt: skip
        self.refusals = Counter(
            "tracetrain_refused_requests", "Requests refused at the front door (proxy.api._door), by reason: "
            "body_too_large (413), cross_site and foreign_host (403, with no keys configured).", ["reason"], registry=r,
        )  # fmt: skip
        self.broken_streams = Counter(
            "tracetrain_broken_streams", "Streams vLLM broke, recorded as failed calls, by endpoint and reason: "
            "upstream_error (vLLM's error event: an engine failure), upstream_closed (the connection dropped).",
            ["endpoint", "reason"], registry=r,
        )  # fmt: skip

    def _disk(self, r: CollectorRegistry) -> None:
        """Disk usage (proxy.observability._disk), measured every minute in the background."""
        self.disk_bytes = Gauge(
            "tracetrain_disk_bytes", "Bytes on disk by part: calls, adapter_files (the store's tables), database "
            "(the whole store), adapters (DATA_DIR/adapters), logs (DATA_DIR/logs).", ["part"], registry=r,
        )  # fmt: skip
        self.disk_free = Gauge("tracetrain_disk_free_bytes", "Free bytes on the data directory's filesystem.",
                               registry=r)  # fmt: skip
        self.disk_low = Gauge("tracetrain_disk_low", "1 while free space is under --min-free-disk.", registry=r)

    def _training(self, r: CollectorRegistry) -> None:
        """Training as the store records it, read at each scrape."""
        self.jobs = Gauge("tracetrain_training_jobs", "Training jobs in the store, by policy and state.",
                          ["policy", "state"], registry=r)  # fmt: skip
        self.steps = Gauge(
            "tracetrain_training_steps", "Training steps that produced an adapter (store).", ["policy"], registry=r
        )
        self.version = Gauge(
            "tracetrain_policy_active_version", "The adapter version each policy serves (store).", ["policy"],
            registry=r,
        )  # fmt: skip
        self.last_step = Gauge(
            "tracetrain_training_last_step", "The newest training step's metrics (store), by name: "
            "logprob_mismatch_mean and _max (|learner - sampler| nats per sampled token), logprob_mismatch_on_policy "
            "(over the tokens its own version sampled), sampler_weight_mean, calls_per_trajectory, "
            "samples_per_trajectory, samples_merged_retokenized (calls merged across a turn re-rendered in other "
            "token ids), samples_split_rerendered, samples_split_not_extended, trained_tokens, "
            "trained_token_share, forwarded_tokens (what the step's rows forwarded, each shared prefix once), "
            "forwarded_per_sampled_token; structured outputs: constrained_tokens (sampled under a grammar), "
            "logprob_mismatch_constrained and _unconstrained (the on-policy gap of those tokens and of the others), "
            "grammar_fallbacks (constrained calls whose grammar could not be rebuilt, scored unmasked) and mask_ms "
            "(building the masks); run_log_failing (1 while a --log-to backend takes no metrics: the step's Error "
            "on the dashboard says why).", ["policy", "metric"], registry=r,
        )  # fmt: skip
        self.components = Gauge(
            "tracetrain_training_reward_component_mean", "The newest training step's mean of each reward component "
            "(the metrics posted with the rewards; --reward-weights weighs them into the reward), by policy.",
            ["policy", "component"], registry=r,
        )  # fmt: skip
        self.loaded = Gauge("tracetrain_versions_loaded", "Versions this proxy has loaded in vLLM, by policy.",
                            ["policy"], registry=r)  # fmt: skip

    def _handover(self, r: CollectorRegistry) -> None:
        """The GPU hand-over around each training step (--share-gpu; proxy.training._handover)."""
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

    def _upstreams(self, r: CollectorRegistry) -> None:
        """Each vLLM server behind this proxy (proxy.gateway.upstream._router), named by its base URL."""
        self.upstream_up = Gauge(
            "tracetrain_upstream_up", "1 while the vLLM server is in rotation (healthy, holding every published "
            "adapter), else 0.", ["upstream"], registry=r,
        )  # fmt: skip
        self.upstream_state = Gauge(
            "tracetrain_upstream_state", "1 for the vLLM server's state: serving, down, restoring (loading its "
            "adapters before it takes traffic), refused (vLLM data parallel).", ["upstream", "state"], registry=r,
        )  # fmt: skip
        self.upstream_in_flight = Gauge(
            "tracetrain_upstream_requests_in_flight", "Calls this proxy has running on the vLLM server.", ["upstream"],
            registry=r,
        )  # fmt: skip
        self.upstream_versions = Gauge(
            "tracetrain_upstream_version_loaded", "1 for each adapter version (of each policy) loaded into the vLLM "
            "server.", ["upstream", "policy", "version"], registry=r,
        )  # fmt: skip
        self.upstream_failovers = Gauge(
            "tracetrain_upstream_failovers", "Calls sent to another server because this one refused the connection.",
            ["upstream"], registry=r,
        )  # fmt: skip

    def _guards(self, r: CollectorRegistry) -> None:
        """Never silently worse: the regression guard (proxy.training._guard) and --reward-timeout."""
        self.rollbacks = Counter(
            "tracetrain_regression_rollbacks", "Versions this proxy rolled back: they served worse rewards than the "
            "versions before them.", ["policy"], registry=r,
        )  # fmt: skip
        self.paused = Gauge(
            "tracetrain_training_paused", "1 while the policy's training is paused by the regression guard (store); "
            "the reason is a label. An admin resumes it.", ["policy", "reason"], registry=r,
        )  # fmt: skip
        self.rolled_back = Gauge(
            "tracetrain_versions_rolled_back", "Versions the regression guard rolled back (store).", ["policy"],
            registry=r,
        )  # fmt: skip
        self.unrewarded = Gauge(
            "tracetrain_groups_unrewarded", "Groups closed by --reward-timeout with rewards missing: never trained "
            "(store).", ["policy"], registry=r,
        )  # fmt: skip
        self.reward_timeouts = Counter(
            "tracetrain_reward_timeouts", "Groups past --reward-timeout, by policy and outcome: judged (the judge's "
            "scores are their rewards) or unrewarded (closed, never trained).", ["policy", "outcome"], registry=r,
        )  # fmt: skip

    def _canary(self, r: CollectorRegistry) -> None:
        """Canary trials (--canary; proxy.training._canary): the running trial, read from the store at each scrape."""
        self.canary_verdicts = Counter(
            "tracetrain_canary_verdicts", "Canary trials this proxy ended, by verdict (promoted, rolled_back) and "
            "what decided it: test (the paired test), bound (its size or time), admin, alias (the alias moved off "
            "its baseline), config (--canary off).", ["policy", "verdict", "by"], registry=r,
        )  # fmt: skip
        self.canary_trials = Gauge(
            "tracetrain_canary_trials", "Canary trials in the store, by state.", ["policy", "state"], registry=r
        )
        self.canary_candidate = Gauge(
            "tracetrain_canary_candidate_version", "The version on canary trial (store); absent while none runs.",
            ["policy"], registry=r,
        )  # fmt: skip
        self.canary_share = Gauge(
            "tracetrain_canary_share", "The running trial's share of its new trajectories served by each arm "
            "(candidate, baseline), at its last look.", ["policy", "arm"], registry=r,
        )  # fmt: skip
        self.canary_reward = Gauge(
            "tracetrain_canary_reward_mean", "The running trial's mean reward of each arm's rewarded trajectories, "
            "with its 95% interval (bound: mean, low, high).", ["policy", "arm", "bound"], registry=r,
        )  # fmt: skip
        self.canary_groups = Gauge(
            "tracetrain_canary_paired_groups", "Complete groups of the running trial holding both versions: the "
            "paired test's evidence.", ["policy"], registry=r,
        )  # fmt: skip
        self.canary_difference = Gauge(
            "tracetrain_canary_difference", "The running trial's mean paired difference of rewards (candidate - "
            "baseline) with its 95% interval (bound: mean, low, high).", ["policy", "bound"], registry=r,
        )  # fmt: skip

    def _memory(self, r: CollectorRegistry) -> None:
        """The trace export, and what this process holds in memory."""
        self.exported = Gauge(
            "tracetrain_export_items", "Trace export (--otlp-endpoint, --langfuse): spans (scores for "
            "langfuse_scores) by receiver and outcome, since start; queued and queued_bytes: waiting now (bounded).",
            ["receiver", "outcome"], registry=r,
        )  # fmt: skip
        self.compact_held = Gauge(
            "tracetrain_compact_capture_held", "Compact capture's memory in this process (store._compact, bounded): "
            "trajectories whose last call is held, the token ids held with them, and bytes: the ids' and the "
            "messages' (as JSON) together, the figure its bound is on.", ["what"], registry=r,
        )  # fmt: skip

    def call_recorded(self, call: dict[str, Any]) -> None:
        self._answered(call)
        self._captures(str(call["policy"])).inc()

    def _answered(self, call: dict[str, Any]) -> None:
        policy = str(call["policy"])
        requests, latency, ttft = self._children(policy, str(call["endpoint"]), int(call["status_code"]))
        requests.inc()
        latency.observe(float(call["latency_ms"]) / 1000)
        if call.get("ttft_ms") is not None:
            ttft.observe(float(call["ttft_ms"]) / 1000)
        prompt, completion = self._tokens(policy)
        prompt.inc(int(call["prompt_tokens"]))
        completion.inc(int(call["completion_tokens"]))

    # The labelled series of one call, each looked up once: ``labels()`` takes a lock and builds a key each time.

    @functools.lru_cache(maxsize=256)  # noqa: B019 (one Metrics per app, alive as long as it)
    def _tokens(self, policy: str) -> tuple[Any, Any]:
        return self.tokens.labels(policy, "prompt"), self.tokens.labels(policy, "completion")

    @functools.lru_cache(maxsize=256)  # noqa: B019
    def _captures(self, policy: str) -> Any:
        return self.captures.labels(policy)

    @functools.lru_cache(maxsize=256)  # noqa: B019
    def _children(self, policy: str, endpoint: str, status: int) -> tuple[Any, Any, Any]:
        requests = self.requests.labels(policy, endpoint, str(status))
        return requests, self.latency.labels(endpoint), self.ttft.labels(endpoint)

    def call_not_recorded(self, call: dict[str, Any], *, refused: bool = False) -> None:
        """A call not answered because its record was not written: the store failed (503), or refused the record
        as it is (400, ``store.RecordRefused``)."""
        reason = "refused" if refused else "store_unavailable"
        self.requests.labels(str(call["policy"]), str(call["endpoint"]), "400" if refused else "503").inc()
        self.capture_failures.labels(reason).inc()
        self.failed_captures[reason] += 1

    def call_unrecorded(self, call: dict[str, Any]) -> None:
        """A call answered that the store could not record: its disk is full."""
        self._answered(call)
        self.capture_failures.labels("disk_full").inc()
        self.failed_captures["disk_full"] += 1

    def refused(self, reason: str) -> None:
        self.refusals.labels(reason).inc()

    def stream_broken(self, endpoint: str, reason: str) -> None:
        self.broken_streams.labels(endpoint, reason).inc()

    def rewards_recorded(self, rewards: list[tuple[str, str]]) -> None:
        """Rewards written, each as (policy, source)."""
        for policy, source in rewards:
            self.rewards.labels(policy, source).inc()

    async def render(
        self,
        store: Store,
        loaded_versions: Mapping[str, int],
        exported: Mapping[str, Mapping[str, int]] | None = None,
        upstreams: Sequence[dict[str, Any]] = (),
        upstream_states: Sequence[str] = (),
    ) -> bytes:
        """The exposition text, with the store's figures (and the trace exporters' counters) read now.

        ``loaded_versions``: policy -> the versions this proxy has loaded; ``upstreams``: each vLLM server as
        ``Router.views()`` describes it; ``upstream_states``: every state a server can be in
        (``proxy.gateway.UPSTREAM_STATES``), a series each.
        """
        policies = await store.policies.all()  # retired ones too: their data stays, and so do their series
        jobs = await store.jobs.counts_by_policy()
        self.components.clear()  # a component the newest step lacks is not shown with an older step's mean
        for name in sorted({str(p["name"]) for p in policies} | {policy for policy, _ in jobs}):
            for state in JobState:
                self.jobs.labels(name, state.value).set(jobs.get((name, state.value), 0))
            if (step := await store.jobs.last(JobState.SUCCEEDED, name)) is not None:
                self._set_last_step(step)
        self.paused.clear()
        for policy in policies:
            name = str(policy["name"])
            self.steps.labels(name).set(await store.adapters.count(name))
            self.version.labels(name).set(int(policy["active_version"]))
            self.rolled_back.labels(name).set(len(await store.guards.rolled_back_versions(name)))
            self.unrewarded.labels(name).set(await store.reward_timeouts.unrewarded(name))
            paused = policy.get("training") == TrainingState.PAUSED
            reason = str(policy.get("training_reason") or "") if paused else ""
            self.paused.labels(name, reason).set(1 if paused else 0)
        await self._set_canary(store)
        self.loaded.clear()  # a retired policy's versions were unloaded
        for name, count in loaded_versions.items():
            self.loaded.labels(name).set(count)
        for what, held in store.compact_memory().items():
            self.compact_held.labels(what).set(held)
        for receiver, counts in (exported or {}).items():
            for outcome, count in counts.items():
                self.exported.labels(receiver, outcome).set(count)
        self._set_upstreams(upstreams, upstream_states)
        return generate_latest(self.registry)

    async def _set_canary(self, store: Store) -> None:
        for series in (self.canary_candidate, self.canary_share, self.canary_reward, self.canary_groups,
                       self.canary_difference):  # fmt: skip
            series.clear()  # a trial that ended since the last scrape disappears
        for policy in [str(p["name"]) for p in await store.policies.all()]:
            counts = await store.trials.counts(policy)
            for state in TrialState:
                self.canary_trials.labels(policy, state.value).set(counts.get(state.value, 0))
            trial = await store.trials.running(policy)
            if trial is None:
                continue
            self.canary_candidate.labels(policy).set(trial["candidate"])
            record = trial["verdict"] or {}
            for arm in ("candidate", "baseline"):
                if (share := (record.get("shares") or {}).get(arm)) is not None:
                    self.canary_share.labels(policy, arm).set(share)
                _set_interval(self.canary_reward, (policy, arm), (record.get(arm) or {}).get("mean"),
                              (record.get(arm) or {}).get("interval"))  # fmt: skip
            look = record.get("look") or {}
            self.canary_groups.labels(policy).set(look.get("n") or 0)
            _set_interval(self.canary_difference, (policy,), look.get("difference"), look.get("interval"))

    def _set_last_step(self, job: dict[str, Any]) -> None:
        for name in LAST_STEP_METRICS:
            value = job["metrics"].get(name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.last_step.labels(str(job["policy"]), name).set(value)
        for name, value in job["metrics"].items():
            if name.startswith(COMPONENT_PREFIX) and isinstance(value, int | float) and not isinstance(value, bool):
                self.components.labels(str(job["policy"]), name.removeprefix(COMPONENT_PREFIX)).set(value)

    def _set_upstreams(self, upstreams: Sequence[dict[str, Any]], states: Sequence[str]) -> None:
        self.upstream_versions.clear()  # versions unloaded since the last scrape disappear
        for server in upstreams:
            url = str(server["url"])
            self.upstream_up.labels(url).set(1 if server["state"] == "serving" else 0)
            for state in states:
                self.upstream_state.labels(url, state).set(1 if server["state"] == state else 0)
            self.upstream_in_flight.labels(url).set(server["in_flight"])
            self.upstream_failovers.labels(url).set(server["failovers"])
            for adapter in server["versions"]:
                policy, _, version = str(adapter).rpartition("@")
                self.upstream_versions.labels(url, policy, version).set(1)


def _set_interval(gauge: Gauge, labels: tuple[str, ...], mean: float | None, interval: Sequence[float] | None) -> None:
    """A mean and its interval as three series of ``gauge`` (bound: mean, low, high), those known."""
    for bound, value in (("mean", mean), *zip(("low", "high"), interval or (), strict=False)):
        if value is not None:
            gauge.labels(*labels, bound).set(value)
