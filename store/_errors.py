"""What the store raises. The proxy turns each into its OpenAI-shaped error (``proxy.errors``).

StoreError
├── StoreUnavailable        the database did not take a write (after retries)
│   └── StoreFull           ... because its disk is full (ENOSPC, SQLITE_FULL, PostgreSQL class 53)
├── RecordRefused           a call's record cannot be stored as it is (JSON nested too deep to write)
├── KeyTaken                a trajectory or group id another policy holds: a call never joins it
├── UnknownTrajectories     a write named trajectories the store does not hold; nothing was written
├── UnknownCalls            a reward named calls its trajectory does not hold; nothing was written
├── SchemaTooNew            the database was migrated by a newer tracetrain than this one
└── TransitionRefused       a life-cycle move not in the table (a bug, never a race)
"""

from __future__ import annotations

import errno
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

from sqlalchemy.exc import InterfaceError, OperationalError

from store._full_disk import FULL_DISK


class StoreError(Exception):
    """Base of the store's errors."""


class StoreUnavailable(StoreError):
    pass


class StoreFull(StoreUnavailable):
    """The write failed for want of space: it will succeed once space is freed."""


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps: SQLAlchemy's ``orig``, a cause) says the disk or database is full."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        error = stack.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        if getattr(error, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
            return True
        # PostgreSQL's class 53, insufficient resources: 53100 disk_full, 53200 out of memory, ...
        if str(getattr(error, "sqlstate", None) or getattr(error, "pgcode", None) or "").startswith("53"):
            return True
        if "database or disk is full" in str(error) or "No space left on device" in str(error):
            return True
        orig = getattr(error, "orig", None)
        stack += [error.__cause__, error.__context__, orig if isinstance(orig, BaseException) else None]
    return False


class RecordRefused(StoreError):
    """One call's record cannot be written, however often it is tried; the calls beside it are written."""


# What the database drivers raise when the database itself fails (gone, locked, its disk full).
DRIVER_ERRORS: tuple[type[Exception], ...] = (OperationalError, InterfaceError, sqlite3.OperationalError)
_FAILURES: tuple[type[Exception], ...] = (*DRIVER_ERRORS, OSError)


class KeyTaken(StoreError):
    """A trajectory or group id held by another policy than the call's: a trajectory and a group hold one
    policy's calls, those of the first policy that took the id. Nothing was written; the other policy is not
    named (it is another tenant's)."""

    def __init__(self, kind: Literal["trajectory", "group"], key: str) -> None:
        self.kind = kind
        self.key = key
        super().__init__(f"the {kind} id '{key}' is taken by another policy's {kind}")


@contextmanager
def database_errors(doing: str) -> Iterator[None]:
    """The database's own failures inside the block as the store's: ``StoreFull`` for a full disk, else
    ``StoreUnavailable`` (the database gone, locked, refusing); ``doing`` says what failed."""
    try:
        yield
    except StoreError:
        raise
    except _FAILURES as exc:
        raise store_error_of(exc, doing) from exc


def store_error_of(exc: BaseException, doing: str) -> StoreUnavailable:
    """A database failure as the store's error: ``StoreFull`` for a full disk (told once in the log: ``FULL_DISK``),
    else ``StoreUnavailable``; ``doing`` says what failed."""
    if is_disk_full(exc):
        FULL_DISK.failed(doing, exc)
        return StoreFull(f"could not {doing}, the store's disk is full")
    return StoreUnavailable(f"could not {doing}: {type(exc).__name__}")


class UnknownTrajectories(StoreError):
    def __init__(self, ids: Sequence[str]) -> None:
        self.ids = sorted(ids)
        shown = ", ".join(self.ids[:5]) + (f" and {len(self.ids) - 5} more" if len(self.ids) > 5 else "")
        super().__init__(f"no trajectory with id {shown}")


class SchemaTooNew(StoreError):
    pass


class TransitionRefused(StoreError):
    pass


class UnknownCalls(StoreError):
    """Calls a reward named that its trajectory does not hold (unknown, or another trajectory's)."""

    def __init__(self, ids: Sequence[str]) -> None:
        self.ids = sorted(ids)
        shown = ", ".join(self.ids[:5]) + (f" and {len(self.ids) - 5} more" if len(self.ids) > 5 else "")
        super().__init__(f"no call with id {shown} in the trajectory the reward names")
