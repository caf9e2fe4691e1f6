"""Training on several processes: torchrun starts the ranks, rank 0 leads, gradients are summed.

    python -m trainer --procs 2 ...  --exec-->  python -m torch.distributed.run --standalone
                                                    --nproc-per-node 2 -m trainer ...
    rank 0: store -> claim, batch --broadcast--> every rank: Learner.step on micro_batches[rank::world]
                                                  --all_reduce(SUM) of LoRA grads and metric totals
                                                  --> the same clip and AdamW step on every rank
    rank 0: writes and records the adapter

The process group is initialised once per process (gloo on a CPU, nccl on CUDA with rank
k on ``cuda:{LOCAL_RANK}``). Every rank builds the same initial LoRA from
``TrainConfig.seed`` and applies the same summed gradient, so the LoRA stays identical on
every rank without ever being sent. Each rank's loss is already its share of the whole
batch's (normalised by the batch's token and sequence counts), so the SUM of the ranks'
gradients is the single-process gradient; only the order of the float additions differs.

Rank 0 alone talks to the store; the others wait for its word (``Load``, ``Step``,
``Idle``, ``Stop``) in ``broadcast_object_list``. ``Idle`` comes every poll while no job is
queued, and every quarter of the collective timeout while rank 0 waits for a shared GPU
(``trainer._handover``), so a waiting rank never reaches the timeout. A rank that dies makes
torchrun stop the others; the job's lease then runs out and a proxy queues it again.
With one process none of this runs: no process group, no broadcast.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from trainer._step import TrainItem


class StepFailed(RuntimeError):
    """A step failed on some rank; raised on every rank, so all of them give the job up together."""


@dataclass(frozen=True, slots=True)
class Ranks:
    """This process's place in torchrun's group (from its RANK, WORLD_SIZE and LOCAL_RANK)."""

    rank: int
    world: int
    local_rank: int

    @property
    def leads(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> Ranks | None:
        """The ranks torchrun set, or None outside torchrun or in a world of one."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return None
        return cls(int(os.environ["RANK"]), world, int(os.environ["LOCAL_RANK"]))


# What rank 0 says to the others. Each is one broadcast_object_list.
@dataclass(frozen=True, slots=True)
class Load:
    policy: str
    version: int  # load the learner at this adapter version of the policy, then join the barrier


@dataclass(frozen=True, slots=True)
class Step:
    policy: str
    version: int  # the adapter version of the policy to train on
    holds: tuple[str, int]  # the (policy, version) label of the weights every rank holds now (they are rank 0's)
    items: tuple[TrainItem, ...]


@dataclass(frozen=True, slots=True)
class Idle:
    pass


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Word = Load | Step | Idle | Stop


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ


def torchrun_command(procs: int, argv: Sequence[str], env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """``python -m trainer`` again under torchrun on ``procs`` processes, ``--procs`` taken out, and its env.

    torchrun would give each rank 1 thread (and warn); the ranks share this process's
    threads instead (``OMP_NUM_THREADS``, or every core when it is unset).
    """
    rest: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--procs":
            skip = True
        elif not arg.startswith("--procs="):
            rest.append(arg)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
               "-m", "trainer", *rest]  # fmt: skip
    threads = int(env.get("OMP_NUM_THREADS") or 0) or (os.cpu_count() or 1)
    return command, {**env, "OMP_NUM_THREADS": str(max(1, threads // procs))}


def start(ranks: Ranks, device: str, *, timeout_s: float | None = None) -> str:
    """Join the process group (once per process); returns the device this rank trains on.

    ``timeout_s``: how long a collective may wait for the other ranks (None: torch's default, 10 minutes).
    """
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    if device == "cpu":
        dist.init_process_group("gloo", rank=ranks.rank, world_size=ranks.world, timeout=timeout)
        return device
    if device != "cuda":
        raise ValueError(f"with several processes --device is cpu or cuda (rank k takes cuda:LOCAL_RANK), not {device}")
    cuda = torch.device("cuda", ranks.local_rank)
    torch.cuda.set_device(cuda)
    dist.init_process_group("nccl", rank=ranks.rank, world_size=ranks.world, device_id=cuda, timeout=timeout)
    return str(cuda)


def finish() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_and_world() -> tuple[int, int]:
    """(rank, world size); (0, 1) when no process group was started."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def tell(word: Word) -> None:
    """Rank 0: say ``word`` to every other rank."""
    dist.broadcast_object_list([word], src=0)


def listen() -> Word:
    """Ranks above 0: wait for rank 0's next word."""
    box: list[Word | None] = [None]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


def barrier() -> None:
    dist.barrier()


@contextlib.contextmanager
def all_or_none() -> Iterator[None]:
    """With several ranks: when the body fails on any rank, raise StepFailed on every rank.

    Without it, a rank that failed (out of memory, say) would leave the others waiting in
    the gradient all_reduce. With one process the body's error passes through untouched.
    """
    rank, world = rank_and_world()
    if world == 1:
        yield
        return
    error: Exception | None = None
    try:
        yield
    except Exception as exc:
        error = exc
    failed = torch.zeros(world, device=_collective_device())  # (world,)
    failed[rank] = float(error is not None)
    dist.all_reduce(failed)
    if bool(failed.any()):
        where = [k for k, flag in enumerate(failed.tolist()) if flag]
        why = f": {type(error).__name__}: {error}" if error is not None else " (its log says why)"
        raise StepFailed(f"the training step failed on rank {', '.join(map(str, where))}{why}") from error


def sum_over_ranks(params: Sequence[Tensor], totals: dict[str, float]) -> dict[str, float]:
    """Sum every rank's LoRA gradients (into each parameter's ``.grad``) and metric totals.

    One all_reduce of the flattened gradients: a rank that had no micro-batch joins with
    zeros. Each rank's loss is its share of the batch's loss, so SUM (not mean) gives
    exactly the gradient one process would have computed.
    """
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])  # (sum of numels,)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    for p, g in zip(params, torch.split(flat, [p.numel() for p in params]), strict=True):
        p.grad = g.view_as(p)
    return sum_totals(totals)


def sum_totals(totals: dict[str, float]) -> dict[str, float]:
    """Every rank's metric totals, summed (sharded training sums its gradients in FSDP's reduce-scatter)."""
    values = torch.tensor(list(totals.values()), dtype=torch.float64, device=_collective_device())  # (metrics,)
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return dict(zip(totals, values.tolist(), strict=True))


def max_over_ranks(value: float) -> float:
    """The largest of every rank's ``value`` (a per-token maximum is not a sum)."""
    peak = torch.tensor([value], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak.item())


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
