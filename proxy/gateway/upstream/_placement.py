"""Which vLLM server takes a trajectory's call: the same choice on every proxy, with no state shared.

Rendezvous (highest random weight) hashing with bounded load:

    score(trajectory, server) = blake2b(trajectory id, salt = blake2b(server's URL))
    bound = ceil(LOAD_FACTOR * (calls in flight on the candidates + 1) / number of candidates)
    choice = the highest-scoring candidate whose calls in flight are under the bound

Each trajectory thus ranks the servers in an order of its own, the same on every proxy that
lists the same URLs. While its first server is in rotation and not overloaded, every call of the
trajectory goes there, whichever proxy takes it: vLLM's prefix cache there holds its history.
When that server leaves the rotation, the trajectory moves to the next in its own ranking,
again the same on every proxy, and only the trajectories of that server move (a server coming
back takes back those that rank it first, about 1/n of them). New trajectories spread by the
hash, so evenly on average; the bound keeps a burst of them off a server already busier than
(LOAD_FACTOR x the mean): such a call goes to the next server of its ranking that is under it.

The bound counts the calls in flight through this proxy only. Proxies behind a balancer see
about the same share of the load, so they skip the same servers; when their counts differ, a
call near the bound may go to the next server on one proxy and not on the other (the cost: that
call's prefix cache). With calls one after another (an agent's turns), nothing is in flight
while the next is placed and the choice is the hash's alone.

This is "Consistent Hashing with Bounded Loads" (Mirrokni, Thorup, Zadimoghaddam, 2018) on
rendezvous hashing instead of a ring: a rank per trajectory needs no virtual nodes, and with a
handful of servers scoring each one is cheaper than a ring lookup (blake2b of a short id is
~0.5 µs here; ``bench/placement.py`` measures the choice).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Protocol, TypeVar

# A server may take up to 50% more than the mean of calls in flight (the paper's 1 + eps): lower spreads
# load more evenly, higher moves fewer calls off their own server. Measured (bench/placement.py, two
# proxies, 4 servers, ~48 calls in flight): 1.25 kept 81.5% of turns on their server, 1.5 93.9%, with the
# busiest server at 1.21 and 1.28 x the mean (per-proxy memory before: 62.3%, 1.19).
LOAD_FACTOR = 1.5
_blake2b = hashlib.blake2b


class Placeable(Protocol):
    @property
    def salt(self) -> bytes: ...  # server_salt(its URL)

    @property
    def in_flight(self) -> int: ...


S = TypeVar("S", bound=Placeable)


def server_salt(url: str) -> bytes:
    """The salt of a server's scores: its URL's hash (every proxy must name it by the same URL)."""
    return hashlib.blake2b(url.encode(), digest_size=16).digest()


def score(trajectory_id: str, salt: bytes) -> bytes:
    """The trajectory's weight for one server; bytes compare like the big-endian numbers they are."""
    return _blake2b(trajectory_id.encode("utf-8", "surrogatepass"), digest_size=8, salt=salt).digest()


def load_bound(in_flight: int, servers: int, load_factor: float = LOAD_FACTOR) -> int:
    """Calls in flight a server may have and still take one more (it takes one while under this)."""
    return math.ceil(load_factor * (in_flight + 1) / servers)


def rank(trajectory_id: str, servers: Sequence[S]) -> list[S]:
    """The servers in the trajectory's own order of preference (the hash's alone, load aside)."""
    return sorted(servers, key=lambda s: score(trajectory_id, s.salt), reverse=True)


def choose(trajectory_id: str, candidates: Sequence[S], load_factor: float = LOAD_FACTOR) -> S:
    """The candidate that takes the trajectory's next call (see the module's docstring).

    Equal to the first of ``rank(trajectory_id, candidates)`` under the load bound, without sorting.
    Some candidate is always under the bound (the least loaded is at most the mean), so this never fails
    on a non-empty sequence.
    """
    if len(candidates) <= 1:
        if candidates:
            return candidates[0]
        raise ValueError("no candidate to place a call on")
    total = 0
    for server in candidates:
        total += server.in_flight
    bound = math.ceil(load_factor * (total + 1) / len(candidates))
    key = trajectory_id.encode("utf-8", "surrogatepass")
    best = candidates[0]
    best_score = b""
    for server in candidates:
        if server.in_flight < bound:
            weight = _blake2b(key, digest_size=8, salt=server.salt).digest()
            if weight > best_score:
                best, best_score = server, weight
    return best
