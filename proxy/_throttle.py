"""Failed log-ins, throttled per client address: guessing the admin token costs time.

Each address holds a bucket of ``burst`` attempts that refills one every ``refill_s`` seconds.
A wrong admin token (a login form, an ``Authorization: Bearer`` on the admin API) takes one; an
address whose bucket is empty is refused, right token or wrong, until one is back (429 with
``Retry-After``, ``proxy._credentials``). Five attempts, then one every twelve seconds: a person
who mistyped waits seconds, a guesser gets five tries a minute. The buckets live in this process
(a replica throttles what reaches it) and are bounded: full ones are forgotten, and past
``max_addresses`` the longest-quiet address goes first. Behind a reverse proxy every client has
the proxy's address, so one guesser slows every log-in there; that is the safe side.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict


class LoginThrottle:
    def __init__(self, *, burst: int = 5, refill_s: float = 12.0, max_addresses: int = 10_000) -> None:
        self._burst = burst
        self._refill_s = refill_s
        self._max = max_addresses
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # address -> (attempts left, at)

    def wait_s(self, address: str, now: float | None = None) -> int:
        """Seconds ``address`` must wait before it may try again; 0 when it may try now."""
        left = self._left(address, time.monotonic() if now is None else now)
        return 0 if left >= 1 else max(1, math.ceil((1 - left) * self._refill_s))

    def failed(self, address: str, now: float | None = None) -> None:
        """``address`` sent a wrong token: one attempt fewer."""
        now = time.monotonic() if now is None else now
        self._buckets[address] = (max(0.0, self._left(address, now) - 1), now)
        self._buckets.move_to_end(address)
        while len(self._buckets) > self._max:
            self._buckets.popitem(last=False)

    def _left(self, address: str, now: float) -> float:
        held = self._buckets.get(address)
        if held is None:
            return float(self._burst)
        left = min(float(self._burst), held[0] + (now - held[1]) / self._refill_s)
        if left >= self._burst:
            del self._buckets[address]  # full again: nothing to remember
        return left
