"""The proxy's settings: one frozen, validated object built at start-up.

Values come from command-line flags (passed as keyword arguments) over environment
variables prefixed ``TRACETRAIN_`` over the defaults below. Secrets are ``SecretStr``
so they never print; placeholder secrets are rejected when the object is built, and
so is a non-loopback bind address with no keys configured.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from proxy import _policy_config as bounds  # each per-policy setting's bounds, declared there once
from proxy import _setting_values as values
from proxy._otel_env import endpoint_from_env, traces_url
from proxy._policy_config import PolicyOverrides, PolicySettings, RewardWeights, SamplingDefaults, unconfigured_judge
from store import POLICY_NAME_PATTERN, redact

_PLACEHOLDER_SECRETS = frozenset(
    {"changeme", "change-me", "secret", "password", "token", "apikey", "api-key", "test", "xxx", "sk-xxx"}
)
_MIN_SECRET_LENGTH = 16
_URL_FIELDS = frozenset({"upstreams", "database_url", "judge_api_base", "langfuse_base_url"})

Secrets = Annotated[tuple[SecretStr, ...], NoDecode]


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and addresses in 127.0.0.0/8 or ``::1``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    """Everything the proxy needs to run. Build it once; pass it to ``create_app``."""

    model_config = SettingsConfigDict(env_prefix="TRACETRAIN_", frozen=True, extra="forbid", populate_by_name=True)

    # Where requests go: OpenAI-compatible base URLs ending in /v1 (vLLM servers in production). Calls of one
    # trajectory go to one server, chosen by hashing its id (the same on every replica listing the same URLs) with
    # a bound on load (proxy.gateway.upstream._placement); every server loads every adapter. `upstream=URL` is accepted
    # for one; env TRACETRAIN_UPSTREAMS (comma-separated) or TRACETRAIN_UPSTREAM.
    upstreams: Annotated[tuple[str, ...], NoDecode, AfterValidator(values.upstream_urls)] = Field(
        default=("http://127.0.0.1:8000/v1",),
        min_length=1,
        validation_alias=AliasChoices("tracetrain_upstreams", "tracetrain_upstream"),
    )
    # The upstream's name for the base model; discovered from GET /v1/models when unset.
    served_model: str | None = None
    upstream_timeout_s: float = Field(default=600.0, gt=0)
    # The reasoning parser the upstream vLLM runs (`serve --reasoning-parser`: qwen3, deepseek_r1, ...); None: none.
    # With one, a chat answer carries the model's thinking in `message.reasoning` (a stream in `delta.reasoning`)
    # and its content without it; the sampled token ids hold both, and train both. The Responses and Messages
    # APIs read this to answer with reasoning items and thinking blocks.
    reasoning_parser: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.\-]+$", max_length=100)
    # The served model reads images (`serve` reads it in the model's config.json; --reads-images for an
    # --upstream). Without it, an image an agent sends (Anthropic's image blocks, the Responses API's
    # input_image) reaches the model as a text placeholder, never as a failed call.
    reads_images: bool = False

    host: str = "127.0.0.1"
    port: int = Field(default=8100, ge=0, le=65535)
    data_dir: Path = Path(".tracetrain")
    # SQLAlchemy async URL; defaults to SQLite (WAL) in the data directory.
    database_url: str | None = None

    # The names agents use as `model`, one per policy (an agent's LoRA line on the base model); each one's versions
    # are `NAME@N` (`NAME@0` is the base model). `policy=NAME` is accepted for one; env TRACETRAIN_POLICIES
    # (comma-separated) or TRACETRAIN_POLICY. Policies added through the admin API are served as well: the store
    # holds them (docs/POLICIES.md).
    policies: Annotated[tuple[str, ...], NoDecode, AfterValidator(values.policy_names)] = Field(
        default=("agent",), min_length=1, validation_alias=AliasChoices("tracetrain_policies", "tracetrain_policy")
    )
    # The settings a policy overrides (`--policy-config NAME=FILE`; env TRACETRAIN_POLICY_CONFIGS as JSON, name to
    # settings): written into the store when the proxy starts, for every replica and the trainer to apply.
    policy_configs: dict[str, PolicyOverrides] = Field(default_factory=dict)
    # A derived group (same task prompt) takes at most this many trajectories, then a new one opens.
    group_size: int = Field(default=8, ge=1, le=bounds.MAX_GROUP)
    # A group is ready for training when all its trajectories are rewarded and it has this many.
    min_group_size: int = Field(default=2, ge=1, le=bounds.MAX_GROUP)
    # How long an unkeyed trajectory stays open for threading (seconds since its last call).
    thread_ttl_s: float = Field(default=1800.0, gt=0)

    # Training: a job is created when this many groups are ready; adapters beyond the newest
    # keep_versions are unloaded from vLLM, and the trainer prunes their files (retention, docs/OPERATIONS.md).
    batch_groups: int = Field(default=4, ge=1, le=bounds.MAX_GROUP)
    keep_versions: int = Field(default=3, ge=1, le=bounds.MAX_KEEP_VERSIONS)
    # A version that left the window stays loaded this long: other proxy replicas may still
    # have requests running on it.
    unload_grace_s: float = Field(default=30.0, ge=0)
    # How often each upstream's /health is asked; a server that fails it leaves the rotation.
    health_check_s: float = Field(default=2.0, gt=0)
    # How vLLM gets an adapter: "path" sends the directory the trainer wrote (vLLM sees that disk);
    # "resolver" asks vLLM for `policy@N` by name and its tracetrain resolver fetches the files from
    # GET /v1/adapters/... (a trainer on another machine); "auto": by path when the directory is here.
    adapter_delivery: Literal["auto", "path", "resolver"] = "auto"

    # Disk (proxy.observability._disk): a warning in the log and on /readyz while free space is under this
    # many MiB; trajectories whose last call is older than keep_trajectories_days are deleted (unset: kept).
    min_free_disk_mb: int = Field(default=1024, ge=0)
    keep_trajectories_days: float | None = Field(default=None, gt=0, allow_inf_nan=False)

    # One GPU for vLLM and the trainer (proxy.training._handover): around each training step new calls wait
    # in the proxy, vLLM finishes what runs, sleeps, the trainer steps, vLLM wakes with the new adapter.
    share_gpu: bool = False
    # A call held through a step longer than this is answered 503 with Retry-After.
    handover_wait_s: float = Field(default=300.0, gt=0)
    # A step that keeps the GPU longer than this loses it: vLLM is woken and serves again.
    handover_timeout_s: float = Field(default=1800.0, gt=0)

    # The regression guard (proxy.training._guard): each published version's group-mean rewards are compared
    # with those of the versions before it (one-sided Welch t-test); a version worse by more than
    # regression_margin (reward units) is rolled back and training pauses until an admin resumes it. It decides
    # within regression_groups rewarded groups; regression_alpha bounds the chance of rolling back a version
    # that is not worse. Defaults and their reasons: docs/TRAINING.md.
    regression_guard: bool = True
    regression_margin: float = Field(default=0.05, ge=0, le=bounds.MAX_MARGIN, allow_inf_nan=False)
    regression_alpha: float = Field(default=0.05, gt=0, lt=1)
    regression_groups: int = Field(default=8, ge=3, le=64)

    # Canary trials (proxy.training._canary): with `canary` (a share in (0, 1)) a newly published version serves
    # that share of new trajectories, the version before it the rest, until a paired test of their rewards within
    # groups promotes it or rolls it back (margin and alpha as the guard's), within canary_groups paired groups or
    # canary_minutes. Unset: a new version serves everything at once. Defaults and their reasons: docs/TRAINING.md.
    canary: float | None = Field(default=None, gt=0, lt=1)
    canary_margin: float = Field(default=0.05, ge=0, le=bounds.MAX_MARGIN, allow_inf_nan=False)
    canary_alpha: float = Field(default=0.05, gt=0, lt=1)
    canary_groups: int = Field(default=8, ge=3, le=256)
    canary_minutes: float = Field(default=30.0, gt=0, le=bounds.MAX_MINUTES, allow_inf_nan=False)

    # A complete group (min_group_size trajectories or more) still missing rewards after this many seconds
    # with no call and no reward is judged when a judge is configured (judge_model, or a reward_source that
    # judges), else closed "unrewarded": never trained, counted (proxy.judge._timeout). Unset: groups
    # wait for their rewards as long as it takes.
    reward_timeout_s: float | None = Field(default=None, gt=0, le=bounds.MAX_SECONDS, allow_inf_nan=False)

    # Rewards: POSTed by the user's service ("external"), scored by an LLM judge over each group
    # ("judge"), or both: external rewards train, the judge's scores are recorded beside them; or scored by
    # people only ("human": the dashboard's review queue, POST /admin/trajectories/{id}/feedback). A person's
    # score is the trajectory's reward whatever the source: it overrides a service's or the judge's.
    reward_source: Literal["external", "judge", "both", "human"] = "external"
    # A reward's components and their weights (`--reward-weights correct=1,format=0.2`): a reward posted with
    # metrics and no reward is the weighted sum of those metrics; each component's mean is a step metric.
    reward_weights: Annotated[RewardWeights | None, NoDecode] = None
    # How a call's reward (POST /v1/rewards with a call_id) reaches the calls before it: discounted by this per
    # call (the trainer's --turn-discount; tracetrain_core.call_returns). The trajectory's reward counts fully.
    turn_discount: float = Field(default=1.0, ge=0, le=1, allow_inf_nan=False)
    # A litellm model name: openai/gpt-4o-mini, anthropic/claude-..., hosted_vllm/NAME. Unset: the
    # base model served by `upstream`, with no external key (see proxy.judge._service).
    judge_model: str | None = None
    # Where judge_model is served, when not at its provider's usual URL (an OpenAI-compatible gateway).
    judge_api_base: str | None = Field(default=None, pattern=r"^https?://", max_length=2000)
    # Further judges a policy may choose as its judge_model (--policy-config, the admin API), beside judge_model:
    # each `MODEL` (its provider's usual URL and key variable) or `MODEL=BASE_URL` (`--judge`, repeatable; env
    # TRACETRAIN_JUDGES, comma-separated). Where a judge is served, and with which key, is only ever the operator's
    # to say: the admin API names one of these models, never a URL (docs/OPERATIONS.md, "The judge").
    judges: Annotated[tuple[tuple[str, str | None], ...], NoDecode, AfterValidator(values.judge_urls)] = ()
    # What makes a trajectory better than another; "@path" reads a file. Unset: a generic rubric.
    judge_rubric: str | None = None
    # A group is judged once it has group_size trajectories and none changed for judge_quiet_s,
    # or once it has min_group_size and none changed for judge_idle_s.
    judge_quiet_s: float = Field(default=10.0, gt=0, le=bounds.MAX_SECONDS, allow_inf_nan=False)
    judge_idle_s: float = Field(default=300.0, gt=0, le=bounds.MAX_SECONDS, allow_inf_nan=False)
    judge_max_attempts: int = Field(default=3, ge=1, le=10)
    judge_concurrency: int = Field(default=2, ge=1)

    # The front door (docs/OPERATIONS.md): a body longer than max_body_mb (10^6 bytes) is refused (413) before it
    # is read; a derived group's seat whose call was never recorded (its process died) is given back after
    # seat_timeout_s; /metrics, /docs, /redoc and /openapi.json need the admin token (or a reward key) when
    # protect_metrics_and_docs. The server's own limits (connections, header and body timeouts) are
    # tracetrain serve's (tracetrain_cli._http_server).
    max_body_mb: float = Field(default=32.0, gt=0, allow_inf_nan=False)
    seat_timeout_s: float = Field(default=900.0, gt=0, allow_inf_nan=False)
    protect_metrics_and_docs: bool = False
    max_connections: int = Field(default=1024, ge=1)
    header_timeout_s: float = Field(default=15.0, gt=0, allow_inf_nan=False)
    body_timeout_s: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    # The reverse proxies (addresses or networks) whose X-Forwarded-For / -Proto name the client: the log-in
    # throttle counts per client address (proxy._throttle). Empty: the connection's peer is the client, whatever
    # a header says (uvicorn alone would believe any loopback sender). `--forwarded-allow-ips`, comma-separated.
    forwarded_allow_ips: Annotated[tuple[str, ...], NoDecode, AfterValidator(values.proxy_addresses)] = ()

    # Credentials. Inference keys authorize /v1 generation calls, reward keys /v1/rewards; both for every policy.
    api_keys: Secrets = ()
    reward_keys: Secrets = ()
    # Keys bound to a policy (`--policy-key NAME=KEY`, repeatable; env TRACETRAIN_POLICY_KEYS="NAME=KEY,..."): such
    # a key calls that policy's model, reads its trajectories and groups and posts its rewards, and nothing else
    # (proxy._policy_keys). A key named for several policies reaches each of them.
    policy_keys: Annotated[tuple[tuple[str, SecretStr], ...], NoDecode] = ()
    admin_token: SecretStr | None = None
    # Keys that may only read adapter files (GET /v1/adapters/...): what vLLM's resolver sends
    # (TRACETRAIN_ADAPTERS_KEY there). The admin token reads them too; without adapter keys it alone does.
    adapter_keys: Secrets = ()

    # Export trajectories, calls and rewards to Langfuse (proxy.observability._langfuse). The keys and the URL are
    # read from Langfuse's usual variables: LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY, LANGFUSE_BASE_URL
    # (or LANGFUSE_HOST).
    langfuse: bool = False
    langfuse_public_key: str | None = Field(default=None, validation_alias="langfuse_public_key")
    langfuse_secret_key: SecretStr | None = Field(default=None, validation_alias="langfuse_secret_key")
    langfuse_base_url: str = Field(
        default="https://cloud.langfuse.com", validation_alias=AliasChoices("langfuse_base_url", "langfuse_host")
    )
    # Export each call as an OpenTelemetry span (the GenAI semantic conventions) over OTLP/HTTP
    # (proxy.observability._otlp): a collector's address (http://collector:4318; /v1/traces is appended) or its
    # full traces URL. Unset: the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT,
    # unless OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER names no otlp.
    otlp_endpoint: str | None = None
    # Prompts and replies in those spans (gen_ai.input.messages, gen_ai.output.messages): opt-in, as the conventions
    # make them; also OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true. Langfuse always gets them.
    otlp_content: bool = Field(
        default=False,
        validation_alias=AliasChoices(
            "otlp_content", "tracetrain_otlp_content", "otel_instrumentation_genai_capture_message_content"
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _one_list_each(cls, data: object) -> object:
        """``upstream=`` (one URL, as before), ``upstreams=`` and the two variables become ``upstreams``;
        ``policy=`` (one name, as before), ``policies=`` and theirs become ``policies``.

        Keyword arguments come first, so flags win over the environment.
        """
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for field, names in (
            ("upstreams", ("upstreams", "upstream", "tracetrain_upstreams", "tracetrain_upstream")),
            ("policies", ("policies", "policy", "tracetrain_policies", "tracetrain_policy")),
        ):
            given = [data.pop(k) for k in names if k in data]
            if given:
                data[field] = given[0]
        return data

    @model_validator(mode="before")
    @classmethod
    def _otlp_from_otel_variables(cls, data: object) -> object:
        """No endpoint named: OpenTelemetry's standard variables name it (``proxy._otel_env``)."""
        if not isinstance(data, dict) or data.get("otlp_endpoint") or os.environ.get("TRACETRAIN_OTLP_ENDPOINT"):
            return data
        url = endpoint_from_env()
        return {**data, "otlp_endpoint": url} if url else data

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp_traces_url(cls, value: str | None) -> str | None:
        return traces_url(value)

    @field_validator("api_keys", "reward_keys", "adapter_keys", "upstreams", "policies", "forwarded_allow_ips",
                     mode="before")  # fmt: skip
    @classmethod
    def _split_keys(cls, value: object) -> object:
        return values.items(value)

    @field_validator("policy_keys", mode="before")
    @classmethod
    def _policy_key_pairs(cls, value: object) -> object:
        return values.pairs(value, values.policy_key_pair)

    @field_validator("judges", mode="before")
    @classmethod
    def _judge_pairs(cls, value: object) -> object:
        return values.pairs(value, values.judge_pair)

    @field_validator("policy_keys")
    @classmethod
    def _policy_key_names(cls, keys: tuple[tuple[str, SecretStr], ...]) -> tuple[tuple[str, SecretStr], ...]:
        for name, _ in keys:
            if not re.fullmatch(POLICY_NAME_PATTERN, name):
                raise ValueError(f"--policy-key {name}=...: {name!r} is not a policy name")
        return keys

    @field_validator("judge_rubric")
    @classmethod
    def _rubric_from_file(cls, value: str | None) -> str | None:
        if value is None or not value.startswith("@"):
            return value
        path = Path(value[1:]).expanduser()
        try:
            text = path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"cannot read the judge rubric from {path}: {exc.strerror}") from None
        if not text:
            raise ValueError(f"the judge rubric file {path} is empty")
        return text

    def __repr_args__(self) -> Any:
        """URLs shown without their passwords (``store.redact``); secrets are ``SecretStr`` already."""
        for name, value in super().__repr_args__():
            if name in _URL_FIELDS and value is not None:
                value = tuple(map(redact, value)) if isinstance(value, tuple) else redact(str(value))
            elif name == "judges":
                value = tuple((model, url and redact(url)) for model, url in value)
            yield name, value

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1_000_000)

    @property
    def upstream(self) -> str:
        """The first upstream: where the judge's default model is asked (any server serves the base model)."""
        return self.upstreams[0]

    @model_validator(mode="after")
    def _check_secrets(self) -> Settings:
        secrets = [
            *self.api_keys,
            *self.reward_keys,
            *self.adapter_keys,
            *(key for _, key in self.policy_keys),
            *([self.admin_token] if self.admin_token else []),
        ]
        for secret in secrets:
            raw = secret.get_secret_value()
            if raw.lower() in _PLACEHOLDER_SECRETS or len(raw) < _MIN_SECRET_LENGTH:
                raise ValueError(
                    f"a configured key looks like a placeholder (shorter than {_MIN_SECRET_LENGTH} characters "
                    "or a well-known dummy value); generate one with: "
                    "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
                )
        if not is_loopback(self.host) and not (self.api_keys or self.policy_keys):
            raise ValueError(
                f"refusing to listen on {self.host} with no inference keys: anyone on the network could use "
                "the model and write trajectories. Set TRACETRAIN_API_KEYS (and TRACETRAIN_REWARD_KEYS, "
                "TRACETRAIN_ADMIN_TOKEN), or bind to 127.0.0.1."
            )
        unnamed = [name for name in self.policy_configs if name not in self.policies]
        if unnamed:
            raise ValueError(f"settings are given for {', '.join(unnamed)}, which --policy does not name")
        for name, overrides in self.policy_configs.items():
            if problem := unconfigured_judge(overrides.judge_model, self.judge_endpoints):
                raise ValueError(f"--policy-config {name}: {problem}")
        return self

    @model_validator(mode="after")
    def _check_langfuse(self) -> Settings:
        if self.langfuse and not (self.langfuse_public_key and self.langfuse_secret_key):
            raise ValueError(
                "--langfuse needs the project's keys: set LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY "
                "(and LANGFUSE_BASE_URL unless the project is on https://cloud.langfuse.com)"
            )
        if self.langfuse and not self.langfuse_base_url.startswith(("http://", "https://")):
            raise ValueError(f"LANGFUSE_BASE_URL must be an http(s) URL, got {redact(self.langfuse_base_url)!r}")
        return self

    @property
    def policy_defaults(self) -> PolicySettings:
        """Every policy's settings where it overrides none (``proxy._policy_config``): the server's."""
        fields = PolicySettings.__dataclass_fields__
        return PolicySettings(**{name: getattr(self, name) for name in fields if name not in ("name", "sampling")},
                              name="", sampling=SamplingDefaults())  # fmt: skip

    @property
    def policy(self) -> str:
        """The first policy named: what a single-policy set-up calls *the* policy."""
        return self.policies[0]

    @property
    def judge_endpoints(self) -> dict[str, str | None]:
        """The judges a policy may choose, model to base URL (None: its provider's usual one): ``judges`` and
        ``judge_model`` at ``judge_api_base``. The default judge (no judge_model) is the base model upstream."""
        endpoints = dict(self.judges)
        if self.judge_model is not None:
            endpoints[self.judge_model] = self.judge_api_base
        return endpoints

    @property
    def judge_configured(self) -> bool:
        """A judge can score a group: one was named, or rewards come from (or beside) the judge."""
        return self.judge_model is not None or self.reward_source in ("judge", "both")

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{(self.data_dir / 'tracetrain.db').resolve()}"
