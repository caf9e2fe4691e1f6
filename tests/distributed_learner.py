"""One Learner step on the tiny model, run by tests/test_trainer_distributed.py, alone or under torchrun.

    python tests/distributed_learner.py MODEL_DIR OUT_DIR                                  # one process
    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed_learner.py MODEL_DIR OUT_DIR

Every rank writes OUT_DIR/rank{R}.safetensors (its LoRA weights after the step) and
OUT_DIR/rank{R}.json (the step's metrics). Under torchrun it then makes the step fail on
rank 1 only, records what each rank raised, takes one more good step and writes
OUT_DIR/rank{R}-after-failure.safetensors: the ranks must fail together and stay equal.

    python tests/distributed_learner.py MODEL_DIR OUT_DIR --shard                          # and under torchrun

``--shard`` (FSDP2 under torchrun; one process ignores it): a step, ``save`` to OUT_DIR/step1,
a new learner resumed from it (adapter and AdamW state), a second step, ``save`` to OUT_DIR/step2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from trainer import _distributed
from trainer._config import TrainConfig
from trainer._distributed import Ranks
from trainer._learner import Learner
from trainer._samples import Sample
from trainer._step import TrainItem

# Small micro-batches over shared prefixes: 9 micro-batches, so one rank gets 5, the other 4.
CONFIG = TrainConfig(lora_r=8, lora_alpha=16, learning_rate=1e-3, dtype="float32", micro_batch_tokens=32, seed=3)
GROUPS = 3


def batch() -> list[TrainItem]:
    """GRPO groups of 5 samples with one prompt each, and a trajectory split into 4 samples whose prompts extend
    each other (a template that drops earlier thinking): rows with shared prefixes laid once. Off-policy old
    log-probs, so the clip and ratio are exercised."""
    g = torch.Generator().manual_seed(0)
    items = []
    prompt = torch.randint(3, 1000, (6,), generator=g).tolist()
    for turn in range(4):
        completion = torch.randint(3, 1000, (5,), generator=g).tolist()
        old = (-7.0 + torch.randn(len(completion), generator=g)).tolist()
        sample = Sample([*prompt, *completion], [False] * len(prompt) + [True] * len(completion),
                        [0.0] * len(prompt) + old, 1, 0)  # fmt: skip
        items.append(TrainItem(sample, advantage=1.0 - turn))
        prompt = [*prompt, *completion[-2:], *torch.randint(3, 1000, (3,), generator=g).tolist()]
    for group in range(GROUPS):
        prompt = torch.randint(3, 1000, (10 + group,), generator=g).tolist()
        for k in range(5):
            completion = torch.randint(3, 1000, (6 + k,), generator=g).tolist()
            old = (-7.0 + torch.randn(len(completion), generator=g)).tolist()
            sample = Sample([*prompt, *completion], [False] * len(prompt) + [True] * len(completion),
                            [0.0] * len(prompt) + old, 1, 0)  # fmt: skip
            items.append(TrainItem(sample, advantage=float(k - 2) / 1.5))
    return items


def lora(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone().contiguous() for n, p in learner.model.named_parameters() if "lora_" in n}


def main(model_dir: Path, out: Path, *, shard: bool = False) -> None:
    group = Ranks.from_env()
    if group is not None:
        _distributed.start(group, "cpu")
    rank = 0 if group is None else group.rank
    if shard:
        sharded(model_dir, out, rank)
        _distributed.finish()
        return
    learner = Learner(model_dir, CONFIG)
    result = learner.step(batch())
    save_file(lora(learner), out / f"rank{rank}.safetensors")
    report: dict[str, Any] = {"result": result.to_dict()}
    if group is not None:
        if rank == 1:  # a failure in rank 1's forward only: out of memory, say
            learner._accumulate = _fail  # type: ignore[method-assign]
        try:
            learner.step(batch())
        except Exception as exc:
            report["failure"] = [type(exc).__name__, str(exc)]
        if rank == 1:
            del learner._accumulate
        learner.step(batch())
        save_file(lora(learner), out / f"rank{rank}-after-failure.safetensors")
        _distributed.finish()
    (out / f"rank{rank}.json").write_text(json.dumps(report))


def sharded(model_dir: Path, out: Path, rank: int) -> None:
    learner = Learner(model_dir, CONFIG, shard=True)
    first = learner.step(batch())
    learner.save(out / "step1", first.to_dict())  # rank 0 writes; a sharded rank 1 writes nothing
    if _distributed.rank_and_world()[1] > 1:
        _distributed.barrier()  # step1 is on disk before any rank reads it
    resumed = Learner(model_dir, CONFIG, adapter=out / "step1", shard=True)
    second = resumed.step(batch())
    resumed.save(out / f"step2-rank{rank}", second.to_dict())
    report = {"sharded": resumed.sharded, "restored_optimizer": resumed.restored_optimizer,
              "first": first.to_dict(), "second": second.to_dict()}  # fmt: skip
    (out / f"rank{rank}.json").write_text(json.dumps(report))


def _fail(*args: Any) -> None:
    raise RuntimeError("deliberate failure on rank 1")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), shard="--shard" in sys.argv[3:])
