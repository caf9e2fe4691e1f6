"""Where a command's flags take their values: the command line, over the environment, over a configuration
file, over each flag's default. One rule for every flag of every command:

    --header-timeout 20            flag               (wins)
    TRACETRAIN_HEADER_TIMEOUT=20   environment        TRACETRAIN_<FLAG>: upper case, dashes to underscores
    header-timeout = 20            configuration file (TOML; keys are the flags' names)
                                   the flag's default

A repeatable flag takes a comma-separated list from the environment (a TOML array from a file); a switch
takes true or false. A variable renamed by a release keeps working, with a warning naming the new one,
until the next minor release.

Pure: the environment and the file's table are passed in, and argparse's own actions say how each value is
read, so that what a flag accepts on the command line is exactly what its variable and its key accept.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

ENV_PREFIX = "TRACETRAIN_"
_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


class SourceError(ValueError):
    """A value from the environment or a file that its flag does not accept; the message names where it was."""


def env_name(flag: str) -> str:
    """``--header-timeout`` -> ``TRACETRAIN_HEADER_TIMEOUT``."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def long_flag(action: argparse.Action) -> str:
    """The flag that names an action: its first ``--`` option (``--share-gpu`` of ``--share-gpu/--no-share-gpu``)."""
    return next(s for s in action.option_strings if s.startswith("--"))


def flag_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every documented flag of a parser (its groups included): help, removed flags and sub-commands left out."""
    return [
        a for a in parser._actions
        if any(s.startswith("--") for s in a.option_strings) and a.help != argparse.SUPPRESS
        and not isinstance(a, argparse._HelpAction | argparse._VersionAction)
    ]  # fmt: skip


def given_on_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The ``dest`` of every flag ``argv`` names (``--flag``, ``--flag=VALUE``, ``--no-flag``)."""
    by_option = {s: a.dest for a in parser._actions for s in a.option_strings}
    given = set()
    for token in argv:
        if token == "--":
            break
        if dest := by_option.get(token.partition("=")[0]):
            given.add(dest)
    return given


def _switch(text: Any, where: str) -> bool:
    if isinstance(text, bool):
        return text
    word = str(text).strip().lower()
    if word in _TRUE | _FALSE:
        return word in _TRUE
    raise SourceError(f"{where}: a switch takes true or false, got {str(text)[:40]!r}")


def _one(action: argparse.Action, value: Any, where: str) -> Any:
    """One item as the flag reads it: through its ``type`` (text, or a file's number), against its choices."""
    try:
        if action.type is not None and not isinstance(value, bool):
            value = action.type(value if isinstance(value, str) else str(value))  # type: ignore[operator]
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        raise SourceError(f"{where}: {exc}") from None
    if action.choices is not None and value not in action.choices:
        raise SourceError(f"{where}: {str(value)[:60]!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def read_value(action: argparse.Action, value: Any, where: str) -> Any:
    """A value from the environment (text) or a file (TOML's types) as the flag's own parsing makes it.

    A flag without a ``type`` keeps a file's value as TOML typed it (a table, a number): what reads it
    (the proxy's validated settings) takes those too.
    """
    if action.nargs == 0:  # a switch: store_true / store_false / BooleanOptionalAction
        on = _switch(value, where)
        if isinstance(action, argparse.BooleanOptionalAction):
            return on
        return action.const if on else action.default
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [p.strip() for p in str(value).split(",") if p.strip()]
        return [_one(action, item, where) for item in items]
    if isinstance(value, list):  # one flag that takes a list in one value (--log-to a,b)
        value = ",".join(map(str, value))
    return _one(action, value, where)


def apply_sources(
    parser: argparse.ArgumentParser,
    argv: Sequence[str],
    env: Mapping[str, str],
    file: Mapping[str, Any] | None = None,
    renamed: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Make the environment's and the file's values the defaults of ``parser``'s flags that ``argv`` does not
    name, and return each flag's origin by ``dest``: ``flag``, ``env NAME``, ``file`` or ``default``.

    ``renamed`` maps an old variable's name to the new one: read when the new one is not set, with a
    ``FutureWarning`` naming the new one. A file's key that no flag has is an error.
    """
    given = given_on_command_line(parser, argv)
    actions = flag_actions(parser)
    keys = {long_flag(a).lstrip("-"): a for a in actions}
    unknown = [k for k in (file or {}) if k.replace("_", "-") not in keys]
    if unknown:
        raise SourceError(f"the configuration file names no such setting: {', '.join(sorted(unknown))}")
    from_file = {k.replace("_", "-"): v for k, v in (file or {}).items()}
    old_names = {new: old for old, new in (renamed or {}).items()}
    origins: dict[str, str] = {}
    for action in actions:
        flag = long_flag(action)
        name = env_name(flag)
        if action.dest in given:
            origins[action.dest] = "flag"
            continue
        old = old_names.get(name)
        if name in env:
            raw, origin = env[name], f"env {name}"
        elif old is not None and old in env:
            warnings.warn(f"{old} is deprecated and will stop working in the next minor release; set {name}",
                          FutureWarning, stacklevel=1)  # fmt: skip
            raw, origin = env[old], f"env {old}"
        elif flag.lstrip("-") in from_file:
            raw, origin = from_file[flag.lstrip("-")], "file"
        else:
            origins.setdefault(action.dest, "default")
            continue
        action.default = read_value(action, raw, f"{origin.removeprefix('env ')} ({flag})")
        action.required = False
        origins[action.dest] = origin
    return origins


def subcommand_chain(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> Iterable[tuple[argparse.ArgumentParser, Sequence[str]]]:
    """The parser of each sub-command ``argv`` names (``db prune``: the db parser, then prune's), with the
    arguments that follow its name."""
    rest = list(argv)
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        index = next((i for i, token in enumerate(rest) if subs and token in subs[0].choices), None)
        if index is None:
            return
        parser, rest = subs[0].choices[rest[index]], rest[index + 1 :]
        yield parser, rest
