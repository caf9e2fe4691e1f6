"""``tracetrain db current`` and ``tracetrain db upgrade``: the store's schema revision, and bringing it to head.

``tracetrain serve`` and the trainer worker upgrade the store themselves when they open it;
these commands look first, or upgrade ahead of time (before rolling out several replicas).

Exit status: 0 done; 1 the store could not be opened; 2 the store cannot be used by this
tracetrain (a newer one migrated it), the message says what to do.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from store._errors import StoreError
from store._migrate import LEGACY, Upgrade, current_revision, head, revisions, upgrade
from tracetrain_cli._data_commands import add_store_flags, store_url

_RUN_UPGRADE = "run tracetrain db upgrade"
_T = TypeVar("_T")


def add_db_parser(sub: Any) -> argparse.ArgumentParser:
    db: argparse.ArgumentParser = sub.add_parser(
        "db",
        help="show or upgrade the store's schema revision",
        description=(
            "The store's schema is versioned (Alembic revisions shipped with tracetrain). `tracetrain serve` and "
            "the trainer worker bring it to this release's revision when they open it; these commands show it, or "
            "upgrade ahead of time. Back up the database first: copy the SQLite file while nothing runs, or "
            "pg_dump a PostgreSQL one."
        ),
    )
    db_sub = db.add_subparsers(dest="db_command", metavar="COMMAND")
    current = db_sub.add_parser(
        "current",
        help="print the store's revision and whether it is this release's",
        description=(
            "Print the store's schema revision: this release's head, an older revision (`tracetrain db upgrade` "
            "brings it to head), no migration history (a database written by tracetrain 35c4648, upgraded in place "
            "with its data), or empty. Exits with status 2 when a newer tracetrain migrated the store. Changes "
            "nothing."
        ),
    )
    add_store_flags(current)
    upgrade_parser = db_sub.add_parser(
        "upgrade",
        help="bring the store's schema to this release's revision",
        description=(
            "Run the migrations the store has not had, in one transaction, and print from which revision to which "
            "(or that it already is at head). A database written by tracetrain 35c4648 (no migration history) is "
            "upgraded in place with all its rows. On PostgreSQL an advisory lock makes replicas that upgrade at the "
            "same time take turns; on SQLite a lock file beside the database does. A store migrated by a newer "
            "tracetrain is refused with status 2. Back up the database first."
        ),
    )
    add_store_flags(upgrade_parser)
    return db


def run_db(args: argparse.Namespace) -> int:
    command = f"db {args.db_command}"
    url, _ = store_url(args, command)
    shown = _shown(url)
    try:
        if args.db_command == "current":
            return _print_current(shown, asyncio.run(_with_engine(url, current_revision)))
        done = asyncio.run(_with_engine(url, upgrade))
    except StoreError as exc:
        print(f"tracetrain {command}: {shown}: {exc}", file=sys.stderr)
        return 2
    except (DBAPIError, OSError) as exc:
        print(f"tracetrain {command}: could not open {shown}: {exc}", file=sys.stderr)
        return 1
    print(f"{shown}: {_describe(done)}")
    return 0


async def _with_engine(url: str, use: Callable[[AsyncEngine], Awaitable[_T]]) -> _T:
    engine = create_async_engine(url)
    try:
        return await use(engine)
    finally:
        await engine.dispose()


def _print_current(shown: str, revision: str | None) -> int:
    newest = head()
    if revision is None:
        print(f"{shown}: empty")
    elif revision == LEGACY:
        print(f"{shown}: no migration history: a database written by tracetrain 35c4648 ({_RUN_UPGRADE})")
    elif revision == newest:
        print(f"{shown}: revision {revision} (head)")
    elif revision in revisions():
        print(f"{shown}: revision {revision} (head is {newest}: {_RUN_UPGRADE})")
    else:
        print(
            f"tracetrain db current: {shown}: revision {revision}, which this tracetrain does not know (its newest "
            f"is {newest}): a newer tracetrain migrated it. Upgrade tracetrain to use it",
            file=sys.stderr,
        )
        return 2
    return 0


def _describe(done: Upgrade) -> str:
    if not done.changed:
        return f"already at {done.to_revision}"
    start = "no migration history (tracetrain 35c4648)" if done.legacy else done.from_revision or "empty"
    return f"upgraded from {start} to {done.to_revision}"


def _shown(url: str) -> str:
    """The URL without its password or async driver: sqlite:///..., postgresql://user:***@host/db."""
    parsed = make_url(url)
    return parsed.set(drivername=parsed.get_backend_name()).render_as_string(hide_password=True)
