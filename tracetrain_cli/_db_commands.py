"""``tracetrain db current``, ``db upgrade`` and ``db prune``: the store's schema revision, bringing it to
head, and deleting old trajectories on demand.

``tracetrain serve`` and the trainer worker upgrade the store themselves when they open it;
these commands look first, or upgrade ahead of time (before rolling out several replicas).
``db prune`` does what ``serve --keep-trajectories`` does every minute (``store._retention``),
once, or only counts it (``--dry-run``); ``--vacuum`` then gives SQLite's freed pages back.

Exit status: 0 done; 1 the store could not be opened; 2 the store cannot be used by this
tracetrain (a newer one migrated it), the message says what to do.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from store import StoreError, schema
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
    _add_prune_parser(db_sub)
    return db


def _add_prune_parser(db_sub: Any) -> None:
    prune = db_sub.add_parser(
        "prune",
        help="delete old trajectories with their calls, rewards and judgements (--dry-run counts them)",
        description=(
            "Delete the trajectories whose last call is older than --keep-trajectories DAYS, or all but the newest "
            "--keep-last N, with their calls, rewards, and the groups and judgements left empty, in small "
            "transactions (a running proxy goes on capturing). A trajectory whose group is open or training, or "
            "that was touched in the last two hours, is never deleted. Archive first with tracetrain export. "
            "SQLite keeps the freed pages for new rows: --vacuum gives them back to the filesystem (it rewrites "
            "the file and needs as much free space as it takes). PostgreSQL's autovacuum reuses the space."
        ),
    )
    add_store_flags(prune)
    which = prune.add_mutually_exclusive_group(required=True)
    which.add_argument("--keep-trajectories", type=_positive, metavar="DAYS", help="keep the last DAYS days")
    which.add_argument("--keep-last", type=int, metavar="N", help="keep the newest N trajectories")
    prune.add_argument("--policy", metavar="NAME", help="only trajectories of this policy (default: every policy)")
    prune.add_argument("--dry-run", action="store_true", help="count what would be deleted; delete nothing")
    prune.add_argument("--vacuum", action="store_true", help="then VACUUM the database (SQLite: shrink the file)")


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a number of days above 0, got {text}")
    return value


async def _prune(url: str, args: argparse.Namespace) -> str:
    from store import PruneRule, Store

    before = None if args.keep_trajectories is None else time.time() - args.keep_trajectories * 86_400
    rule = PruneRule(before=before, keep_last=args.keep_last, policy=args.policy)
    store = await Store.open(url, capture=False)
    try:
        report = await store.prune_trajectories(rule, dry_run=args.dry_run)
        if args.vacuum and not args.dry_run:
            await store.vacuum()
    finally:
        await store.close()
    verb = "would delete" if args.dry_run else "deleted"
    said = f"{verb} {report.trajectories} trajectories ({report.calls} calls, {report.rewards} rewards"
    return said + ("" if args.dry_run else f", {report.groups} groups, {report.judgements} judgements") + ")"


def run_db(args: argparse.Namespace) -> int:
    command = f"db {args.db_command}"
    url, _ = store_url(args, command)
    shown = _shown(url)
    try:
        if args.db_command == "current":
            return _print_current(shown, asyncio.run(_with_engine(url, schema.current_revision)))
        if args.db_command == "prune":
            if args.keep_last is not None and args.keep_last < 0:
                print(f"tracetrain {command}: --keep-last must be 0 or more", file=sys.stderr)
                return 2
            print(f"{shown}: {asyncio.run(_prune(url, args))}")
            return 0
        done = asyncio.run(_with_engine(url, schema.upgrade))
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
    newest = schema.head()
    if revision is None:
        print(f"{shown}: empty")
    elif revision == schema.LEGACY:
        print(f"{shown}: no migration history: a database written by tracetrain 35c4648 ({_RUN_UPGRADE})")
    elif revision == newest:
        print(f"{shown}: revision {revision} (head)")
    elif revision in schema.revisions():
        print(f"{shown}: revision {revision} (head is {newest}: {_RUN_UPGRADE})")
    else:
        print(
            f"tracetrain db current: {shown}: revision {revision}, which this tracetrain does not know (its newest "
            f"is {newest}): a newer tracetrain migrated it. Upgrade tracetrain to use it",
            file=sys.stderr,
        )
        return 2
    return 0


def _describe(done: schema.Upgrade) -> str:
    if not done.changed:
        return f"already at {done.to_revision}"
    start = "no migration history (tracetrain 35c4648)" if done.legacy else done.from_revision or "empty"
    return f"upgraded from {start} to {done.to_revision}"


def _shown(url: str) -> str:
    """The URL without its password or async driver: sqlite:///..., postgresql://user:***@host/db."""
    parsed = make_url(url)
    return parsed.set(drivername=parsed.get_backend_name()).render_as_string(hide_password=True)
