"""The proxy's settings: one frozen, validated object built at start-up, each setting declared once below.

``tracetrain serve`` builds it from its flags over ``TRACETRAIN_<FLAG>`` over ``--config`` over the defaults
below (``tracetrain_cli._config``); built directly, keyword arguments win over ``TRACETRAIN_<FIELD>``.
Secrets are ``SecretStr`` so they never print; placeholder secrets are rejected when the object is built, and
so is a non-loopback bind address with no keys configured.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AliasChoices, BeforeValidator, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from proxy import _setting_values as values
from proxy._access_fields import AccessFields
from proxy._declare import (
    ADDRESS,
    GPUS,
    POLICIES,
    RETENTION,
    REWARDS,
    SERVED,
    STORAGE,
    VLLM,
    flag,
)
from proxy._export_fields import ExportFields
from proxy._policy_config import (
    PolicyFields,
    PolicyOverrides,
    PolicySettings,
    SamplingDefaults,
    read_rubric,
    unconfigured_judge,
)
from store import POLICY_NAME_PATTERN, redact

_PLACEHOLDER_SECRETS = frozenset(
    {"changeme", "change-me", "secret", "password", "token", "apikey", "api-key", "test", "xxx", "sk-xxx"}
)
_MIN_SECRET_LENGTH = 16
_URL_FIELDS = frozenset({"upstreams", "database_url", "judge_api_base", "langfuse_base_url"})


def _policy_files(value: object) -> object:
    """``--policy-config NAME=FILE`` items (flags, a comma-separated variable) as each policy's overrides, read from
    its file; a mapping (a --config file's [policies.NAME] tables, JSON) as it is."""
    value = values.items(value)
    if not isinstance(value, tuple | list):
        return value
    configs: dict[str, PolicyOverrides] = {}
    for item in value:
        name, sep, path = str(item).partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--policy-config {str(item)[:200]!r}: give NAME=FILE (the policy, '=', a .toml or .json "
                             "file)")  # fmt: skip
        if name in configs:
            raise ValueError(f"--policy-config names {name} twice")
        try:
            configs[name] = PolicyOverrides.from_file(Path(path))
        except ValueError as exc:
            raise ValueError(f"--policy-config {name}: {exc}") from None
    return configs


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and addresses in 127.0.0.0/8 or ``::1``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings, ExportFields, AccessFields, PolicyFields):
    """Everything the proxy needs to run. Build it once; pass it to ``create_app``.

    Each field is a setting, declared once: its type, default, bounds, help and flag (``proxy._declare``); the
    settings a policy may override are ``PolicyFields``'.
    """

    model_config = SettingsConfigDict(env_prefix="TRACETRAIN_", frozen=True, extra="forbid", populate_by_name=True)

    # Where requests go: OpenAI-compatible base URLs ending in /v1 (vLLM servers in production). Calls of one
    # trajectory go to one server, chosen by hashing its id (the same on every replica listing the same URLs) with
    # a bound on load (proxy.gateway.upstream._placement); every server loads every adapter.
    upstreams: Annotated[tuple[str, ...], NoDecode, AfterValidator(values.upstream_urls)] = Field(
        default=("http://127.0.0.1:8000/v1",),
        min_length=1,
        validation_alias=AliasChoices("tracetrain_upstreams", "tracetrain_upstream"),
        description="use an OpenAI-compatible server you run instead of starting vLLM, e.g. "
        "http://127.0.0.1:8000/v1 (vLLM started with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); "
        "repeat it for several vLLM servers: the calls of one trajectory go to one server (by a hash of its id, the "
        "same on every proxy replica given the same URLs, unless that server is overloaded), every server loads "
        "every adapter. The trainer still needs --model to be its base model. Default: a vLLM child on --model",
        json_schema_extra=flag("--upstream", "URL", group=SERVED, url=True),
    )
    served_model: str | None = Field(default=None, description="the upstream's name for the base model (default: "
                                     "the first model it lists)", json_schema_extra=flag("--served-model", "NAME",
                                                                                         group=SERVED))  # fmt: skip
    upstream_timeout_s: float = Field(default=600.0, gt=0, description="a call to an upstream that sends nothing for "
                                      "this long fails", json_schema_extra=flag("--upstream-timeout", "SECONDS",
                                                                                group=SERVED))  # fmt: skip
    # With a reasoning parser, a chat answer carries the model's thinking in `message.reasoning` (a stream in
    # `delta.reasoning`) and its content without it; the sampled token ids hold both, and train both. The
    # Responses and Messages APIs read this to answer with reasoning items and thinking blocks.
    reasoning_parser: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9_.\-]+$", max_length=100,
        description="vLLM's parser for a reasoning model's thinking, as vLLM names it: qwen3 (Qwen3, QwQ), "
        "deepseek_r1 (DeepSeek-R1 and its distills), ... (vLLM lists them all when it refuses a name). A chat answer "
        "then carries the thinking in message.reasoning and its content without it; every sampled token, thinking "
        "included, still trains. With --upstream, name the parser your vLLM runs. Such templates drop earlier turns' "
        "thinking, so each call of a trajectory trains as a sample of its own; the trainer forwards the prefix they "
        "share once (docs/TRAINING.md) (default: none)",
        json_schema_extra=flag("--reasoning-parser", "NAME", group=VLLM),
    )  # fmt: skip
    # Without it, an image an agent sends (Anthropic's image blocks, the Responses API's input_image) reaches the
    # model as a text placeholder, never as a failed call.
    reads_images: bool = Field(default=False, description="the served model reads images: the Responses and "
                               "Messages APIs hand it the images agents send. Without it each image reaches the model "
                               "as a text placeholder (never a failed call). Default: read in the model's config.json "
                               "(a vision_config); with --upstream, off (docs/APIS.md)", json_schema_extra=flag(
                                   "--reads-images", group=VLLM))  # fmt: skip

    host: str = Field(default="127.0.0.1", description="address to listen on (any other than loopback needs "
                      "--api-keys)", json_schema_extra=flag("--host", group=ADDRESS))
    port: int = Field(default=8100, ge=0, le=65535, description="port to listen on", json_schema_extra=flag(
        "--port", group=ADDRESS))
    data_dir: Path = Field(default=Path(".tracetrain"), description="where the database, models, adapters and logs "
                           "live", json_schema_extra=flag("--data-dir", group=STORAGE))
    database_url: str | None = Field(default=None, description="SQLAlchemy async URL, e.g. "
                                     "postgresql+asyncpg://user@host/db (default: SQLite in the data directory)",
                                     json_schema_extra=flag("--database-url", "URL", group=STORAGE, url=True))

    # Each policy's versions are `NAME@N` (`NAME@0` is the base model). Policies added through the admin API are
    # served as well: the store holds them (docs/POLICIES.md).
    policies: Annotated[tuple[str, ...], NoDecode, AfterValidator(values.policy_names)] = Field(
        default=("agent",), min_length=1,
        validation_alias=AliasChoices("tracetrain_policies", "tracetrain_policy"),
        description="a model name agents use: a policy, one LoRA line on the base model; repeat it for several "
        "agents, each trained on its own groups, served by the one vLLM. Policies added through the admin API "
        "(POST /admin/policies) are served too",
        json_schema_extra=flag("--policy", "NAME", group=POLICIES),
    )  # fmt: skip
    # An agent's own model names (gpt-4o-mini, claude-sonnet-4-5, ...) served by a policy, so that its code never
    # changes; the record keeps the name it asked for (proxy.gateway._policies).
    model_aliases: Annotated[tuple[tuple[str, str], ...], NoDecode, AfterValidator(values.aliases)] = Field(
        default=(), description="serve model NAME (what an agent asks for: gpt-4o-mini, claude-sonnet-4-5, ...) by "
        "policy POLICY; *=POLICY serves every name no policy or alias has; repeatable. The record keeps the name "
        "asked for", json_schema_extra=flag("--model-alias", "NAME=POLICY", group=POLICIES))  # fmt: skip
    # Written into the store when the proxy starts, for every replica and the trainer to apply.
    policy_configs: Annotated[dict[str, PolicyOverrides], BeforeValidator(_policy_files)] = Field(
        default_factory=dict,
        description="the settings policy NAME overrides, from a TOML (.toml) or JSON file: the per-policy settings "
        "(docs/CONFIGURATION.md), by their names (group_size, ...), and a [sampling] table (temperature, top_p, "
        "max_tokens: what its calls sample with when they do not say); the flags are every other policy's "
        "(docs/POLICIES.md); repeatable. A --config file holds them as [policies.NAME] tables",
        json_schema_extra=flag("--policy-config", "NAME=FILE", group=POLICIES, repeat=True),
    )
    # How long an unkeyed trajectory stays open for threading (seconds since its last call).
    thread_ttl_s: float = Field(default=1800.0, gt=0, description="an unkeyed trajectory stays open this long after "
                                "its last call for the next call that extends it to join it", json_schema_extra=flag(
                                    "--thread-ttl", "SECONDS", group=POLICIES))  # fmt: skip
    # A version that left the window stays loaded this long: other proxy replicas may still have requests on it.
    unload_grace_s: float = Field(default=30.0, ge=0, description="a version that left --keep-versions stays loaded "
                                  "this long, for requests other proxy replicas still run on it", json_schema_extra=
                                  flag("--unload-grace", "SECONDS", group=POLICIES))  # fmt: skip
    health_check_s: float = Field(default=2.0, gt=0, description="how often each upstream's /health is asked; a "
                                  "server that fails it leaves the rotation", json_schema_extra=flag(
                                      "--health-check-interval", "SECONDS", group=SERVED))
    # "resolver" asks vLLM for `policy@N` by name and its tracetrain resolver fetches the files from
    # GET /v1/adapters/... (a trainer on another machine).
    adapter_delivery: Literal["auto", "path", "resolver"] = Field(
        default="auto", description="how vLLM gets an adapter: by the path the trainer wrote (vLLM sees that disk), "
        "or fetched from this proxy by tracetrain_vllm's resolver (a trainer on another machine); auto: by path "
        "when it is on this machine", json_schema_extra=flag("--adapter-delivery", group=POLICIES))  # fmt: skip

    # Disk (proxy.observability._disk).
    min_free_disk_mb: int = Field(default=1024, ge=0, description="warn in the log and on /readyz while the data "
                                  "directory's disk has less free space than this many MiB", json_schema_extra=flag(
                                      "--min-free-disk", "MB", group=RETENTION))
    keep_trajectories_days: float | None = Field(
        default=None, gt=0, allow_inf_nan=False,
        description="delete trajectories (their calls, rewards, judgements) whose last call is older than DAYS, in "
        "small batches every minute; never one whose group is open or training. Export first to archive "
        "(tracetrain export; docs/OPERATIONS.md) (default: keep everything)",
        json_schema_extra=flag("--keep-trajectories", "DAYS", group=RETENTION),
    )  # fmt: skip

    # One GPU for vLLM and the trainer (proxy.training._handover).
    share_gpu: bool = Field(
        default=False,
        description="force vLLM and the trainer onto the same GPU(s), or onto GPUs of their own (--no-share-gpu) "
        "(default: shared with one GPU, dedicated with several). Shared: around each training step new calls "
        "wait in the proxy, vLLM finishes what it runs and sleeps, the trainer steps, vLLM wakes with the new "
        "adapter and the calls go on (vLLM gets VLLM_SERVER_DEV_MODE=1 and, on CUDA, --enable-sleep-mode). With "
        "--upstream, the same hand-over with your vLLM: start it with VLLM_SERVER_DEV_MODE=1 and, on CUDA, "
        "--enable-sleep-mode",
        json_schema_extra=flag("--share-gpu", group=GPUS),
    )  # fmt: skip
    handover_wait_s: float = Field(default=300.0, gt=0, description="with --share-gpu: a call held through a training "
                                   "step longer than this is answered 503 with Retry-After", json_schema_extra=flag(
                                       "--handover-wait", "SECONDS", group=GPUS))  # fmt: skip
    handover_timeout_s: float = Field(default=1800.0, gt=0, description="with --share-gpu: a step that keeps the GPU "
                                      "longer than this loses it, and vLLM serves again", json_schema_extra=flag(
                                          "--handover-timeout", "SECONDS", group=GPUS))  # fmt: skip

    # Where judge_model is served, when not at its provider's usual URL (an OpenAI-compatible gateway).
    judge_api_base: str | None = Field(default=None, pattern=r"^https?://", max_length=2000, description="where "
                                       "--judge-model is served, when not at its provider's usual URL (an "
                                       "OpenAI-compatible gateway)", json_schema_extra=flag(
                                           "--judge-api-base", "URL", group=REWARDS, url=True))  # fmt: skip
    # Where a judge is served, and with which key, is only ever the operator's to say: the admin API names one of
    # these models, never a URL (docs/OPERATIONS.md, "The judge").
    judges: Annotated[tuple[tuple[str, str | None], ...], NoDecode, AfterValidator(values.judge_urls)] = Field(
        default=(), description="a further judge a policy may choose as its judge_model (--policy-config, the admin "
        "API), at its provider's usual URL with its usual key variable, or at BASE_URL; repeatable. A policy names "
        "one of these or --judge-model, never a URL (docs/OPERATIONS.md)",
        json_schema_extra=flag("--judge", "MODEL[=BASE_URL]", group=REWARDS, url=True))  # fmt: skip
    judge_max_attempts: int = Field(default=3, ge=1, le=10, description="times the judge is asked for one group "
                                    "before it is given up", json_schema_extra=flag("--judge-max-attempts", "N",
                                                                                    group=REWARDS))  # fmt: skip
    judge_concurrency: int = Field(default=2, ge=1, description="groups judged at once", json_schema_extra=flag(
        "--judge-concurrency", "N", group=REWARDS))

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

    @field_validator("api_keys", "reward_keys", "adapter_keys", "upstreams", "policies", "forwarded_allow_ips",
                     mode="before")  # fmt: skip
    @classmethod
    def _split_keys(cls, value: object) -> object:
        return values.items(value)

    @field_validator("policy_keys", mode="before")
    @classmethod
    def _policy_key_pairs(cls, value: object) -> object:
        return values.pairs(value, values.policy_key_pair)

    @field_validator("model_aliases", mode="before")
    @classmethod
    def _alias_pairs(cls, value: object) -> object:
        return values.pairs(value, values.alias_pair)

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
        return read_rubric(Path(value[1:])) if value is not None and value.startswith("@") else value

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

    @property
    def policy_defaults(self) -> PolicySettings:
        """Every policy's settings where it overrides none (``proxy._policy_config``): the server's."""
        return PolicySettings.model_construct(**{name: getattr(self, name) for name in PolicyFields.model_fields},
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
