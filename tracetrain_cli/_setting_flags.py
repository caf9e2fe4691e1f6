"""``tracetrain serve``'s flags made from the proxy's settings (``proxy.Settings``: each field's flag, help, type,
default and bounds, declared once there), and the settings those flags make (``settings_from``).

A setting's flag is read by argparse as text (or an int, a float, a switch, choices), and validated by the
settings object it fills, so that a bound is written once, in the field.
"""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import SecretStr, ValidationError

from proxy import Declared, Settings, declared


def dest(item: Declared) -> str:
    """The argparse ``dest`` of a setting's flag: ``--header-timeout`` -> ``header_timeout``."""
    return item.flag.lstrip("-").replace("-", "_")


def _plain(annotation: Any) -> Any:
    """The annotation without ``Annotated`` and ``| None``."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _plain(rest[0]) if len(rest) == 1 else annotation
    return annotation


def shown_default(item: Declared) -> str:
    """A setting's default as ``--help`` and the reference page show it ('' where there is none to show)."""
    if item.secret or item.default in (None, (), {}):
        return ""
    if isinstance(item.default, bool):
        return "on" if item.default else "off"
    if isinstance(item.default, tuple):
        return ", ".join(map(str, item.default))
    return str(item.default)


def add_setting_flags(groups: dict[str, Any], model: type[Any] = Settings) -> None:
    """A flag for each of ``model``'s declared settings, in its help group."""
    for item in declared(model):
        kind = _plain(model.model_fields[item.field].annotation)
        options: dict[str, Any] = {"dest": dest(item), "default": None, "metavar": item.metavar}
        if kind is bool:
            options = {"dest": dest(item), "default": None, "action": argparse.BooleanOptionalAction}
        elif typing.get_origin(kind) is tuple or item.repeat:
            options["action"] = "append"
        elif typing.get_origin(kind) is Literal:
            options["choices"] = typing.get_args(kind)
            del options["metavar"]
        elif kind in (int, float, Path):
            options["type"] = kind
        default = shown_default(item)
        text = item.help + (f" (default {default})" if default else "")
        groups[item.group].add_argument(item.flag, help=text.replace("%", "%%"), **options)


def flag_values(args: argparse.Namespace, model: type[Any] = Settings) -> dict[str, Any]:
    """The settings ``args`` gives (flags, and what the environment and a file made their defaults)."""
    return {
        item.field: value
        for item in declared(model)
        if (value := getattr(args, dest(item), None)) is not None
    }


def settings_from(args: argparse.Namespace) -> Any:
    """The proxy's settings from serve's arguments (SystemExit naming each invalid setting and its flag)."""
    flags = {item.field: item.flag for item in declared(Settings)}
    values = flag_values(args)
    try:
        return Settings(**values)
    except ValidationError as exc:
        lines = []
        for e in exc.errors():
            field = str(e["loc"][0]) if e["loc"] else "settings"
            where = ".".join(str(p) for p in e["loc"]) or "settings"
            lines.append(f"  {where}{f' ({flags[field]})' if field in flags else ''}: {e['msg']}")
        raise SystemExit("tracetrain serve: invalid settings\n" + "\n".join(lines)) from None


def masked(value: Any) -> Any:
    """A secret's value as it may be shown."""
    if isinstance(value, tuple | list):
        return [masked(v) for v in value]
    return "********" if isinstance(value, SecretStr | str) else value
