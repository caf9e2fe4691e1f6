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

import json
import logging
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import NoDecode

from proxy._declare import CANARY, GUARD, POLICIES, RETENTION, REWARDS, flag

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


class PolicyFields(BaseModel):
    """The settings a policy may override, declared once: the server's value (``Settings`` inherits these) is what a
    policy that overrides none runs with (``PolicySettings``); ``PolicyOverrides`` holds a policy's own."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Groups and training: how groups fill and when a step is due.
    group_size: int = Field(default=8, ge=1, le=MAX_GROUP, description="most trajectories in a group derived from "
                            "a task prompt; then a new one opens", json_schema_extra=flag("--group-size", "N",
                                                                                       group=POLICIES, policy=True))
    min_group_size: int = Field(default=2, ge=1, le=MAX_GROUP, description="fewest rewarded trajectories for a group "
                                "to train (a group of one has no baseline)", json_schema_extra=flag(
                                    "--min-group-size", "N", group=POLICIES, policy=True))
    batch_groups: int = Field(default=4, ge=1, le=MAX_GROUP, description="ready groups that trigger a training step",
                              json_schema_extra=flag("--batch-groups", "N", group=POLICIES, policy=True))
    keep_versions: int = Field(default=3, ge=1, le=MAX_KEEP_VERSIONS, description="adapter versions kept loaded in "
                               "vLLM, and kept on disk by retention (also the served one, every published one and the "
                               "regression guard's last kept one); older versions are pruned: files deleted, rows and "
                               "metrics kept", json_schema_extra=flag("--keep-versions", "N", group=POLICIES,
                                                                      policy=True))  # fmt: skip
    # The regression guard (proxy.training._guard); defaults and their reasons: docs/TRAINING.md.
    regression_guard: bool = Field(default=True, description="watch each new version's rewards: a version that serves "
                                   "worse rewards than the one before it is rolled back and training pauses until an "
                                   "admin resumes it (docs/TRAINING.md); --no-regression-guard turns it off",
                                   json_schema_extra=flag("--regression-guard", group=GUARD, policy=True))
    regression_margin: float = Field(default=0.05, ge=0, le=MAX_MARGIN, allow_inf_nan=False, description="how much "
                                     "lower a new version's mean group reward may be and still count as not worse",
                                     json_schema_extra=flag("--regression-margin", "REWARD", group=GUARD,
                                                            policy=True))  # fmt: skip
    regression_alpha: float = Field(default=0.05, gt=0, lt=1, description="the chance the guard rolls back a version "
                                    "that is not worse, over all its looks", json_schema_extra=flag(
                                        "--regression-alpha", "P", group=GUARD, policy=True))
    regression_groups: int = Field(default=8, ge=3, le=64, description="the guard decides within this many rewarded "
                                   "groups of a new version", json_schema_extra=flag("--regression-groups", "N",
                                                                                     group=GUARD, policy=True))
    # Canary trials of its new versions (proxy.training._canary); defaults and their reasons: docs/TRAINING.md.
    canary: float | None = Field(default=None, gt=0, lt=1, description="try each new version on this share of new "
                                 "trajectories (e.g. 0.1) before it serves everyone: the version before it serves the "
                                 "rest, and a paired test of their rewards within groups promotes it or rolls it back "
                                 "(docs/TRAINING.md, 'Trying a version'). Each policy's trial is its own; a policy's "
                                 "own canary (0: none) overrides this. Default: a new version serves everything at "
                                 "once", json_schema_extra=flag("--canary", "FRACTION", group=CANARY, policy=True))
    canary_margin: float = Field(default=0.05, ge=0, le=MAX_MARGIN, allow_inf_nan=False, description="how much lower "
                                 "the new version's rewards may be than the current one's and still count as not "
                                 "worse", json_schema_extra=flag("--canary-margin", "REWARD", group=CANARY,
                                                                 policy=True))  # fmt: skip
    canary_alpha: float = Field(default=0.05, gt=0, lt=1, description="the chance a trial rolls back a version that "
                                "is not worse (and, alike, promotes early one that is), over all its looks",
                                json_schema_extra=flag("--canary-alpha", "P", group=CANARY, policy=True))
    canary_groups: int = Field(default=8, ge=3, le=256, description="a trial decides within this many complete groups "
                               "holding both versions", json_schema_extra=flag("--canary-groups", "N", group=CANARY,
                                                                               policy=True))  # fmt: skip
    canary_minutes: float = Field(default=30.0, gt=0, le=MAX_MINUTES, allow_inf_nan=False, description="a trial "
                                  "decides within this many minutes, on the evidence it has", json_schema_extra=flag(
                                      "--canary-minutes", "MINUTES", group=CANARY, policy=True))
    # Rewards and the judge.
    reward_source: RewardSource = Field(default="external", description="where rewards come from: POST /v1/rewards "
                                        "(external), an LLM judge that scores each group's trajectories against each "
                                        "other (judge; no reward function needed), both (posted rewards train, the "
                                        "judge's scores are recorded beside them), or people (human: the dashboard's "
                                        "review queue). Whatever the source, a person's score on the dashboard "
                                        "overrides a posted or judged reward", json_schema_extra=flag(
                                            "--reward-source", group=REWARDS, policy=True))
    reward_timeout_s: float | None = Field(default=None, gt=0, le=MAX_SECONDS, allow_inf_nan=False, description="a "
                                           "complete group still missing rewards this long after its last call or "
                                           "reward is judged if a judge is configured (--judge-model), else closed as "
                                           "unrewarded and never trained (default: wait forever)",
                                           json_schema_extra=flag("--reward-timeout", "SECONDS", group=RETENTION,
                                                                  policy=True))  # fmt: skip
    reward_weights: Annotated[RewardWeights | None, NoDecode] = Field(default=None, description="a reward's "
        "components and their weights: a reward posted with metrics and no reward is the weighted sum of those "
        "metrics (each named one required), and each component's mean is shown per step (docs/APIS.md, 'Rewards'). "
        "Default: none; a reward must then be given", json_schema_extra=flag("--reward-weights", "NAME=W,...",
                                                                             group=RETENTION, policy=True))  # fmt: skip
    turn_discount: float = Field(default=1.0, ge=0, le=1, allow_inf_nan=False, description="a call's reward (POST "
                                 "/v1/rewards with a call_id) counts for the calls before it discounted by G per call, "
                                 "from 0 to 1; the trajectory's reward counts fully for every call (docs/TRAINING.md)",
                                 json_schema_extra=flag("--turn-discount", "G", group=RETENTION, policy=True))
    # A policy chooses one of the judges the operator configured (``Settings.judge_endpoints``): where it is served
    # and with which key is the operator's to say (flags and environment), never a policy's.
    judge_model: str | None = Field(default=None, min_length=1, max_length=200, description="the judge, as a litellm "
                                    "model name: openai/gpt-4o-mini (reads OPENAI_API_KEY), anthropic/..., "
                                    "hosted_vllm/NAME (default: the base model vLLM serves, no key needed)",
                                    json_schema_extra=flag("--judge-model", "MODEL", group=REWARDS, policy=True))
    judge_rubric: str | None = Field(default=None, min_length=1, description="what makes one trajectory better than "
                                     "another, as text or @path/to/rubric.md (default: a generic rubric for agent "
                                     "tasks)", json_schema_extra=flag("--judge-rubric", "TEXT_OR_@FILE",
                                                                      group=REWARDS, policy=True))  # fmt: skip
    # A group is judged once it has group_size trajectories and none changed for judge_quiet_s, or once it has
    # min_group_size and none changed for judge_idle_s.
    judge_quiet_s: float = Field(default=10.0, gt=0, le=MAX_SECONDS, allow_inf_nan=False, description="a full group "
                                 "is judged once none of its trajectories changed for this long", json_schema_extra=
                                 flag("--judge-quiet", "SECONDS", group=REWARDS, policy=True))  # fmt: skip
    judge_idle_s: float = Field(default=300.0, gt=0, le=MAX_SECONDS, allow_inf_nan=False, description="a group of "
                                "--min-group-size or more is judged once none of its trajectories changed for this "
                                "long", json_schema_extra=flag("--judge-idle", "SECONDS", group=REWARDS, policy=True))


def _overridable(fields: type[PolicyFields]) -> Any:
    """``PolicyFields`` with every field optional (None: the server's value), each with its bounds."""
    optional: dict[str, Any] = {
        name: (info.annotation | None, FieldInfo.merge_field_infos(info, default=None))  # type: ignore[operator]
        for name, info in fields.model_fields.items()
    }
    return create_model("PolicyOverridesBase", __config__=ConfigDict(frozen=True, extra="forbid"), **optional)


if TYPE_CHECKING:  # mypy reads the fields' types from the declaration; each is optional at run time
    _OverridesBase = PolicyFields
else:
    _OverridesBase = _overridable(PolicyFields)


class PolicyOverrides(_OverridesBase):
    """The settings one policy overrides (``PolicyFields``, each optional), and its sampling defaults."""

    # 0: the policy's versions go without a trial where the server's --canary would try them.
    canary: float | None = Field(default=None, ge=0, lt=1)
    judge_rubric: str | None = Field(default=None, min_length=1, max_length=_MAX_RUBRIC)
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
        return cls.from_table(data, path.parent, where=str(path))

    @classmethod
    def from_table(cls, data: dict[str, Any], directory: Path, *, where: str) -> PolicyOverrides:
        """Overrides from a table (keys the settings' names, or their flags': ``group-size``); a judge rubric
        ``"@FILE"`` is read from ``directory``. Raises ``ValueError`` naming ``where``."""
        data = {key.replace("-", "_"): value for key, value in data.items()}
        rubric = data.get("judge_rubric")
        if isinstance(rubric, str) and rubric.startswith("@"):
            data["judge_rubric"] = read_rubric(directory / rubric[1:])
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(part) for part in first["loc"])
            raise ValueError(f"{where}: {loc}: {first['msg']}") from None

    def stored(self) -> dict[str, Any]:
        """What the store keeps: only the settings given."""
        return self.model_dump(exclude_none=True)

    def over(self, name: str, defaults: PolicySettings) -> PolicySettings:
        """The settings policy ``name`` runs with: these overrides over ``defaults`` (the server's)."""
        given = {field: value for field in PolicyFields.model_fields if (value := getattr(self, field)) is not None}
        if given.get("canary") == 0:
            given["canary"] = None  # the policy's versions go without a trial where the server's would have one
        return defaults.model_copy(update={**given, "name": name, "sampling": self.sampling or defaults.sampling})


def unconfigured_judge(model: str | None, endpoints: dict[str, str | None]) -> str | None:
    """Why a policy may not choose ``model`` as its judge (None: it may): it must be one the operator configured
    (``Settings.judge_endpoints``), so that an admin picks a judge but never where its requests and keys go."""
    if model is None or model in endpoints:
        return None
    offered = ", ".join(sorted(endpoints)) or "none: the server's default judge only"
    return (f"the judge model {model[:200]!r} is not one this server is configured with (tracetrain serve "
            f"--judge-model, --judge); configured: {offered}")  # fmt: skip


def read_rubric(path: Path) -> str:
    try:
        text = path.expanduser().read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"cannot read the judge rubric from {path}: {exc.strerror}") from None
    if not text:
        raise ValueError(f"the judge rubric file {path} is empty")
    return text


class PolicySettings(PolicyFields):
    """What one policy runs with: its overrides over the server's settings (``PolicyOverrides.over``)."""

    name: str
    sampling: SamplingDefaults = SamplingDefaults()

    @property
    def judge_configured(self) -> bool:
        """A judge can score the policy's groups: one was named, or its rewards come from (or beside) the judge."""
        return self.judge_model is not None or self.reward_source in ("judge", "both")




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
