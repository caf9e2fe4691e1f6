"""Which version a trajectory meets while a canary trial runs (``--canary``): a pure function.

A trial splits a policy's new trajectories between its candidate (the version on trial) and
its baseline (the version serving everything before it): a new trajectory meets the candidate
when a hash of the trial and the trajectory's id falls under the trial's fraction, so every
proxy replica splits alike with nothing shared but the store (the trial is read from it). A
trajectory with recorded calls keeps its version: the one its calls were served by if that is
the candidate, else the baseline (a trajectory begun before the trial was served by the
baseline, or by an older version that no longer serves). Two calls of one new trajectory
arriving together hash alike, on any replica.

``policy@N`` pins bypass it (``PolicyRegistry.for_trajectory``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

_SCALE = float(2**64)


@dataclass(frozen=True, slots=True)
class Split:
    """A running trial as the gateway routes it (``store.Trials.running``, adopted by the publisher)."""

    trial_id: int
    candidate: int
    baseline: int
    fraction: float  # the share of new trajectories the candidate serves, in (0, 1)

    def version_for(self, trajectory_id: str, served_by: int | None) -> int:
        """The version serving ``trajectory_id``'s next call; ``served_by``: its recorded calls' version, if any."""
        if served_by is not None:
            return self.candidate if served_by == self.candidate else self.baseline
        return self.candidate if draw(self.trial_id, trajectory_id) < self.fraction else self.baseline


def draw(trial_id: int, trajectory_id: str) -> float:
    """A number in [0, 1), uniform over trajectory ids, the same for one trial and id on every replica.

    >>> draw(1, "traj-a") == draw(1, "traj-a") and 0 <= draw(1, "traj-a") < 1
    True
    """
    digest = hashlib.blake2b(f"{trial_id}:{trajectory_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / _SCALE
