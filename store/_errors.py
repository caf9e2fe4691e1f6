"""What the store raises. The proxy turns each into its OpenAI-shaped error (``proxy.errors``).

    StoreError
    ├── StoreUnavailable        the database did not take a write (after retries)
    ├── UnknownTrajectories     a write named trajectories the store does not hold; nothing was written
    ├── SchemaTooNew            the database was migrated by a newer tracetrain than this one
    └── TransitionRefused       a life-cycle move not in the table (a bug, never a race)
"""

from __future__ import annotations

from collections.abc import Sequence


class StoreError(Exception):
    """Base of the store's errors."""


class StoreUnavailable(StoreError):
    pass


class UnknownTrajectories(StoreError):
    def __init__(self, ids: Sequence[str]) -> None:
        self.ids = sorted(ids)
        shown = ", ".join(self.ids[:5]) + (f" and {len(self.ids) - 5} more" if len(self.ids) > 5 else "")
        super().__init__(f"no trajectory with id {shown}")


class SchemaTooNew(StoreError):
    pass


class TransitionRefused(StoreError):
    pass
