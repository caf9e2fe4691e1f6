"""Bytes per call on a multi-turn trace, whole rows (the encoding before compact capture) against compact rows.

Both stores are written through the real path (``Store.record_call``, the group-commit writer on
SQLite) with the same calls: ``--trajectories`` conversations of ``--turns`` turns whose prompt grows
to ``--max-prompt`` tokens (a system prompt, then per turn a user message and a reply of equal size).
"whole" is the same code with its memory of previous calls turned off (``Chains(max_tokens=0)``):
every row stores its whole prompt ids and messages, as before revision 0007.

Each side runs in a fresh process, twice, alternating; printed side by side (the median of the two),
with the ratio whole / compact:
- bytes per call of the ``calls`` table (SQLite's pages, ``dbstat``) and of the database file;
- the time to record a call;
- the time to read a trajectory (``Reads.trajectory``, what the data API and the dashboard call);
- the time to read a step's trajectories and build its training samples (``Jobs.rewarded_trajectories``
  then ``trainer._samples.build_samples``: what the trainer does).
- what binary token arrays (4-byte integers) would take instead of JSON, for the ids alone.

    python bench/capture_bytes.py                    # 50 trajectories x 20 turns to 4k tokens
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

import orjson

from store import CallWrite, RewardIn, Store
from store._compact import Chains
from trainer import CapturedCall, build_samples

_WORDS = ("the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from",
          "it", "be", "this", "are", "or", "an")  # fmt: skip


def _text(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(tokens))  # ~1 token per word


def trace(rng: random.Random, turns: int, max_prompt: int) -> list[tuple[list[dict[str, Any]], list[int], list[int]]]:
    """One conversation: (messages, prompt ids, completion ids) per call, the prompt growing to ``max_prompt``."""
    step = max_prompt // (turns + 1) // 2  # tokens of a user message, and of a reply
    system = max_prompt - 2 * step * turns + step
    messages: list[dict[str, Any]] = [{"role": "system", "content": _text(rng, system)}]
    ids = [rng.randrange(1000, 50000) for _ in range(system)]
    calls = []
    for _ in range(turns):
        messages = [*messages, {"role": "user", "content": _text(rng, step)}]
        ids = ids + [rng.randrange(1000, 50000) for _ in range(step)]
        completion = [rng.randrange(1000, 50000) for _ in range(step)]
        calls.append((messages, ids, completion))
        messages = [*messages, {"role": "assistant", "content": _text(rng, step)}]
        ids = ids + completion
    return calls


def write(
    trajectory_id: str, k: int, messages: list[dict[str, Any]], prompt: list[int], completion: list[int]
) -> CallWrite:
    now = time.time()
    row = {
        "id": f"{trajectory_id}-{k}", "trajectory_id": trajectory_id, "group_id": "g-" + trajectory_id,
        "policy": "agent", "endpoint": "chat.completions", "model": "agent", "served_model": "agent@1", "version": 1,
        "stream": False, "request": {"model": "agent", "messages": messages, "temperature": 1.0},
        "response": {"id": "chatcmpl-x", "choices": [{"index": 0, "message": {"role": "assistant", "content": "..."},
                                                      "finish_reason": "stop"}]},
        "prompt_token_ids": prompt, "completion_token_ids": completion,
        "logprobs": [-((i * 7919) % 1000) / 997.0 for i in completion],  # full-length floats, as vLLM's
        "other_choices": [], "finish_reason": "stop",
        "prompt_tokens": len(prompt), "completion_tokens": len(completion), "status_code": 200, "error": None,
        "latency_ms": 12.5, "ttft_ms": None, "started_at": now + k * 1e-3,
    }  # fmt: skip
    return CallWrite(row, trajectory_id, "g-" + trajectory_id, "agent", "header", None, None, now, 1)


async def run_one(path: Path, traces: list[Any], *, compact: bool, reads: int) -> dict[str, float]:
    store = await Store.open(f"sqlite+aiosqlite:///{path}")
    if not compact:
        store.chains = Chains(max_tokens=0)  # no memory of previous calls: every row whole, as before 0007
    record_s = []
    for t, calls in enumerate(traces):
        for k, (messages, prompt, completion) in enumerate(calls):
            w = write(f"t{t}", k, messages, prompt, completion)
            t0 = time.perf_counter()
            await store.record_call(w, alone=True)
            record_s.append(time.perf_counter() - t0)
    await store.add_rewards([RewardIn(f"t{t}", float(t % 2)) for t in range(len(traces))])
    n_calls = sum(len(c) for c in traces)
    read_s = []
    for i in range(reads):
        t0 = time.perf_counter()
        record = await store.reads.trajectory(f"t{i % len(traces)}")
        read_s.append(time.perf_counter() - t0)
        assert record is not None and len(record.calls) == len(traces[0])
    sample_s = []
    for _ in range(max(1, reads // 10)):
        t0 = time.perf_counter()
        stored = await store.jobs.rewarded_trajectories([f"g-t{t}" for t in range(len(traces))], policy="agent")
        for trajectory in stored:
            build_samples([CapturedCall(c.prompt_token_ids, c.completion_token_ids, c.logprobs, c.status_code)
                           for c in trajectory.calls])  # fmt: skip
        sample_s.append(time.perf_counter() - t0)
    # Every reader sees the same ids in both encodings.
    check = await store.reads.trajectory("t0")
    assert check is not None
    assert [c["prompt_token_ids"] for c in check.calls] == [p for _, p, _ in traces[0]]
    assert [c["request"]["messages"] for c in check.calls] == [m for m, _, _ in traces[0]]
    await store.close()
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        calls_bytes = conn.execute(
            "SELECT sum(pgsize) FROM dbstat WHERE name IN (SELECT name FROM sqlite_master WHERE tbl_name = 'calls')"
        ).fetchone()[0]
        ids_json = conn.execute("SELECT sum(length(prompt_token_ids)) FROM calls").fetchone()[0]
        ids_binary = sum(len(array("i", orjson.loads(r[0])).tobytes()) for r in conn.execute(
            "SELECT prompt_token_ids FROM calls"))  # fmt: skip
    return {
        "calls_table_bytes_per_call": calls_bytes / n_calls,
        "file_bytes_per_call": path.stat().st_size / n_calls,
        "prompt_ids_json_bytes_per_call": ids_json / n_calls,
        "prompt_ids_binary_bytes_per_call": ids_binary / n_calls,
        "record_ms_median": statistics.median(record_s) * 1000,
        "read_trajectory_ms_median": statistics.median(read_s) * 1000,
        "read_and_build_samples_ms_median": statistics.median(sample_s) * 1000,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trajectories", type=int, default=50)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--max-prompt", type=int, default=4096, help="tokens of the last call's prompt (default 4096)")
    p.add_argument("--reads", type=int, default=100, help="trajectory reads timed (default 100)")
    p.add_argument("--only", choices=["whole", "compact"], help=argparse.SUPPRESS)  # one side, in a child process
    args = p.parse_args(argv)
    rng = random.Random(0)
    traces = [trace(rng, args.turns, args.max_prompt) for _ in range(args.trajectories)]
    if args.only is not None:
        with tempfile.TemporaryDirectory() as tmp:
            result = asyncio.run(run_one(Path(tmp) / "store.db", traces, compact=args.only == "compact",
                                         reads=args.reads))  # fmt: skip
        print(json.dumps(result))
        return
    last = traces[0][-1][1]
    print(
        f"{args.trajectories} trajectories x {args.turns} turns, prompts {len(traces[0][0][1])} -> {len(last)} tokens"
    )
    # Each side in a fresh process of its own (a second run in one process measured 2x slower reads, whichever
    # encoding it was: the first one's heap), twice in alternation; the median of the two is printed.
    runs: dict[str, list[dict[str, float]]] = {"whole": [], "compact": []}
    for name in ("whole", "compact", "compact", "whole"):
        child = [sys.executable, __file__, "--only", name, *(argv if argv is not None else sys.argv[1:])]
        runs[name].append(json.loads(subprocess.run(child, check=True, capture_output=True, text=True).stdout))
    results = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    print(f"{'':36} {'whole':>12} {'compact':>12} {'whole/compact':>14}")
    for key in results["whole"]:
        whole, compact = results["whole"][key], results["compact"][key]
        print(f"{key:36} {whole:12.2f} {compact:12.2f} {whole / compact:14.2f}")


if __name__ == "__main__":
    main()
