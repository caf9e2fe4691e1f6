"""The training step: a peft LoRA on a Hugging Face causal LM, one AdamW step per rewarded batch.

The learner only orchestrates: the samples come from ``trainer._samples``, the
advantages from ``trainer._advantages`` (the caller's), the loss from ``trainer._losses``,
packing and chunked log-probs from ``trainer._logprobs``, the peft model from ``trainer._lora``
and adapter files from ``trainer._adapters``. It knows no store and no HTTP; the worker feeds it.

One step: the batch's samples are packed into micro-batches of at most
``cfg.micro_batch_tokens`` tokens (one row each, no padding: the samples' prefix tree, so a
prefix they share is forwarded once, ``trainer._prefix_tree``); each micro-batch's loss is
its share of the whole batch's loss (``policy_loss``'s ``batch_tokens`` /
``batch_sequences``), so the accumulated gradient equals the gradient of the batch taken
at once. Then the global gradient norm is clipped and AdamW steps once.

Under torchrun (``trainer._distributed``) each rank takes every world-th micro-batch of
the same packing, and the ranks' gradients and metric totals are summed before the clip:
N ranks take the step one process would, and hold the same LoRA afterwards. With ``shard``
the base and the LoRA are split over the ranks instead (FSDP2, ``trainer._sharded``): the
gradients are summed in FSDP's reduce-scatter, and rank 0 gathers the adapter to write it.
The attention kernel is ``trainer._attention``'s choice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from peft import PeftModel
from torch import Tensor
from transformers import PreTrainedModel

from trainer import _sharded
from trainer._adapters import load_optimizer_state, write_adapter_dir
from trainer._attention import choose_attention
from trainer._config import TrainConfig
from trainer._distributed import all_or_none, max_over_ranks, rank_and_world, sum_over_ranks, sum_totals
from trainer._grammar import GrammarMasks, SpanMasks
from trainer._logprobs import PackedRow, pack_row
from trainer._lora import load_lora_model, load_lora_weights, precision
from trainer._losses import logprob_mismatch, policy_loss
from trainer._prefix_tree import pack_tree
from trainer._samples import Sample, pack
from trainer._step import PeakMemoryKind, StepResult, TrainItem, check_item

log = logging.getLogger("tracetrain.trainer")


class Learner:
    """A LoRA being trained with GRPO (or a variant) from token-level samples.

    ``cfg.dtype``: "auto" loads bfloat16 weights on a CUDA device that supports
    bfloat16 and float32 everywhere else. On a CPU bf16 is opt-in ("bfloat16": float32
    weights under bf16 autocast) because its speed depends on the CPU: with AMX or
    AVX512-BF16 it ran 3x faster than float32 for SmolLM2 (DESIGN.md), without them it
    can be slower, and float32 keeps log-probs exact enough to compare with vLLM's.
    The LoRA weights and AdamW state are float32 in every case (peft upcasts the adapter).

    ``adapter``: a peft LoRA directory to continue training (a resumed step directory
    or an SFT warm start). Its own LoRA settings (rank, alpha, targets) then win over
    ``cfg``'s; AdamW's state is restored when the directory has one (see ``save``).

    ``attn_implementation``: "auto" (or None) lets ``trainer._attention.choose_attention`` pick:
    flash_attention_2 on CUDA in half precision when flash_attn is installed, else sdpa. A
    name forces it. Each kernel reads a row's prefix tree its own way (a mask, or flash-attn's
    variable-length sequences with gathered keys): the step is the same.

    ``shard``: under torchrun, split the base and the LoRA over the ranks (FSDP2) instead of
    each rank holding the whole model; for a base that does not fit one device. Every rank
    must then call ``step`` and ``logprobs`` together; ``save`` writes on rank 0 only.

    >>> learner = Learner(Path("models/SmolLM2-135M-Instruct"), TrainConfig())  # doctest: +SKIP
    >>> result = learner.step(items)  # doctest: +SKIP
    >>> learner.save(root / str(step), result.to_dict())  # doctest: +SKIP
    """

    def __init__(
        self,
        base_model: Path,
        cfg: TrainConfig,
        *,
        adapter: Path | None = None,
        device: str = "cpu",
        attn_implementation: str | None = None,
        shard: bool = False,
    ) -> None:
        self.device = torch.device(device)
        weights_dtype, self._autocast = precision(cfg.dtype, self.device)
        float32 = weights_dtype == torch.float32 and not self._autocast
        self.correction = cfg.resolved_correction(learner_float32=float32, cuda=self.device.type == "cuda")
        self.cfg = cfg  # saved as given; what "auto" resolved to is in each step's metrics (sampler_correction)
        self.attention = choose_attention(attn_implementation or "auto", self.device, weights_dtype)
        rank, world = rank_and_world()
        self.sharded = shard and world > 1
        if rank == 0:
            log.info("attention: %s (%s)%s", self.attention.implementation, self.attention.why,
                     f"; the model sharded over {world} ranks (FSDP)" if self.sharded else "")  # fmt: skip
            log.info("computing in %s; vLLM samples in %s; sampler correction: %s",
                     "float32" if float32 else "bfloat16", cfg.sampler_dtype, self.correction)  # fmt: skip
        with torch.random.fork_rng(devices=[]):  # LoRA init is seeded without touching the caller's RNG
            torch.manual_seed(cfg.seed)
            model = load_lora_model(base_model, cfg, adapter=adapter, dtype=weights_dtype,
                                    attention=self.attention.load_as())  # fmt: skip
        causal_lm = cast(PreTrainedModel, model.get_base_model())
        lm_head = causal_lm.get_output_embeddings()  # type: ignore[no-untyped-call]  # unannotated upstream
        if not isinstance(lm_head, torch.nn.Linear):
            raise NotImplementedError(f"expected a causal LM with a linear lm_head, got {type(lm_head).__name__}")
        self._vocab = int(lm_head.weight.shape[0])
        self._grammars = GrammarMasks(base_model, self._vocab)  # built on the first constrained sample
        self._scorer = _sharded.Scorer(causal_lm, cfg.logprob_chunk_tokens)
        if self.sharded:
            _sharded.shard(self._scorer, self.device)  # each rank keeps its shard, on its device
        else:
            model.to(self.device)
        self.model: PeftModel = model
        trainable = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        self._param_names = [name for name, _ in trainable]
        self._params = [p for _, p in trainable]
        self.optimizer = torch.optim.AdamW(self._params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        place = (lambda saved: _sharded.shard_optimizer_state(saved, self._params)) if self.sharded else None
        self.restored_optimizer = adapter is not None and load_optimizer_state(
            adapter, self.optimizer, self._param_names, cfg, place
        )
        self._gathered: tuple[dict[str, Tensor], dict[str, Any]] | None = None  # sharded: the adapter, on rank 0
        # A fresh LoRA's weights, kept (on the CPU) to switch back to a policy that has no adapter yet.
        self._fresh = None if adapter is not None else [p.detach().to("cpu", copy=True) for p in self._params]

    def switch(self, adapter: Path | None) -> bool:
        """Hold ``adapter``'s LoRA and AdamW state instead (None: a fresh LoRA), keeping the base in memory: how
        one trainer moves between policies. False, and nothing changed, when it cannot be done in place (a
        sharded learner, another LoRA shape, a fresh LoRA that this learner never held): build a new learner."""
        if self.sharded:
            return False
        if adapter is None:
            if self._fresh is None:
                return False
            with torch.no_grad():
                for param, fresh in zip(self._params, self._fresh, strict=True):
                    param.copy_(fresh)
        elif not load_lora_weights(self.model, adapter):
            return False
        self.optimizer = torch.optim.AdamW(self._params, lr=self.cfg.learning_rate, weight_decay=self.cfg.weight_decay)
        self.restored_optimizer = adapter is not None and load_optimizer_state(
            adapter, self.optimizer, self._param_names, self.cfg
        )
        return True

    def step(self, batch: Sequence[TrainItem]) -> StepResult:
        """One optimizer step over the whole batch; samples without sampled tokens are skipped.

        Raises ValueError for a malformed item (lengths that disagree, a temperature that is not
        positive, a NaN old logprob, a token id outside the vocabulary, a sampled first token,
        a non-finite advantage) or a batch with no sampled tokens at all (a step over nothing
        would still decay weights). An infinite old logprob is not an error: the log-ratio clamp
        bounds it (vLLM writes -inf as -9999.0).
        """
        start = time.perf_counter()
        for k, item in enumerate(batch):
            check_item(item, k, self._vocab)
        items = [item for item in batch if item.sample.loss_tokens > 0]
        if not items:
            raise ValueError("the batch has no sampled tokens to train on")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        samples = [item.sample for item in items]
        loss_tokens = sum(s.loss_tokens for s in samples)
        masks, fallbacks, mask_ms = self._grammars.spans(samples)
        micro_batches = self._pack(samples)
        rank, world = rank_and_world()  # (0, 1) in a single process
        mine = micro_batches[rank::world]  # this rank's share; every rank packed the same list
        # Sharded, every forward gathers weights in collectives: a rank short of micro-batches repeats one, unweighted.
        padding = _sharded.padding_rounds(len(micro_batches), len(mine), world) if self.sharded else 0

        self.model.train()
        totals = dict.fromkeys(("loss", "clipped", "ratio", "kl", "entropy", "mismatch", "clamped", "weight",
                                "over_cap", "on_policy_mismatch", "on_policy_tokens", "forwarded",
                                "constrained_mismatch", "constrained_tokens"), 0.0)  # fmt: skip
        mismatch_max = 0.0
        try:
            with all_or_none():  # several ranks: one failing rank fails the step on all of them
                for members in mine:
                    mismatch_max = max(
                        mismatch_max, self._accumulate(items, samples, members, loss_tokens, totals, masks)
                    )
                for _ in range(padding):
                    self._accumulate(items, samples, micro_batches[0], loss_tokens, None, masks)
            if world > 1:
                # Each rank's loss is its share: SUM is the batch's. Sharded, FSDP's reduce-scatter summed the grads.
                totals = sum_totals(totals) if self.sharded else sum_over_ranks(self._params, totals)
                mismatch_max = max_over_ranks(mismatch_max)
            norm = torch.nn.utils.clip_grad_norm_(self._params, self.cfg.max_grad_norm)
            grad_norm = float(_sharded.full(norm))
            if math.isfinite(grad_norm):
                self.optimizer.step()
        finally:  # a failed step leaves no gradient behind for the next one to add to
            self.optimizer.zero_grad(set_to_none=True)
        if self.sharded:
            self._gather_for_save(rank)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        result = self._result(totals, mismatch_max, grad_norm, samples, micro_batches=len(micro_batches),
                              seconds=seconds)  # fmt: skip
        constrained, others = totals["constrained_tokens"], totals["on_policy_tokens"] - totals["constrained_tokens"]
        return dataclasses.replace(
            result,
            constrained_tokens=sum(s.constrained_tokens for s in samples),
            constrained_samples=sum(bool(s.grammars) for s in samples),
            logprob_mismatch_constrained=totals["constrained_mismatch"] / constrained if constrained else None,
            logprob_mismatch_unconstrained=(
                (totals["on_policy_mismatch"] - totals["constrained_mismatch"]) / others if others else None
            ),
            grammar_fallbacks=fallbacks,
            mask_ms=mask_ms,
        )

    def _gather_for_save(self, rank: int) -> None:
        """Sharded: every rank gathers the adapter and AdamW's state; rank 0 keeps them for ``save``."""
        gathered = (_sharded.gather_lora(list(zip(self._param_names, self._params, strict=True))),
                    _sharded.gather_optimizer_state(self.optimizer))  # fmt: skip
        self._gathered = gathered if rank == 0 else None

    def _result(self, totals: Mapping[str, float], mismatch_max: float, grad_norm: float, samples: Sequence[Sample],
                *, micro_batches: int, seconds: float) -> StepResult:  # fmt: skip
        """The step's report from the metrics its micro-batches summed (per-token means over its loss tokens)."""
        loss_tokens = sum(s.loss_tokens for s in samples)
        tokens = sum(len(s.token_ids) for s in samples)
        peak, kind = self._peak_memory()
        return StepResult(
            loss=totals["loss"],
            clip_fraction=totals["clipped"] / loss_tokens,
            ratio_mean=totals["ratio"],
            kl=totals["kl"] if self.cfg.kl_coef > 0 else None,
            entropy=totals["entropy"] / loss_tokens,
            grad_norm=grad_norm,
            step_skipped=not math.isfinite(grad_norm),
            logprob_mismatch_mean=totals["mismatch"] / loss_tokens,
            logprob_mismatch_max=mismatch_max,
            log_ratio_clamped=int(totals["clamped"]),
            logprob_mismatch_on_policy=(
                totals["on_policy_mismatch"] / totals["on_policy_tokens"] if totals["on_policy_tokens"] else None
            ),
            sampler_correction=self.correction,
            sampler_weight_mean=totals["weight"] / loss_tokens,
            sampler_over_cap=totals["over_cap"] / loss_tokens,
            tokens=tokens,
            forwarded_tokens=int(totals["forwarded"]),
            forwarded_per_sampled_token=totals["forwarded"] / loss_tokens,
            loss_tokens=loss_tokens,
            samples=len(samples),
            micro_batches=micro_batches,
            seconds=seconds,
            tokens_per_second=tokens / seconds,
            peak_memory_bytes=peak,
            peak_memory_kind=kind,
        )

    def _accumulate(self, items: Sequence[TrainItem], samples: Sequence[Sample], members: list[int],
                    loss_tokens: int, totals: dict[str, float] | None,
                    masks: Sequence[SpanMasks]) -> float:  # fmt: skip
        """Forward and backward one micro-batch (``members`` index ``samples``); adds its metrics to ``totals``.

        Returns the micro-batch's largest |trainer - sampler| log-prob. ``totals`` None: a sharded
        rank's padding round, whose forward and backward join the collectives with a loss weight of 0.
        """
        row = self._row(samples, members, loss_only=True, masks=masks)
        ref_logp = None
        if self.cfg.kl_coef > 0:
            with torch.no_grad(), self.model.disable_adapter(), self._precision_context():
                ref_logp, _ = self._score(row)  # (L,)
        with self._precision_context():
            logp, entropy = self._score(row)  # (L,), (L,)
        old_logp = self._gather([samples[i].old_logprobs for i in members], row)  # (L,)
        advantages = torch.tensor([items[i].advantage for i in members], device=self.device)[row.seq]  # (L,)
        loss, m = policy_loss(
            logp,
            old_logp,
            advantages,
            torch.ones_like(row.seq, dtype=torch.bool),  # (L,) every scored token is a sampled one
            row.seq,
            self.cfg,
            ref_logp=ref_logp,
            batch_tokens=loss_tokens,
            batch_sequences=len(samples),
            correction=self.correction,
        )
        if totals is None:
            torch.autograd.backward(loss * 0.0)
            return 0.0
        torch.autograd.backward(loss)
        totals["forwarded"] += row.tokens
        ratio_weight = m["sequences"] / len(samples) if self.cfg.loss == "gspo" else m["tokens"] / loss_tokens
        totals["loss"] += m["loss"]
        totals["clipped"] += m["clip_fraction"] * m["tokens"]
        totals["ratio"] += m["ratio_mean"] * ratio_weight
        totals["kl"] += m.get("kl", 0.0)
        totals["entropy"] += float(entropy.sum())
        # Every micro-batch's forward runs before the one optimizer step: this is the pre-update mismatch.
        totals["mismatch"] += m["logprob_mismatch_mean"] * m["tokens"]
        totals["clamped"] += m["log_ratio_clamped"]
        totals["weight"] += m["sampler_weight_mean"] * m["tokens"]
        on_policy = torch.tensor([items[i].on_policy for i in members], device=self.device)[row.seq]  # (L,) bool
        gap = logprob_mismatch(logp[on_policy], old_logp[on_policy])
        totals["on_policy_mismatch"] += gap.mean * gap.tokens
        totals["on_policy_tokens"] += gap.tokens
        if row.constrained is not None:
            constrained = on_policy & row.constrained  # (L,) bool
            gap = logprob_mismatch(logp[constrained], old_logp[constrained])
            totals["constrained_mismatch"] += gap.mean * gap.tokens
            totals["constrained_tokens"] += gap.tokens
        totals["over_cap"] += m["sampler_over_cap"] * m["tokens"]
        return float(m["logprob_mismatch_max"])

    @torch.no_grad()
    def logprobs(self, samples: Sequence[Sample]) -> list[Tensor]:
        """Each sample's per-token log-probs under the current policy (eval mode), float32 on the CPU.

        Entry t is log p(token t | tokens < t) at the token's temperature (``Sample.temperatures``,
        1.0 when empty); entry 0, which has no prefix, is 0.0 (as
        ``Sample.old_logprobs`` is where nothing was sampled). Packed like a training step.
        """
        was_training = self.model.training
        self.model.eval()
        try:
            out = [torch.zeros(len(s.token_ids)) for s in samples]
            masks, _, _ = self._grammars.spans(samples)
            for members in self._pack(samples):
                row = self._row(samples, members, loss_only=False, masks=masks)
                if row.targets.numel() == 0 and not self.sharded:  # only one-token samples: nothing to score
                    continue
                with self._precision_context():
                    logp, _ = self._score(row)  # (P,)
                logp, seq, offset = logp.cpu(), row.seq.cpu(), row.offset.cpu()
                for k, i in enumerate(members):
                    out[i][offset[seq == k]] = logp[seq == k]
            return out
        finally:
            self.model.train(was_training)

    def save(self, out_dir: Path, metrics: Mapping[str, Any]) -> None:
        """Publish the adapter, ``trainer_config.json``, ``metrics.json`` and ``optimizer.pt`` at ``out_dir``.

        Written to a temporary directory beside it and renamed, so the directory appears
        complete or not at all; raises FileExistsError if ``out_dir`` already exists. Sharded: rank 0
        writes what it gathered at the end of the last step; the other ranks write nothing.
        """
        if not self.sharded:
            write_adapter_dir(out_dir, self.model, self.optimizer, self._param_names, self.cfg, metrics)
            return
        if rank_and_world()[0] != 0:
            return
        if self._gathered is None:
            raise RuntimeError("a sharded learner saves what its last step gathered, and it has taken no step")
        lora, optimizer = self._gathered
        write_adapter_dir(out_dir, self.model, self.optimizer, self._param_names, self.cfg, metrics,
                          lora_state=lora, optimizer_state=optimizer)  # fmt: skip

    def _pack(self, samples: Sequence[Sample]) -> list[list[int]]:
        """Micro-batches: samples that share a prefix together, each shared prefix laid once (``share_prefix``)."""
        if self.cfg.share_prefix:
            return pack_tree([s.token_ids for s in samples], self.cfg.micro_batch_tokens)
        return pack(samples, self.cfg.micro_batch_tokens)

    def _row(self, samples: Sequence[Sample], members: Sequence[int], *, loss_only: bool,
             masks: Sequence[SpanMasks]) -> PackedRow:  # fmt: skip
        return pack_row(samples, members, loss_only=loss_only, device=self.device,
                        share_prefix=self.cfg.share_prefix, varlen=self.attention.varlen, masks=masks)  # fmt: skip

    def _score(self, row: PackedRow) -> tuple[Tensor, Tensor]:
        logp, entropy = self._scorer(row)  # (P,), (P,)
        return logp, entropy

    def _gather(self, per_sample: Sequence[Sequence[float]], row: PackedRow) -> Tensor:
        """Per-token values of the row's members, taken at its scored tokens: (P,) float32."""
        flat = torch.tensor([v for values in per_sample for v in values], dtype=torch.float32)  # (T,)
        starts = torch.tensor([0, *(len(v) for v in per_sample)]).cumsum(0)[:-1]  # (S,)
        return flat[starts[row.seq.cpu()] + row.offset.cpu()].to(self.device)  # (P,)

    def _precision_context(self) -> contextlib.AbstractContextManager[Any]:
        if self._autocast:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _peak_memory(self) -> tuple[int | None, PeakMemoryKind | None]:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device), "cuda_max_allocated"
        if sys.platform == "win32":
            return None, None
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return (rss if sys.platform == "darwin" else rss * 1024), "process_max_rss"
