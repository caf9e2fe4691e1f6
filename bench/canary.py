"""Canary trials on live traffic: how much a bad version serves, and how soon a trial decides.

    .venv/bin/python bench/canary.py [--trials 20] [--fractions 0.5 0.1] [--traffic grouped ungrouped mixed]
        [--no-guard] [--out results.json]

Real parts but the model: the fake vLLM (tests/fake_vllm.py) in this process; the real proxy
(``create_app``: the gateway's split, the publisher, the canary, the SQLite store) on loopback,
a fresh one per trial; an agent of asyncio tasks speaking HTTP. Each group is one task attempted
8 times (``X-Group-Id``); the agent starts a group every ``--pace`` seconds, and each attempt's
reward is posted ``--reward-delay`` seconds (uniform) after its answer: rewards arrive late and
unevenly. Each attempt is rewarded by the version that served it:

- ``bad``: the version on trial earns 0, the version before it a Bernoulli(0.6) draw;
- ``equal``: both a Bernoulli(0.6) draw.

Traffic (``--traffic``): ``grouped``, each tick one task attempted 8 times; ``ungrouped``, each
tick 8 conversations each its own group (the canary compares them within time windows);
``mixed``, the two ticks in turn. A wrong verdict: the bad version promoted, the equal one rolled
back; each kind's count is printed.

A trial: after 6 s of traffic on @0, version 1 is recorded as trained, the publisher puts it on
trial against @0, the agent plays until the trial ends. Measured per trial, from its start to its
verdict: the attempts the version on trial served (the users who met it), its share of the
trial's trajectories, the rewards posted meanwhile (all, and the candidate's), the rewards in the
groups the verdict used, and the wall time. Beside it, the same bad version without a canary
(fraction "none"): it serves everything at once until the regression guard rolls it back. The
canary's and the guard's settings are serve's defaults (margin 0.05, alpha 0.05, 3 to 8 groups).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fake_vllm import FakeVLLM, serve_in_thread

from proxy import Settings, create_app

TASK = [{"role": "user", "content": "Which city does Ana need a hotel in?"}]
GROUP = 8
TRAFFIC = ("grouped", "ungrouped", "mixed")
GUARD_ALONE = "none (the regression guard alone)"


@dataclass
class Trial:
    scenario: str
    fraction: float | None  # None: no canary, the regression guard alone
    verdict: str
    decided_by: str
    paired_groups: int  # without a canary: the groups of the new version the guard looked at
    attempts_on_trial: int  # attempts the version on trial answered, all told
    share_on_trial: float  # of the trial's trajectories, those the version on trial served
    rewards_posted: int  # before the verdict
    rewards_on_trial: int  # of those, the version on trial's
    rewards_in_evidence: int  # in the paired groups the verdict used (grouped traffic; else 0: windows vary)
    seconds: float  # trial start to verdict
    traffic: str = "grouped"


class Agent:
    """Groups of attempts against the proxy; rewards posted late, by the version that served each attempt."""

    def __init__(self, url: str, scenario: str, rng: random.Random, pace_s: float, delay_s: tuple[float, float],
                 traffic: str = "grouped"):  # fmt: skip
        self.url, self.scenario, self.rng, self.traffic = url, scenario, rng, traffic
        self.pace_s, self.delay_s = pace_s, delay_s
        self.posted: list[tuple[float, int]] = []  # (when, version) of each reward posted
        self.served: list[tuple[float, int]] = []  # (when, version) of each attempt's answer
        self._tasks: set[asyncio.Task[None]] = set()
        self._groups = 0

    def reward_of(self, version: int) -> float:
        if self.scenario == "bad" and version == 1:
            return 0.0
        return float(self.rng.random() < 0.6)

    async def run(self, client: httpx.AsyncClient) -> None:
        while True:
            self._groups += 1
            alone = self.traffic == "ungrouped" or (self.traffic == "mixed" and self._groups % 2 == 0)
            task = asyncio.create_task(self._group(client, f"g{self._groups}", alone))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            await asyncio.sleep(self.pace_s)

    async def _group(self, client: httpx.AsyncClient, group: str, alone: bool) -> None:
        await asyncio.gather(*(self._attempt(client, group, f"{group}-t{i}", alone) for i in range(GROUP)))

    async def _attempt(self, client: httpx.AsyncClient, group: str, trajectory: str, alone: bool = False) -> None:
        """One attempt; ``alone``: a conversation of its own, its group its own id."""
        headers = {"X-Group-Id": trajectory if alone else group, "X-Trajectory-Id": trajectory}
        answer = await client.post("/v1/chat/completions", json={"model": "agent", "messages": TASK}, headers=headers)
        version = int(answer.headers["x-policy-version"])
        self.served.append((time.time(), version))
        await asyncio.sleep(self.rng.uniform(*self.delay_s))
        posted = await client.post("/v1/rewards", json={"trajectory_id": trajectory, "reward": self.reward_of(version)})
        posted.raise_for_status()
        self.posted.append((time.time(), version))

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await task


async def one_trial(
    fake_url: str, scenario: str, fraction: float | None, seed: int, args: argparse.Namespace,
    traffic: str = "grouped",
) -> Trial:  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        # batch_groups: the most there is; no trial lasts that many groups, so none trains.
        settings = Settings(upstream=f"{fake_url}/v1", data_dir=data, canary=fraction, group_size=GROUP,
                            min_group_size=GROUP, batch_groups=1024, unload_grace_s=0)  # fmt: skip
        with serve_in_thread(create_app(settings)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                delay = (args.reward_delay[0], args.reward_delay[1])
                agent = Agent(url, scenario, random.Random(seed), args.pace, delay, traffic)
                playing = asyncio.create_task(agent.run(client))
                await asyncio.sleep(6.0)  # traffic on @0 first: the guard's baseline, trajectories begun before
                adapter = data / "adapters" / "agent" / "1"
                adapter.mkdir(parents=True)
                with sqlite3.connect(data / "tracetrain.db") as db:
                    db.execute("INSERT INTO adapters (policy, version, path, state, metrics, created_at) "
                               "VALUES ('agent', 1, ?, 'trained', '{}', ?)", (str(adapter), time.time()))  # fmt: skip
                ended = await (_ended(client, args.timeout) if fraction is not None else _guarded(client, args.timeout))
                playing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await playing
                await agent.stop()
    start, end = ended["started_at"], ended["ended_at"]
    during = [v for when, v in agent.posted if start <= when <= end]
    return Trial(scenario, fraction, ended["state"], ended["decided_by"], ended["n"],
                 sum(v == 1 for _, v in agent.served), ended["share"], len(during), sum(v == 1 for v in during),
                 GROUP * ended["n"] if traffic == "grouped" else 0, end - start, traffic)  # fmt: skip


async def _ended(client: httpx.AsyncClient, timeout_s: float) -> dict[str, Any]:
    """The trial, once it ended: its verdict, what decided it, its paired groups, the share on trial."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        data = (await client.get("/admin/trials")).json()["data"]
        if data and data[0]["state"] != "running":
            trial, record = data[0], data[0]["verdict"] or {}
            return {"state": trial["state"], "decided_by": trial["decided_by"], "started_at": trial["started_at"],
                    "ended_at": trial["ended_at"], "n": int((record.get("look") or {}).get("n") or 0),
                    "share": float((record.get("shares") or {}).get("candidate") or 0.0)}  # fmt: skip
        await asyncio.sleep(0.1)
    raise SystemExit(f"no verdict within {timeout_s} s")


async def _guarded(client: httpx.AsyncClient, timeout_s: float) -> dict[str, Any]:
    """Without a canary: version 1, published at once, until the regression guard rolls it back or keeps it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = (await client.get("/admin/adapters")).json()["data"]
        guard = rows[0].get("guard") or {} if rows else {}
        if guard.get("state") in ("rolled_back", "kept"):
            return {"state": guard["state"], "decided_by": "guard", "started_at": float(rows[0]["published_at"]),
                    "ended_at": time.time(), "n": int(guard.get("n") or 0), "share": 1.0}  # fmt: skip
        await asyncio.sleep(0.1)
    raise SystemExit(f"the regression guard decided nothing within {timeout_s} s")


def summary(trials: list[Trial]) -> dict[str, Any]:
    def stats(values: list[float]) -> dict[str, float]:
        return {"mean": statistics.fmean(values), "median": statistics.median(values), "min": min(values),
                "max": max(values)}  # fmt: skip

    verdicts: dict[str, int] = {}
    for t in trials:
        verdicts[f"{t.verdict} by {t.decided_by}"] = verdicts.get(f"{t.verdict} by {t.decided_by}", 0) + 1
    return {
        "trials": len(trials),
        "verdicts": verdicts,
        "share_on_trial": stats([t.share_on_trial for t in trials]),
        "paired_groups": stats([float(t.paired_groups) for t in trials]),
        "attempts_on_trial": stats([float(t.attempts_on_trial) for t in trials]),
        "rewards_in_evidence": stats([float(t.rewards_in_evidence) for t in trials]),
        "rewards_posted": stats([float(t.rewards_posted) for t in trials]),
        "rewards_on_trial": stats([float(t.rewards_on_trial) for t in trials]),
        "seconds": stats([t.seconds for t in trials]),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20, help="trials per scenario and fraction (default 20)")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.1], help="canary shares (default 0.5 0.1)")
    p.add_argument("--pace", type=float, default=0.5, help="seconds between two groups' first calls (default 0.5)")
    p.add_argument("--reward-delay", type=float, nargs=2, default=[0.5, 5.0], metavar=("MIN", "MAX"),
                   help="each reward is posted this many seconds after its answer, uniform (default 0.5 5)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a trial may take (default 300)")
    p.add_argument("--traffic", nargs="+", choices=TRAFFIC, default=["grouped"],
                   help="grouped, ungrouped (each conversation its own group), mixed (default grouped)")  # fmt: skip
    p.add_argument("--no-guard", action="store_true", help="leave out the bad version without a canary")
    p.add_argument("--out", type=Path, help="write every trial and the summary as JSON here")
    args = p.parse_args()
    fake = FakeVLLM(emit_eos=True)
    results: dict[str, Any] = {"args": {k: v if not isinstance(v, Path) else str(v) for k, v in vars(args).items()}}
    exposure: dict[str, float] = {}
    with serve_in_thread(fake.app) as fake_url:
        for traffic in args.traffic:
            alone = [] if args.no_guard or traffic != "grouped" else [None]
            for scenario, fractions in (("bad", [*args.fractions, *alone]), ("equal", args.fractions)):
                for fraction in fractions:
                    trials = [asyncio.run(one_trial(fake_url, scenario, fraction, seed, args, traffic))
                              for seed in range(args.trials)]  # fmt: skip
                    s = summary(trials)
                    name = f"{fraction:.2f}" if fraction is not None else GUARD_ALONE
                    results[f"{traffic} {scenario} {name}"] = {"summary": s, "trials": [asdict(t) for t in trials]}
                    if scenario == "bad":
                        exposure[f"{traffic} {name}"] = s["attempts_on_trial"]["mean"]
                    wrong = sum(t.verdict == ("promoted" if scenario == "bad" else "rolled_back") for t in trials)
                    evidence = f" = {s['rewards_in_evidence']['mean']:.1f} rewards" if traffic == "grouped" else ""
                    print(f"{traffic:9s} {scenario:5s} canary {name}: {s['verdicts']}; wrong verdicts {wrong} of "
                          f"{len(trials)}; attempts the new version answered {s['attempts_on_trial']['mean']:.1f} "
                          f"(max {s['attempts_on_trial']['max']:.0f}), its share of the trial's trajectories "
                          f"{s['share_on_trial']['mean']:.2f}; strata the verdict used "
                          f"{s['paired_groups']['mean']:.1f} (max {s['paired_groups']['max']:.0f}){evidence}; rewards "
                          f"posted before it {s['rewards_posted']['mean']:.1f} ({s['rewards_on_trial']['mean']:.1f} "
                          f"on trial); {s['seconds']['mean']:.1f} s (median {s['seconds']['median']:.1f}, max "
                          f"{s['seconds']['max']:.1f})", flush=True)  # fmt: skip
    if "grouped " + GUARD_ALONE in exposure:
        alone_attempts = exposure.pop("grouped " + GUARD_ALONE)
        for name, attempts in exposure.items():
            if name.startswith("grouped "):
                print(f"bad version's attempts, {name} canary / the guard alone: {attempts:.1f} / "
                      f"{alone_attempts:.1f} = {attempts / alone_attempts:.2f}")  # fmt: skip
        exposure["guard alone"] = alone_attempts
    results["exposure"] = exposure
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
