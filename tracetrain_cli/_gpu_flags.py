"""serve's GPU flags as the plan takes them (``Overrides``), and the refusal of those that contradict each other.

Checked before anything is placed: a GPU named twice or not visible, a tensor-parallel size that does
not divide the attention heads, vLLM flags with ``--upstream``, ``--trainer-gpus`` with ``--no-train``.
``--share-gpu`` with ``--upstream`` is allowed: the proxy hands the GPU over with any vLLM started
with sleep mode and the dev endpoints (``_gpu_plan.py`` then plans the trainer beside it).
"""

from __future__ import annotations

from dataclasses import dataclass

from tracetrain_cli._gpu_estimate import ModelShape, PlanError, TrainerNeeds


@dataclass(frozen=True)
class Overrides:
    """serve's GPU flags; None (or 1 for data parallel) leaves the choice to the plan."""

    vllm_gpus: tuple[int, ...] | None = None
    trainer_gpus: tuple[int, ...] | None = None
    memory_fraction: float | None = None
    tensor_parallel: int | None = None
    data_parallel: int = 1
    share: bool | None = None
    trainer_shard: bool | None = None

    @property
    def forced(self) -> bool:
        return any(v is not None for v in (self.vllm_gpus, self.trainer_gpus, self.memory_fraction,
                                            self.tensor_parallel, self.share, self.trainer_shard))  # fmt: skip


def check_overrides(
    order: list[int], model: ModelShape, trainer: TrainerNeeds | None, vllm: bool, shared: bool, o: Overrides
) -> None:
    """Refuse overrides that contradict each other or what runs."""
    if o.data_parallel != 1:
        raise PlanError(
            f"--data-parallel-size {o.data_parallel}: vLLM data parallel is not supported yet (POST "
            "/v1/load_lora_adapter reaches one engine only, so the others would serve stale adapters); use "
            "--tensor-parallel-size, or start one vLLM server per GPU group yourself and name each with --upstream"
        )
    for flag, indices in (("--vllm-gpus", o.vllm_gpus), ("--trainer-gpus", o.trainer_gpus)):
        if unknown := [i for i in indices or () if i not in order]:
            raise PlanError(
                f"{flag}: no GPU {', '.join(map(str, unknown))} among the visible GPUs "
                f"{', '.join(map(str, order))} (nvidia-smi's indices)"
            )
        if indices is not None and len(set(indices)) != len(indices):
            raise PlanError(f"{flag} names a GPU twice")
    if not vllm and (o.vllm_gpus or o.tensor_parallel or o.memory_fraction is not None):
        raise PlanError(
            "--vllm-gpus, --tensor-parallel-size and --gpu-memory-utilization place the vLLM child, and with "
            "--upstream serve starts none: drop them or --upstream"
        )
    if trainer is None and o.trainer_gpus:
        raise PlanError("--trainer-gpus with --no-train: drop one of them")
    if o.share and trainer is None:
        raise PlanError(
            "--share-gpu needs both a vLLM (the child, or yours with --upstream) and the trainer: drop it, or drop "
            "--no-train"
        )
    if o.share is False and trainer is not None and vllm and len(order) == 1:
        raise PlanError(
            "--no-share-gpu with one GPU: vLLM and the trainer cannot each have one; add a GPU, pass "
            "--share-gpu, or run the trainer elsewhere (--no-train)"
        )
    if o.memory_fraction is not None and not 0 < o.memory_fraction <= 1:
        raise PlanError(f"--gpu-memory-utilization {o.memory_fraction}: a fraction of each GPU, in (0, 1]")
    tp = o.tensor_parallel or (len(o.vllm_gpus) if o.vllm_gpus else None)
    if tp is not None and not model.valid_tp(tp):
        sizes = [t for t in range(1, max(8, len(order)) + 1) if model.valid_tp(t)]
        raise PlanError(
            f"tensor parallel {tp} (--tensor-parallel-size, or as many as --vllm-gpus names): vLLM splits the "
            f"model's {model.heads} attention heads ({model.kv_heads} KV heads) evenly; use one of "
            f"{', '.join(map(str, sizes))}"
        )
    if o.vllm_gpus and o.tensor_parallel is not None and o.tensor_parallel < len(o.vllm_gpus):
        raise PlanError(
            f"--vllm-gpus names {len(o.vllm_gpus)} GPUs but --tensor-parallel-size is {o.tensor_parallel}: the "
            "rest would need vLLM data parallel, which is not supported; name as many GPUs as the size"
        )
    if trainer is not None and o.trainer_gpus and len(o.trainer_gpus) != trainer.procs:
        raise PlanError(
            f"--trainer-gpus names {len(o.trainer_gpus)} GPU(s) but the trainer runs {trainer.procs} "
            "process(es), one per GPU: name as many GPUs as --trainer-procs"
        )
    both = set(o.vllm_gpus or ()) & set(o.trainer_gpus or ())
    if both and not shared:
        raise PlanError(
            f"GPU {', '.join(map(str, sorted(both)))} is in both --vllm-gpus and --trainer-gpus: pass --share-gpu "
            "(vLLM then sleeps around each training step) or name different GPUs"
        )
    if shared and o.vllm_gpus and o.trainer_gpus and not both:
        raise PlanError(
            "--share-gpu, but --vllm-gpus and --trainer-gpus have no GPU in common: name one in both, or drop "
            "--share-gpu"
        )
