"""What the trainer pays to move from one policy to another: the LoRA swapped in place against a new learner.

One trainer trains every policy in turn (docs/POLICIES.md). Between two policies' steps it holds the
other policy's adapter: ``Learner.switch`` puts that adapter's LoRA weights and AdamW state into the
learner it holds (the base stays in memory), where the alternative builds a new ``Learner`` from the
adapter (the base read and set up again). Both end with the same weights (tests/test_policies_serve.py);
this measures the time of each, side by side, on the real model, several rounds, and prints the ratio.

    .venv/bin/python bench/policy_switch.py --model .tracetrain/models/smollm2-135m-instruct --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path(".tracetrain/models/smollm2-135m-instruct"))
    parser.add_argument("--rounds", type=int, default=5, help="switches (and builds) timed (default 5)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    from trainer import Learner, TrainConfig

    cfg = TrainConfig()  # the demo's LoRA: r=16 on every projection
    work = Path(tempfile.mkdtemp(prefix="tracetrain-switch-"))
    # Two policies' adapters, each saved with its AdamW state (what the trainer's step directories hold).
    learner = Learner(args.model, cfg, device=args.device)
    adapters = []
    for name in ("support", "sql"):
        learner.switch(None)
        with_state = _one_step(learner)
        learner.save(work / name, {"policy": name, "loss": with_state})
        adapters.append(work / name)

    switch_s, build_s = [], []
    for k in range(args.rounds):
        adapter = adapters[k % 2]
        started = time.perf_counter()
        assert learner.switch(adapter)
        switch_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        built = Learner(args.model, cfg, adapter=adapter, device=args.device)
        build_s.append(time.perf_counter() - started)
        del built
    switch, build = statistics.median(switch_s), statistics.median(build_s)
    print(f"model {args.model.name}, LoRA r={cfg.lora_r} on {len(cfg.target_modules)} projections, {args.device}, "
          f"{args.rounds} rounds (median)")  # fmt: skip
    print(f"  switch in place (Learner.switch)       {switch * 1e3:8.1f} ms")
    print(f"  a new learner from the adapter         {build * 1e3:8.1f} ms")
    print(f"  ratio                                  {build / switch:8.1f}x")
    return 0


def _one_step(learner: object) -> float:
    """One step on a small made-up batch, so that the saved adapter carries AdamW's moments."""
    from trainer import Sample, TrainItem

    ids = list(range(100, 164))
    mask = [False] * 32 + [True] * 32
    items = [TrainItem(Sample(ids, mask, [0.0] * 32 + [-2.0] * 32, 1, 0), advantage=a) for a in (1.0, -1.0)]
    return float(learner.step(items).loss)  # type: ignore[attr-defined]


if __name__ == "__main__":
    raise SystemExit(main())
