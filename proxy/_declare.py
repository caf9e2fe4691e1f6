"""How a setting says how it is set: the flag, the help group, and whether a policy may override it or it is a
secret, carried on its pydantic field (``json_schema_extra``) beside its type, default, bounds and help
(``description``). The command line's parser, the environment's variable (``TRACETRAIN_<FLAG>``), the
configuration file's key, the per-policy overrides and the reference page are all read from there.

    header_timeout_s: float = Field(default=15.0, gt=0, description="...",
                                    json_schema_extra=flag("--header-timeout", "SECONDS", group=DOOR))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

# The groups of ``tracetrain serve --help`` and of docs/CONFIGURATION.md, in their order.
SERVED = "what is served"
ADDRESS = "addresses"
VLLM = "vLLM"
TRAINER = "the trainer"
STORAGE = "storage"
POLICIES = "policies, groups and training"
KEYS = "keys"
DOOR = "the front door"
REWARDS = "rewards and the judge"
GUARD = "the regression guard"
CANARY = "canary trials"
RETENTION = "retention and waiting"
OBSERVABILITY = "observability"
GPUS = "GPUs (--device cuda)"
GROUPS = (SERVED, ADDRESS, VLLM, TRAINER, STORAGE, POLICIES, KEYS, DOOR, REWARDS, GUARD, CANARY, RETENTION,
          OBSERVABILITY, GPUS)  # fmt: skip


def flag(name: str, metavar: str | None = None, *, group: str, policy: bool = False, secret: bool = False,
         url: bool = False, repeat: bool = False) -> dict[str, Any]:  # fmt: skip
    """A field's ``json_schema_extra``: its flag (``--name``), the metavar its help shows, its help group; whether
    a policy may override it (``--policy-config``, the admin API), whether it is a secret (masked wherever it is
    shown), whether it is a URL (shown without its password), whether its flag is repeated (a tuple's always is)."""
    return {"flag": name, "metavar": metavar, "group": group, "policy": policy, "secret": secret, "url": url,
            "repeat": repeat}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Declared:
    """One setting as its field declares it."""

    field: str
    flag: str
    metavar: str | None
    group: str
    policy: bool
    secret: bool
    url: bool
    repeat: bool
    help: str
    default: Any


def declared(model: type[BaseModel]) -> list[Declared]:
    """The settings of ``model`` that have a flag, in the order of their fields."""
    found = []
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra
        if not isinstance(extra, dict) or "flag" not in extra:
            continue
        metavar = extra["metavar"]
        found.append(Declared(
            field=name, flag=str(extra["flag"]), metavar=None if metavar is None else str(metavar),
            group=str(extra["group"]), policy=bool(extra["policy"]), secret=bool(extra["secret"]),
            url=bool(extra["url"]), repeat=bool(extra["repeat"]), help=info.description or "",
            default=None if info.is_required() else info.get_default(call_default_factory=True),
        ))  # fmt: skip
    return found
