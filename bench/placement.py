"""Placing trajectories on vLLM servers: rendezvous hashing with a load bound against per-proxy stickiness.

Two parts, each comparing the placements side by side in one run:

1. **Cost of a pick**, per call, for 2, 4 and 8 servers: the router's choice now
   (``proxy.gateway.upstream._placement.choose``: one blake2b per server) against the previous one (a
   dictionary of trajectory -> server in each proxy, and for a new trajectory a scan of the
   in-flight counters; copied below as ``StickyLeastBusy``).
2. **Two proxies behind a round-robin balancer**, simulated (an event queue, no network): multi-turn
   trajectories arrive at random, each turn is handed to the next proxy in turn, each proxy places
   it with its own in-flight counts. Printed per policy: the share of turns (after a trajectory's
   first) served by the server of its previous turn, which is what vLLM's prefix cache needs, and
   the load spread: time-averaged busiest server over the mean, and the share of time any server
   held more than 1.5 x the mean + 1 calls.

    PYTHONPATH=.:sdk .venv/bin/python bench/placement.py [--trajectories 4000] [--servers 4]
"""

from __future__ import annotations

import argparse
import heapq
import random
import time
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from proxy.gateway.upstream._placement import choose, rank, server_salt


@dataclass(eq=False)
class Box:
    url: str
    in_flight: int = 0  # this proxy's calls on it
    salt: bytes = field(init=False)

    def __post_init__(self) -> None:
        self.salt = server_salt(self.url)


class StickyLeastBusy:
    """The router's pick before rendezvous hashing (tracetrain 686644a): memory of each proxy's own."""

    def __init__(self, servers: Sequence[Box]) -> None:
        self.servers = list(servers)
        self.sticky: dict[str, Box] = {}
        self.turn = 0

    def pick(self, trajectory: str) -> Box:
        server = self.sticky.get(trajectory)
        if server is not None:
            return server
        self.turn += 1
        start = self.turn % len(self.servers)
        best = self.servers[start]
        for i in range(1, len(self.servers)):
            other = self.servers[(start + i) % len(self.servers)]
            if other.in_flight < best.in_flight:
                best = other
        self.sticky[trajectory] = best
        return best


class Hashed:
    """The router's pick now (``proxy.gateway.upstream._placement.choose``), at a given load factor."""

    def __init__(self, servers: Sequence[Box], load_factor: float | None) -> None:
        self.servers = list(servers)
        self.load_factor = load_factor

    def pick(self, trajectory: str) -> Box:
        if self.load_factor is None:  # the hash alone, no bound: for comparison
            return rank(trajectory, self.servers)[0]
        return choose(trajectory, self.servers, self.load_factor)


Policy = Callable[[Sequence[Box]], StickyLeastBusy | Hashed]
POLICIES: dict[str, Policy] = {
    "sticky per proxy (before)": StickyLeastBusy,
    "hash + bound 1.25": lambda s: Hashed(s, 1.25),
    "hash + bound 1.5 (now)": lambda s: Hashed(s, 1.5),
    "hash + bound 2": lambda s: Hashed(s, 2.0),
    "hash, no bound": lambda s: Hashed(s, None),
}


def pick_cost(servers: int) -> dict[str, float]:
    """Microseconds per pick of a trajectory already seen, per policy (a new one costs the hash the same)."""
    ids = [f"traj-{i:06d}-{random.getrandbits(32):08x}" for i in range(2000)]
    out = {}
    for name, make in POLICIES.items():
        policy = make([Box(f"http://vllm-{i}.vllm:8000/v1") for i in range(servers)])
        for trajectory in ids:
            policy.pick(trajectory)
        known = min(timeit.repeat(lambda p=policy: [p.pick(t) for t in ids], number=5, repeat=5)) / (5 * len(ids))
        out[name] = known * 1e6
    return out


@dataclass
class Stats:
    same: int = 0
    later_turns: int = 0
    imbalance_area: float = 0.0
    overload_time: float = 0.0
    busy_time: float = 0.0


def simulate(make: Policy, args: argparse.Namespace, seed: int) -> Stats:
    rng = random.Random(seed)
    urls = [f"http://vllm-{i}.vllm:8000/v1" for i in range(args.servers)]
    proxies = [make([Box(u) for u in urls]) for _ in range(2)]
    load = dict.fromkeys(urls, 0)  # calls on each server, all proxies together
    events: list[tuple[float, int, str, str, int]] = []  # (time, seq, kind, trajectory, turn)
    seq, now, handed = 0, 0.0, 0
    for i in range(args.trajectories):
        now += rng.expovariate(args.arrivals_per_s)
        heapq.heappush(events, (now, seq := seq + 1, "call", f"t{i}-{rng.getrandbits(40):x}", 0))
    last: dict[str, str] = {}
    running: dict[int, tuple[Box, str]] = {}
    stats, clock = Stats(), 0.0
    while events:
        at, key, kind, trajectory, n = heapq.heappop(events)
        mean = sum(load.values()) / len(load)
        if mean > 0:
            span = at - clock
            stats.busy_time += span
            stats.imbalance_area += span * max(load.values()) / mean
            stats.overload_time += span if max(load.values()) > 1.5 * mean + 1 else 0.0
        clock = at
        if kind == "call":
            proxy = proxies[handed % 2]  # the balancer: round-robin over the proxies, call by call
            handed += 1
            box = proxy.pick(trajectory)
            box.in_flight += 1
            load[box.url] += 1
            if n > 0:
                stats.later_turns += 1
                stats.same += last[trajectory] == box.url
            last[trajectory] = box.url
            running[key] = (box, trajectory)
            heapq.heappush(events, (at + rng.expovariate(1 / args.call_s), key, "done", trajectory, n))
        else:
            box, _ = running.pop(key)
            box.in_flight -= 1
            load[box.url] -= 1
            if n + 1 < args.turns:
                think = rng.expovariate(1 / args.think_s)
                heapq.heappush(events, (at + think, seq := seq + 1, "call", trajectory, n + 1))
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=4000)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--arrivals-per-s", type=float, default=8.0, help="new trajectories per second")
    parser.add_argument("--call-s", type=float, default=1.0, help="mean seconds a call runs")
    parser.add_argument("--think-s", type=float, default=0.5, help="mean seconds between a reply and the next turn")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()

    print("1. cost of a pick (µs per call, a trajectory already seen; blake2b per server for the hash)")
    for servers in (2, 4, 8):
        costs = pick_cost(servers)
        shown = "  ".join(f"{name}: {us:.2f}" for name, us in costs.items())
        print(f"   {servers} servers  {shown}", flush=True)

    mean_calls = args.arrivals_per_s * args.turns * args.call_s
    print(f"\n2. two proxies behind round-robin, {args.servers} servers, {args.trajectories} trajectories x "
          f"{args.turns} turns, ~{mean_calls:.0f} calls in flight on average ({args.seeds} seeds)")  # fmt: skip
    started = time.perf_counter()
    for name, make in POLICIES.items():
        runs = [simulate(make, args, seed) for seed in range(args.seeds)]
        same = sum(r.same for r in runs) / sum(r.later_turns for r in runs)
        imbalance = sum(r.imbalance_area for r in runs) / sum(r.busy_time for r in runs)
        overload = sum(r.overload_time for r in runs) / sum(r.busy_time for r in runs)
        print(f"   {name:28s} same server as the previous turn {same:6.1%}   busiest / mean {imbalance:5.2f}   "
              f"time over 1.5 x mean + 1 {overload:6.1%}", flush=True)  # fmt: skip
    print(f"   ({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
