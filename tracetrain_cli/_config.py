"""Where every command's flags take their values (``tracetrain_core._flag_sources``: flag > ``TRACETRAIN_<FLAG>``
> ``serve --config FILE`` > default), the variables renamed to that rule, and ``serve --print-config``.

A configuration file is TOML keyed by serve's flags, each policy's own settings in a ``[policies.NAME]`` table:

    upstream = ["http://10.0.0.5:8000/v1"]
    header-timeout = 20
    reward-source = "judge"

    [policies.sql]
    model-alias = ["gpt-4o-mini"]  # the model names an agent asks for that this policy serves
    group-size = 4
    judge-rubric = "@rubric.md"   # read beside this file
    sampling = { temperature = 0.7 }
"""

from __future__ import annotations

import argparse
import json
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from proxy import PolicyOverrides, Settings, declared
from store import redact
from tracetrain_cli._setting_flags import dest, masked
from tracetrain_core import (
    SourceError,
    apply_sources,
    env_name,
    flag_actions,
    long_flag,
    subcommand_chain,
)

_NOT_SHOWN = ("config", "print_config")


def renamed_variables() -> dict[str, str]:
    """Each variable an earlier release read under another name (the setting's field's), to its new name."""
    renamed = {}
    for item in declared(Settings):
        old, new = f"TRACETRAIN_{item.field.upper()}", env_name(item.flag)
        if old != new and item.field != "policy_configs":  # that one's old value is JSON: Settings reads it
            renamed[old] = new
    return renamed


def read_config_file(path: Path) -> dict[str, Any]:
    """A --config file's table, its [policies.NAME] tables made ``policy-config``'s value (SystemExit if bad)."""
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SystemExit(f"tracetrain serve: --config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SystemExit(f"tracetrain serve: --config {path} is not valid TOML: {exc}") from None
    policies = table.pop("policies", None)
    if policies is not None:
        if not isinstance(policies, dict) or not all(isinstance(v, dict) for v in policies.values()):
            raise SystemExit(f"tracetrain serve: --config {path}: policies holds one [policies.NAME] table per policy")
        # A policy's own model names (``model-alias = ["gpt-4o-mini"]`` in its table) are serve's --model-alias.
        aliases = [f"{alias}={name}" for name, t in policies.items() for alias in _names(path, name, t)]
        if aliases:
            top = table.get("model-alias", table.pop("model_alias", []))
            table["model-alias"] = [*(top if isinstance(top, list) else [top]), *aliases]
        table["policy-config"] = {name: _policy_table(path, name, t) for name, t in policies.items() if t}
    return table


def _names(path: Path, name: str, table: dict[str, Any]) -> list[str]:
    aliases = table.pop("model-alias", table.pop("model_alias", []))
    aliases = [aliases] if isinstance(aliases, str) else aliases
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise SystemExit(f"tracetrain serve: --config {path}: [policies.{name}] model-alias is a list of model names")
    return aliases


def _policy_table(path: Path, name: str, table: dict[str, Any]) -> PolicyOverrides:
    try:
        return PolicyOverrides.from_table(table, path.parent, where=f"[policies.{name}]")
    except ValueError as exc:
        raise SystemExit(f"tracetrain serve: --config {path}: {exc}") from None


def apply(parser: argparse.ArgumentParser, argv: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """Give the flags of the command ``argv`` names their values from ``env`` and, for serve, its --config file;
    each flag's origin by ``dest`` (SystemExit naming a value no flag accepts)."""
    origins: dict[str, str] = {}
    renamed = renamed_variables()
    for sub, rest in subcommand_chain(parser, argv):
        file: dict[str, Any] = {}
        if any(a.dest == "config" for a in sub._actions):
            config = _config_path(rest, env)
            file = read_config_file(config) if config else {}
        policy_tables = file.pop("policy-config", None)
        try:
            origins |= apply_sources(sub, rest, env, file, renamed)
        except SourceError as exc:
            raise SystemExit(f"{sub.prog}: {exc}") from None
        if isinstance(policy_tables, dict) and origins.get("policy_config") == "default":
            next(a for a in sub._actions if a.dest == "policy_config").default = policy_tables
            origins["policy_config"] = "file"
    return origins


def _config_path(argv: Sequence[str], env: Mapping[str, str]) -> Path | None:
    for i, token in enumerate(argv):
        if token == "--config" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if token.startswith("--config="):
            return Path(token.partition("=")[2])
    return Path(env["TRACETRAIN_CONFIG"]) if env.get("TRACETRAIN_CONFIG") else None


def config_text(args: argparse.Namespace, settings: Any) -> str:
    """serve's effective settings as a --config file: each flag's value and, as a comment, where it came from;
    a secret masked and commented out (it is read from where it was set, never from this text)."""
    fields = {dest(item): item for item in declared(type(settings))}
    origins: dict[str, str] = getattr(args, "origins", {})
    lines = ["# tracetrain serve --print-config: flag > environment (TRACETRAIN_<FLAG>) > --config file > default"]
    for action in flag_actions(args.parser):
        if action.dest in _NOT_SHOWN or action.dest == "policy_config":
            continue
        key, origin = long_flag(action).lstrip("-"), origins.get(action.dest, "default")
        item = fields.get(action.dest)
        value = getattr(settings, item.field) if item else getattr(args, action.dest, None)
        if item and item.url:
            value = _redacted(value)
        if value is None:
            lines.append(f"# {key} =  # {origin}: unset")
        elif item and item.secret and value:
            lines.append(f"# {key} = {_toml(masked(_plain(value)))}  # {origin} (a secret: masked, never read back)")
        elif origin == "default":  # shown, not pinned: a default left unset may be decided later (--share-gpu)
            lines.append(f"# {key} = {_toml(_plain(value))}  # default")
        else:
            lines.append(f"{key} = {_toml(_plain(value))}  # {origin}")
    for name, overrides in sorted(settings.policy_configs.items()):
        lines.append(f"\n[policies.{_key(name)}]  # {origins.get('policy_config', 'default')}")
        lines += [f"{k.replace('_', '-')} = {_toml(v)}" for k, v in overrides.stored().items()]
    return "\n".join(lines) + "\n"


def _redacted(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, tuple):
        return tuple(_redacted(v) for v in value)
    return value


def _plain(value: Any) -> Any:
    """A setting's value as the flag takes it: pairs as ``NAME=VALUE`` text, paths as text, tuples as lists."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | list):
        return [_pair(v) if isinstance(v, tuple) else _plain(v) for v in value]
    return value


def _pair(pair: tuple[Any, Any]) -> str:
    name, other = pair
    return str(name) if other is None else f"{name}={_plain(other)}"


def _key(name: str) -> str:
    return name if name.replace("-", "").replace("_", "").isalnum() else json.dumps(name)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(str(k))} = {_toml(v)}" for k, v in value.items() if v is not None) + "}"
    return json.dumps(str(value), ensure_ascii=False)

