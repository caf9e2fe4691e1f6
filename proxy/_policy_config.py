"""Each policy's own settings: what it overrides of the server's, and what it resolves to.

One server serves several policies (``--policy``, repeated, or added through the admin API). Each
one may override the server's settings for its groups, its training batch, its retention, its
regression guard, its judge and its sampling defaults (``PolicyOverrides``); everything it leaves
out is the server's (``Settings``). The overrides live in the store (``policies.config``), so every
proxy replica and the trainer apply the same ones, and a policy added at run time brings its own.

    tracetrain serve --policy support --policy sql --policy-config sql=sql.toml

    # sql.toml: the names of serve's settings (Settings' fields), and a [sampling] table
    group_size = 4
    batch_groups = 2
    reward_source = "judge"
    judge_rubric = "@rubric.md"   # read from the file's directory
    [sampling]
    temperature = 0.7

What stays the server's for every policy: the base model and vLLM, the keys, the store, the
trainer's settings (its learning rate, LoRA rank, loss: one trainer process trains every
policy), the GPU hand-over, threading and the disk's limits.

``PolicySettings`` is what a policy runs with: the server's values (``Settings.policy_defaults``) under
its overrides. ``canary = 0`` turns the server's ``--canary`` off for one policy.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

log = logging.getLogger("tracetrain.proxy")

RewardSource = Literal["external", "judge", "both", "human"]
_MAX_RUBRIC = 20_000
_MAX_WEIGHTS = 64  # components of one reward


def _weights_text(value: Any) -> Any:
    """``NAME=W,NAME=W`` (a flag, an environment variable) as a mapping; a mapping (TOML, JSON) as it is."""
    if not isinstance(value, str):
        return value
    weights: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, sep, weight = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"'{item}' is not NAME=WEIGHT")
        weights[name.strip()] = weight.strip()
    return weights


# A reward's components and their weights: a reward posted with metrics and no reward is sum(w * metric).
RewardWeights = Annotated[
    dict[Annotated[str, Field(min_length=1, max_length=200)], Annotated[float, Field(allow_inf_nan=False)]],
    BeforeValidator(_weights_text),
    Field(min_length=1, max_length=_MAX_WEIGHTS),
]

# The bounds of the settings a policy may override, declared once here for them and for the server's (Settings).
# Each fits what reads it: a group or a batch is read whole into one training step, every kept version is loaded
# in vLLM at once (--max-loras is their sum), a margin is in reward units (posted rewards are within 1e6), and a
# wait longer than a year is a typo.
MAX_GROUP = 1024  # trajectories in a group (group_size, min_group_size); groups in a step (batch_groups)
MAX_KEEP_VERSIONS = 100
MAX_MARGIN = 1e6
MAX_SECONDS = 31_536_000  # a year
MAX_MINUTES = 525_600  # a year


class SamplingDefaults(BaseModel):
    """What a call for the policy samples with when it does not say: added to its body (and its record, so
    training knows what sampled it) before it is forwarded. Unset: vLLM's own defaults."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    max_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)


class PolicyOverrides(BaseModel):
    """The settings one policy overrides; each has the meaning and the bounds of ``Settings``' field of that name."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Groups and training: how groups fill and when a step is due.
    group_size: int | None = Field(default=None, ge=1, le=MAX_GROUP)
    min_group_size: int | None = Field(default=None, ge=1, le=MAX_GROUP)
    batch_groups: int | None = Field(default=None, ge=1, le=MAX_GROUP)
    # Retention: the versions kept loaded in vLLM and on disk.
    keep_versions: int | None = Field(default=None, ge=1, le=MAX_KEEP_VERSIONS)
    # The regression guard.
    regression_guard: bool | None = None
    regression_margin: float | None = Field(default=None, ge=0, le=MAX_MARGIN, allow_inf_nan=False)
    regression_alpha: float | None = Field(default=None, gt=0, lt=1)
    regression_groups: int | None = Field(default=None, ge=3, le=64)
    # Canary trials of its new versions (0: none, where the server's --canary would try them).
    canary: float | None = Field(default=None, ge=0, lt=1)
    canary_margin: float | None = Field(default=None, ge=0, le=MAX_MARGIN, allow_inf_nan=False)
    canary_alpha: float | None = Field(default=None, gt=0, lt=1)
    canary_groups: int | None = Field(default=None, ge=3, le=256)
    canary_minutes: float | None = Field(default=None, gt=0, le=MAX_MINUTES, allow_inf_nan=False)
    # Rewards and the judge.
    reward_source: RewardSource | None = None
    reward_timeout_s: float | None = Field(default=None, gt=0, le=MAX_SECONDS, allow_inf_nan=False)
    reward_weights: RewardWeights | None = None
    turn_discount: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    # One of the judges the operator configured (``Settings.judge_endpoints``): where it is served and with which
    # key is the operator's to say (flags and environment), never a policy's.
    judge_model: str | None = Field(default=None, min_length=1, max_length=200)
    judge_rubric: str | None = Field(default=None, min_length=1, max_length=_MAX_RUBRIC)
    judge_quiet_s: float | None = Field(default=None, gt=0, le=MAX_SECONDS, allow_inf_nan=False)
    judge_idle_s: float | None = Field(default=None, gt=0, le=MAX_SECONDS, allow_inf_nan=False)
    # Sampling defaults of its calls.
    sampling: SamplingDefaults | None = None

    @field_validator("judge_rubric")
    @classmethod
    def _rubric_is_text(cls, value: str | None) -> str | None:
        if value is not None and value.startswith("@"):
            raise ValueError("give the rubric's text; '@path' is read only from a --policy-config file")
        return value

    @classmethod
    def from_file(cls, path: Path) -> PolicyOverrides:
        """A TOML (``.toml``) or JSON file of overrides; ``judge_rubric = "@FILE"`` reads FILE beside it.

        Raises ``ValueError`` saying what is wrong and where.
        """
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror}") from None
        try:
            data = json.loads(text) if path.suffix.lower() == ".json" else tomllib.loads(text)
        except (ValueError, tomllib.TOMLDecodeError) as exc:
            kind = "JSON" if path.suffix.lower() == ".json" else "TOML"
            raise ValueError(f"{path} is not valid {kind}: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the settings must be a table of names and values")
        rubric = data.get("judge_rubric")
        if isinstance(rubric, str) and rubric.startswith("@"):
            data["judge_rubric"] = _read_rubric(path.parent / rubric[1:])
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise ValueError(f"{path}: {where}: {first['msg']}") from None

    def stored(self) -> dict[str, Any]:
        """What the store keeps: only the settings given."""
        return self.model_dump(exclude_none=True)

    def over(self, name: str, defaults: PolicySettings) -> PolicySettings:
        """The settings policy ``name`` runs with: these overrides over ``defaults`` (the server's)."""
        given = {field: value for field in _RESOLVED if (value := getattr(self, field)) is not None}
        if given.get("canary") == 0:
            given["canary"] = None  # the policy's versions go without a trial where the server's would have one
        return dataclasses.replace(defaults, name=name, **given, sampling=self.sampling or defaults.sampling)


def unconfigured_judge(model: str | None, endpoints: dict[str, str | None]) -> str | None:
    """Why a policy may not choose ``model`` as its judge (None: it may): it must be one the operator configured
    (``Settings.judge_endpoints``), so that an admin picks a judge but never where its requests and keys go."""
    if model is None or model in endpoints:
        return None
    offered = ", ".join(sorted(endpoints)) or "none: the server's default judge only"
    return (f"the judge model {model[:200]!r} is not one this server is configured with (tracetrain serve "
            f"--judge-model, --judge); configured: {offered}")  # fmt: skip


def _read_rubric(path: Path) -> str:
    try:
        text = path.expanduser().read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"cannot read the judge rubric from {path}: {exc.strerror}") from None
    if not text:
        raise ValueError(f"the judge rubric file {path} is empty")
    return text


@dataclass(frozen=True, slots=True)
class PolicySettings:
    """What one policy runs with: ``PolicyOverrides.resolve`` of its overrides over the server's settings."""

    name: str
    group_size: int
    min_group_size: int
    batch_groups: int
    keep_versions: int
    regression_guard: bool
    regression_margin: float
    regression_alpha: float
    regression_groups: int
    canary: float | None  # the share of new trajectories a new version is tried on; None: no trial
    canary_margin: float
    canary_alpha: float
    canary_groups: int
    canary_minutes: float
    reward_source: RewardSource
    reward_timeout_s: float | None
    reward_weights: dict[str, float] | None  # a reward's components and their weights; None: none weighed
    turn_discount: float  # how a call's reward reaches the calls before it (read by the trainer)
    judge_model: str | None
    judge_rubric: str | None
    judge_quiet_s: float
    judge_idle_s: float
    sampling: SamplingDefaults

    @property
    def judge_configured(self) -> bool:
        """A judge can score the policy's groups: one was named, or its rewards come from (or beside) the judge."""
        return self.judge_model is not None or self.reward_source in ("judge", "both")


# The settings a policy takes from the server unless it overrides them (every field but its name and sampling).
_RESOLVED = tuple(name for name in PolicySettings.__dataclass_fields__ if name not in ("name", "sampling"))


def policy_settings(name: str, defaults: PolicySettings, stored: dict[str, Any] | None = None) -> PolicySettings:
    """Policy ``name``'s settings from what the store holds for it (``policies.config``) over ``defaults`` (the
    server's: ``Settings.policy_defaults``).

    Overrides the store holds but this version cannot read (a newer tracetrain's) are ignored, not fatal:
    serving goes on with the server's values for them.
    """
    known = {k: v for k, v in (stored or {}).items() if k in PolicyOverrides.model_fields}
    try:
        overrides = PolicyOverrides.model_validate(known)
    except ValidationError as exc:
        log.error("policy %s: its stored settings are not valid here (%s); it runs with the server's", name,
                  exc.errors()[0]["msg"])  # fmt: skip
        overrides = PolicyOverrides()
    return overrides.over(name, defaults)
