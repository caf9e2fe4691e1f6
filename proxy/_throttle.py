"""Failed log-ins, throttled per client address: guessing the admin token costs time, never its owner access.

Each address holds a bucket of ``burst`` attempts that refills one every ``refill_s`` seconds.
A wrong credential where the admin token is one of the answers (a login form, an ``Authorization:
Bearer`` on the admin API, the adapter files, a protected ``/metrics``) takes one; once an address's
bucket is empty its wrong ones are refused (429 with ``Retry-After``, ``proxy._credentials``) until one
is back. Five attempts, then one every twelve seconds.

The right token is always admitted, throttled address or not: behind a reverse proxy or a load balancer
every client has one address, and a throttle that refused the right token there would let anyone who
reaches the admin API lock its owner out. So the throttle cannot stop a guesser that reads 200 from
429 (nothing can, without refusing the owner); the token's length does (16 characters at least, 43 when
``serve`` makes it: no online guessing gets near). What the throttle does is keep a guesser's wrong
attempts answered cheaply and slowly to anyone that waits for each answer (the login form, a script),
and show up in the answers as 429s.

The address is the connection's peer, or the client a reverse proxy names in ``X-Forwarded-For`` when
that proxy is one ``--forwarded-allow-ips`` names (``tracetrain_cli._http_server``); no other sender can
rotate it. The buckets live in this process (a replica throttles what reaches it) and are bounded: full
ones are forgotten, and past ``max_addresses`` the longest-quiet address goes first.
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
