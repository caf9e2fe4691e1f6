"""Disk after a long run: a simulated day of training steps, with retention and without.

Each simulated step goes through the real paths, only faster than a real day:
- ``--calls-per-step`` calls captured through ``Store.record_call`` (the demo's rate: 1,720 calls in
  34 steps is ~50 a step, ~80-token prompts) and rewarded;
- the trainer's save of a real LoRA (``Learner.save``: the tiny model of tests/tiny_model.py, LoRA r=16
  on every projection, after one real step so ``optimizer.pt`` holds AdamW's moments), the adapter's
  record (``Adapters.record``, with its files as the resolver needs them, or none: by path);
- the publisher's moves in the store (claimed, published, the alias flipped, the version beyond the
  window retired) and the trainer's retention (``trainer._retention.retain``: prune, sweep).

"before" keeps everything and records the files in the store, as every version did before retention;
"after" is retention with K = ``--keep-versions``, by path (what ``tracetrain serve`` runs) and by
resolver (files in the store). Printed every ``--every`` steps: bytes of the adapter directories, of
the store's stored files and calls, and the bound (K + 2) x one version's files + the calls.

    python bench/disk.py --steps 1000                   # ~a day of the demo's steps (one per ~15 s: 5,760)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from store import CallWrite, RewardIn, Store
from trainer import CapturedCall, Learner, TrainConfig, TrainItem, build_samples
from trainer._adapters import files_for_store
from trainer._retention import retain

CONFIG = TrainConfig(lora_r=16, lora_alpha=32, dtype="float32", micro_batch_tokens=512)


def learner(model_dir: Path) -> Learner:
    """A LoRA on the tiny model after one real step: its optimizer state is AdamW's two moments per weight."""
    held = Learner(model_dir, CONFIG)
    calls = [CapturedCall(list(range(5, 40)), list(range(40, 60)), [-1.0] * 20)]
    (sample,), _ = build_samples(calls)
    held.step([TrainItem(sample, 1.0), TrainItem(sample, -1.0)])
    return held


def _call(trajectory_id: str, k: int) -> CallWrite:
    now = time.time()
    prompt = [(k * 31 + i) % 50000 for i in range(80)]
    completion = [(k * 17 + i) % 50000 for i in range(24)]
    row = {
        "id": f"c-{trajectory_id}", "trajectory_id": trajectory_id, "group_id": "g", "policy": "agent",
        "endpoint": "chat.completions", "model": "agent", "served_model": "agent@1", "version": 1, "stream": False,
        "request": {"model": "agent", "messages": [{"role": "user", "content": "What is the capital of Peru? " * 4}],
                    "max_tokens": 64},
        "response": {"choices": [{"message": {"role": "assistant", "content": '{"answer": "Lima"}'}}]},
        "prompt_token_ids": prompt, "completion_token_ids": completion,
        "logprobs": [-((i * 7919) % 1000) / 997.0 for i in completion], "other_choices": [], "finish_reason": "stop",
        "prompt_tokens": 80, "completion_tokens": 24, "status_code": 200, "error": None, "latency_ms": 900.0,
        "ttft_ms": None, "started_at": now,
    }  # fmt: skip
    return CallWrite(row, trajectory_id, "g", "agent", "header", None, None, now, 1)


async def _publish(store: Store, version: int, keep: int) -> None:
    """What the proxy's publisher writes for a new version: claimed, published, flipped, the oldest retired."""
    for claimed, _ in await store.adapters.claim_trained("agent", "bench", 60.0):
        await store.adapters.published("agent", claimed, "bench")
        await store.policies.flip("agent", claimed, forward_only=True)
    if version - keep >= 1:
        await store.adapters.retired("agent", version - keep)


def _tree(path: Path) -> int:
    return sum(os.lstat(os.path.join(d, f)).st_size for d, _, files in os.walk(path) for f in files)


def _store_bytes(db: Path) -> tuple[int, int]:
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        rows = dict(conn.execute(
            "SELECT m.tbl_name, sum(d.pgsize) FROM dbstat d JOIN sqlite_master m ON m.name = d.name GROUP BY 1"
        ).fetchall())  # fmt: skip
    return int(rows.get("calls", 0)), int(rows.get("adapter_files", 0))


async def run(name: str, root: Path, held: Learner, args: argparse.Namespace, *, keep: int | None, files: bool,
              steps: int) -> dict[str, Any]:  # fmt: skip
    data = root / name
    adapters = data / "adapters" / "agent"
    store = await Store.open(f"sqlite+aiosqlite:///{data / 'tracetrain.db'}")
    await store.policies.ensure("agent", "tiny")
    t0 = time.perf_counter()
    version_bytes = 0
    rows = []
    for step in range(1, steps + 1):
        for k in range(args.calls_per_step):
            await store.record_call(_call(f"s{step}-{k}", k), alone=True)
        await store.add_rewards([RewardIn(f"s{step}-{k}", 1.0) for k in range(args.calls_per_step)])
        out = adapters / str(step)
        held.save(out, {"step": step})
        version_bytes = version_bytes or _tree(out)
        await store.adapters.record("agent", step, str(out), None, {"step": step},
                                    files_for_store(out) if files else [])  # fmt: skip
        await _publish(store, step, keep or args.keep_versions)
        if keep is not None:
            await retain(store, "agent", adapters, keep)
        if step % args.every == 0 or step == steps:
            calls, stored = _store_bytes(data / "tracetrain.db")
            on_disk = _tree(adapters)
            bound = (keep or 0) + 2
            rows.append((step, on_disk, stored, calls, on_disk + stored - bound * version_bytes))
            print(f"  {name:16} step {step:5}: adapters {on_disk / 2**20:8.1f} MiB, stored files "
                  f"{stored / 2**20:8.1f} MiB, calls {calls / 2**20:6.1f} MiB"
                  + (f"; versions' files - (K + 2) x one version = {rows[-1][4] / 2**20:+.1f} MiB" if keep else ""),
                  flush=True)  # fmt: skip
    await store.close()
    elapsed = time.perf_counter() - t0
    shutil.rmtree(data)
    return {"version_bytes": version_bytes, "rows": rows, "seconds": elapsed}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--before-steps", type=int, default=100, help="steps without retention (it grows linearly)")
    p.add_argument("--calls-per-step", type=int, default=50)
    p.add_argument("--keep-versions", type=int, default=3)
    p.add_argument("--every", type=int, default=100)
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the tests' tiny model
    from tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        held = learner(build_tiny_model(root / "tiny-model"))
        results = {}
        for name, keep, files, steps in (("before", None, True, args.before_steps),
                                         ("after (by path)", args.keep_versions, False, args.steps),
                                         ("after (resolver)", args.keep_versions, True, args.steps)):  # fmt: skip
            results[name] = asyncio.run(run(name, root, held, args, keep=keep, files=files, steps=steps))
    one = results["after (by path)"]["version_bytes"]
    print(f"one version's files: {one / 2**10:.0f} KiB (optimizer.pt included); K = {args.keep_versions}")
    for name, result in results.items():
        step, on_disk, stored, calls, _ = result["rows"][-1]
        print(f"{name:16} after {step:5} steps: versions {(on_disk + stored) / 2**20:8.1f} MiB "
              f"({(on_disk + stored) / one:7.1f} versions' worth), calls {calls / 2**20:6.1f} MiB, "
              f"{result['seconds']:.0f} s")  # fmt: skip
    before = results["before"]["rows"][-1]
    per_step = (before[1] + before[2]) / before[0]
    print(f"before, extrapolated to {args.steps} steps: {per_step * args.steps / 2**20:.0f} MiB of versions "
          f"(grows {per_step / 2**10:.0f} KiB a step, without bound)")  # fmt: skip


if __name__ == "__main__":
    main()
