"""What one call costs on the proxy's call path itself, in process: chat, Responses and Messages, streamed or not.

``proxy_overhead.py`` measures the whole proxy over loopback HTTP, where a busy machine's noise is
larger than a change to the call path. This times ``Forwarder.handle`` alone: the body parsed and
validated (or translated), the version resolved, the call keyed and prepared, vLLM's answer (a real
vLLM 0.32 capture, ``tests/data/vllm_protocol``: 8 tokens with logprobs; streamed, 10 chunks)
captured, answered in the call's API and recorded; a stream relayed to its end. Only the outside is
stubbed: the upstream answers at once from memory, the keyer names a trajectory, the store takes the
record and returns. What is left is the Python of the call path, per call, in microseconds.

Each tree named by ``--tree NAME=PATH`` runs in its own process (its packages first on the path),
the trees alternating, ``--rounds`` times; the best round of each counts (noise only adds time).
Ratios are against the first tree. Run from the repository root:

    .venv/bin/python bench/call_path.py --tree before=../other-checkout --tree after=.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CAPTURES = REPO / "tests" / "data" / "vllm_protocol"
QUESTION = "What is the capital of France?"
CASES: dict[str, tuple[str, dict[str, Any]]] = {  # name -> (dialect, body)
    "chat": ("chat.completions", {"model": "agent", "messages": [{"role": "user", "content": QUESTION}]}),
    "responses": ("responses", {"model": "agent", "input": QUESTION}),
    "messages": ("messages", {"model": "agent", "max_tokens": 16, "messages": [{"role": "user", "content": QUESTION}]}),
}


# -- the worker: one tree, in its own process -------------------------------------------------------


class _Reply:
    def __init__(self, content: bytes) -> None:
        self.status_code, self.content = 200, content


class _Stream:
    def __init__(self, events: list[bytes]) -> None:
        self._events = iter(events)

    async def next_chunk(self) -> bytes:
        return next(self._events, b"")

    async def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Upstream:
    """A vLLM server that answers at once with a real vLLM 0.32 capture."""

    base_url = "http://vllm.invalid/v1"

    def __init__(self) -> None:
        self._answer = json.dumps(json.loads((CAPTURES / "chat_logprobs.json").read_text())["response"]).encode()
        chunks = json.loads((CAPTURES / "chat_logprobs_stream.json").read_text())["response"]
        self._events = [b"data: " + (c if isinstance(c, str) else json.dumps(c)).encode() + b"\n\n" for c in chunks]

    async def base_model(self) -> str:
        return "tiny"

    async def post(self, path: str, body: bytes) -> _Reply:
        return _Reply(self._answer)

    async def open_stream(self, path: str, body: bytes) -> _Stream:
        return _Stream(self._events)


class _Store:
    seats_with_records = False

    async def record_call(self, write: Any, alone: bool = False) -> None:
        pass

    def record_call_nowait(self, write: Any) -> None:
        pass


def _call_of(forwarder: Any) -> Any:
    """``handle(dialect, raw, hints)`` of this tree; a tree from before the one call path ran translated calls
    through ``proxy.gateway._translated`` (kept here to compare against it)."""
    try:
        import proxy.gateway.dialects  # noqa: F401  (the one call path)
    except ImportError:
        from proxy.gateway._messages import MESSAGES  # type: ignore[import-not-found]
        from proxy.gateway._responses import RESPONSES  # type: ignore[import-not-found]
        from proxy.gateway._translated import handle as translated  # type: ignore[import-not-found]

        dialects = {"responses": RESPONSES, "messages": MESSAGES}

        async def handle(dialect: str, raw: bytes, hints: Any) -> Any:
            if dialect in dialects:
                return await translated(forwarder, dialects[dialect], raw, hints)
            return await forwarder.handle(dialect, raw, hints)

        return handle
    return forwarder.handle


async def _time_cases(calls: int) -> dict[str, float]:
    from proxy.gateway import Forwarder, Key, KeyHints, PolicyRegistry
    from proxy.observability import Metrics

    class Keyer:
        async def resolve(self, policy: str, hints: Any, conversation: Any, **_: bool) -> Key:
            return Key("traj-bench", "grp-bench", "header", None)

        def served(self, trajectory_id: str, version: Any) -> None:
            pass

        def forget(self, trajectory_id: str) -> None:
            pass

    # A registry of the policy "agent" on the base "tiny": PolicyRegistry.of where a tree serves several policies.
    of = getattr(PolicyRegistry, "of", None)
    registry = of("agent", base_model="tiny") if of is not None else PolicyRegistry("agent", "tiny")
    forwarder = Forwarder(_Upstream(), _Store(), Keyer(), registry, Metrics())  # type: ignore[arg-type]
    handle, hints = _call_of(forwarder), KeyHints(header_trajectory="traj-bench")
    out: dict[str, float] = {}
    for name, (dialect, body) in CASES.items():
        for stream in (False, True):
            raw = json.dumps({**body, "stream": True} if stream else body).encode()
            for timed in (calls // 10, calls):  # a warm-up, then the timed calls
                t0 = time.perf_counter()
                for _ in range(timed):
                    response = await handle(dialect, raw, hints)
                    if stream:
                        async for _ in response.body_iterator:
                            pass
                        response._relay.close()
                    assert response.status_code == 200, response.body
            out[f"{name} {'stream' if stream else 'plain'}"] = (time.perf_counter() - t0) / calls * 1e6
    return out


# -- the parent: trees alternating -------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", required=True, metavar="NAME=PATH", help="a checkout to time")
    parser.add_argument("--calls", type=int, default=3000, help="timed calls per case and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every tree, alternating")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(asyncio.run(_time_cases(args.calls))))
        return
    trees = dict(tree.split("=", 1) for tree in args.tree)
    best: dict[str, dict[str, float]] = {name: {} for name in trees}
    for round_ in range(args.rounds):
        for name, path in trees.items():
            root = Path(path).resolve()
            env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'sdk'}"}
            argv = [sys.executable, __file__, "--worker", "--calls", str(args.calls), "--tree", f"{name}={root}"]
            result = json.loads(subprocess.run(argv, env=env, cwd=root, capture_output=True, text=True,
                                               check=True).stdout)  # fmt: skip
            for case, us in result.items():
                best[name][case] = min(us, best[name].get(case, us))
            print(f"round {round_ + 1} {name}: " + ", ".join(f"{c} {us:.1f}" for c, us in result.items()), flush=True)
    first = next(iter(trees))
    print(f"\nus per call, best of {args.rounds} rounds of {args.calls} calls (ratio to {first}):")
    print("| case | " + " | ".join(trees) + " |")
    print("|---|" + "---|" * len(trees))
    for case in best[first]:
        cells = [f"{best[n][case]:.1f} ({best[n][case] / best[first][case]:.2f}x)" for n in trees]
        print(f"| {case} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
