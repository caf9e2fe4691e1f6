"""Samples laid as one prefix tree: each shared prefix forwarded once, every sample trained as if alone.

A reasoning template drops earlier turns' thinking when it renders the history, so each call of a
trajectory becomes a sample of its own whose prompt extends the prompts before it but not their
sampled thinking (``split_trajectory`` builds one from hand-made ids, through ``build_samples``).
References are each sample forwarded alone: the plain transformers forward, or the learner with
``share_prefix=False``. The flash-attention layout is checked with a stand-in for flash-attn's
varlen kernel (no GPU here): the row, the gathered keys and the causal alignment are ours, the
kernel's arithmetic is torch's.
"""

from __future__ import annotations

import importlib.machinery
import random
import sys
import types
from pathlib import Path

import pytest
import torch
from test_trainer_learner import gradients_of_step, reference_logprobs, with_old_logprobs
from torch import Tensor
from transformers import AutoModelForCausalLM

from trainer import _learner
from trainer._attention import Attention
from trainer._config import TrainConfig
from trainer._learner import Learner
from trainer._logprobs import chunked_logprobs, hidden_states, pack_row
from trainer._prefix_tree import lay_out, pack_tree, shared_prefix, tree_tokens
from trainer._samples import CapturedCall, Sample, build_samples
from trainer._step import TrainItem

CPU = torch.device("cpu")
THINK_END, STOP = 1001, 1002  # the tiny model's 1026 ids: random text stays below 1000


def split_trajectory(turns: int, seed: int) -> list[Sample]:
    """A reasoning agent's trajectory whose template drops each earlier turn's thinking: one sample per call."""
    g = torch.Generator().manual_seed(seed)

    def ids(low: int, high: int) -> list[int]:
        n = int(torch.randint(low, high + 1, (1,), generator=g))
        return torch.randint(0, 1000, (n,), generator=g).tolist()

    prompt = ids(10, 14)  # the system prompt and the task
    calls = []
    for _ in range(turns):
        answer = ids(2, 4)
        completion = [*ids(4, 8), THINK_END, *answer, STOP]  # thinking, then the answer (a tool call)
        calls.append(CapturedCall(prompt, completion, [-1.0] * len(completion)))
        prompt = [*prompt, *answer, STOP, *ids(3, 6)]  # the answer re-rendered without its thinking, the tool's result
    samples, stats = build_samples(calls)
    assert (stats.samples, stats.split_rerendered) == (turns, turns - 1)
    return samples


def test_a_prefix_tree_holds_each_shared_prefix_once_and_every_sample_whole() -> None:
    samples = [s.token_ids for s in split_trajectory(6, seed=1)]
    layout = lay_out(samples)
    # The last prompt holds every earlier one: the tree is it plus each call's completion.
    completions = sum(len(s) - shared_prefix(s, samples[-1]) for s in samples[:-1])
    assert len(layout.ids) == tree_tokens(samples) == len(samples[-1]) + completions < sum(map(len, samples))
    assert layout.shared
    for k, tokens in enumerate(samples):
        where = layout.where[k]
        assert [layout.ids[j] for j in where] == tokens
        assert [layout.positions[j] for j in where] == list(range(len(tokens)))
        for t, j in enumerate(where):  # what each token may attend to is exactly its sample's tokens up to it
            segment = next(s for s in layout.segments if s.start <= j < s.end)
            keys = layout.keys(segment)
            assert keys[: len(keys) - (segment.end - j) + 1] == where[: t + 1]
    starts, ends = [s.start for s in layout.segments], [s.end for s in layout.segments]
    assert starts == [0, *ends[:-1]] and ends[-1] == len(layout.ids)  # the segments cut the row in order


def test_the_shared_prefix_of_two_samples_is_counted_token_for_token() -> None:
    rng = random.Random(1)
    for _ in range(2000):
        base = [rng.randrange(3) for _ in range(rng.randrange(70))]
        a, b = ([*base[: rng.randrange(len(base) + 1)], *(rng.randrange(3) for _ in range(rng.randrange(4)))]
                for _ in range(2))  # fmt: skip
        expected = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert shared_prefix(a, b) == expected, (a, b)


def test_samples_laid_whole_are_end_to_end_with_positions_restarting() -> None:
    samples = [[1, 2, 3], [1, 2, 4]]
    layout = lay_out(samples, share=False)
    assert layout.ids == [1, 2, 3, 1, 2, 4] and layout.positions == [0, 1, 2, 0, 1, 2]
    assert not layout.shared and all(s.fork == -1 for s in layout.segments)
    assert lay_out([[1, 2], [1, 2, 3]]).segments == lay_out([[1, 2, 3]]).segments  # an extension continues its run


def test_micro_batches_never_exceed_the_budget_nor_lose_a_sample() -> None:
    rng = random.Random(0)
    for _ in range(50):
        roots = [[rng.randrange(50) for _ in range(rng.randrange(1, 30))] for _ in range(3)]
        samples = [rng.choice(roots)[: rng.randrange(0, 30)] + [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
                   for _ in range(rng.randrange(1, 12))]  # fmt: skip
        budget = rng.randrange(5, 80)
        rows = pack_tree(samples, budget)
        assert sorted(i for row in rows for i in row) == list(range(len(samples)))
        for row in rows:
            assert row == sorted(row)
            assert len(row) == 1 or tree_tokens([samples[i] for i in row]) <= budget
    with pytest.raises(ValueError, match="at least 1"):
        pack_tree([[1]], 0)
    assert pack_tree([], 10) == []


def test_a_split_trajectory_fits_one_row_at_the_cost_of_its_tree() -> None:
    samples = [s.token_ids for s in split_trajectory(5, seed=2)]
    assert pack_tree(samples, tree_tokens(samples)) == [list(range(5))]
    rows = pack_tree(samples, tree_tokens(samples) - 1)
    assert len(rows) == 2  # one token short: the next row lays the prefix its samples need again


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_each_sample_of_a_split_trajectory_scores_in_the_tree_as_alone(tiny_model_dir: Path, attn: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32, attn_implementation=attn)
    model.eval()
    samples = split_trajectory(5, seed=3)
    row = pack_row(samples, range(5), loss_only=False, device=CPU)
    assert row.tokens == tree_tokens([s.token_ids for s in samples]) and row.attention_mask is not None
    with torch.no_grad():
        logp, _ = chunked_logprobs(hidden_states(model, row), row.targets, model.get_output_embeddings(), 16)
    for k, s in enumerate(samples):
        # log-probs near -7: float32 sums in another order differ by ~1e-6
        torch.testing.assert_close(logp[row.seq == k], reference_logprobs(model, s.token_ids)[0], rtol=0, atol=1e-5)

    # The check has teeth: the same row under plain causal attention lets later branches see earlier ones.
    with torch.no_grad():
        crossed = model.get_decoder()(input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False)
        crossed_logp = chunked_logprobs(crossed.last_hidden_state[0][row.score_at], row.targets,
                                        model.get_output_embeddings(), 16)[0]  # fmt: skip
    assert float((crossed_logp - logp).abs().max()) > 1e-2


def trajectory_batch(learner: Learner) -> list[TrainItem]:
    """Two split trajectories of one group (advantages +-1) and their on-policy old log-probs, made off-policy."""
    samples = [*split_trajectory(4, seed=4), *split_trajectory(3, seed=5)]
    items = with_old_logprobs(learner, samples, [1.0] * 4 + [-1.0] * 3)
    return [TrainItem(Sample(i.sample.token_ids, i.sample.loss_mask, [v * 0.9 for v in i.sample.old_logprobs], 1, 0),
                      i.advantage) for i in items]  # fmt: skip


def assert_same_step(shared: Learner, alone: Learner, items: list[TrainItem], rtol: float = 1e-5) -> tuple[int, int]:
    """The two learners' steps agree in loss, metrics and every LoRA gradient; returns their forwarded tokens."""
    for learner in (shared, alone):  # the same LoRA, with B off zero so that every LoRA matrix gets a gradient
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for _, p in sorted((n, p) for n, p in learner.model.named_parameters() if p.requires_grad):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    (a, grads_a), (b, grads_b) = gradients_of_step(shared, items), gradients_of_step(alone, items)
    assert a.clip_fraction > 0
    for key in ("loss", "clip_fraction", "ratio_mean", "entropy", "grad_norm", "logprob_mismatch_mean"):
        assert getattr(a, key) == pytest.approx(getattr(b, key), rel=rtol, abs=rtol / 100), key
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, grad in grads_b.items():
        # float32 gradients summed in another order differ by ulps of the terms, not of the result: the
        # absolute tolerance follows the tensor's largest gradient (a lost or doubled sample is off by ~1)
        atol = 10 * rtol * float(grad.abs().max())
        torch.testing.assert_close(grads_a[name], grad, rtol=10 * rtol, atol=atol, msg=name)
    assert (a.tokens, a.loss_tokens) == (b.tokens, b.loss_tokens)
    return a.forwarded_tokens, b.forwarded_tokens


def shared_and_alone(model_dir: Path, cfg: TrainConfig) -> tuple[Learner, Learner]:
    return Learner(model_dir, cfg), Learner(model_dir, cfg.model_copy(update={"share_prefix": False}))


def test_a_step_over_split_trajectories_equals_each_sample_forwarded_alone(tiny_model_dir: Path) -> None:
    cfg = TrainConfig(lora_r=8, dtype="float32", micro_batch_tokens=4096)
    shared, alone = shared_and_alone(tiny_model_dir, cfg)
    items = trajectory_batch(shared)
    samples = [i.sample.token_ids for i in items]
    forwarded, forwarded_alone = assert_same_step(shared, alone, items)
    assert forwarded == tree_tokens(samples)  # each trajectory's last prompt and its completions, once
    assert forwarded_alone == sum(map(len, samples)) > 1.5 * forwarded
    result = shared.step(items)
    assert result.forwarded_per_sampled_token == pytest.approx(forwarded / result.loss_tokens)


def test_a_tree_cut_over_several_micro_batches_still_equals_the_step_alone(tiny_model_dir: Path) -> None:
    cfg = TrainConfig(lora_r=8, dtype="float32", micro_batch_tokens=60)
    shared, alone = shared_and_alone(tiny_model_dir, cfg)
    items = trajectory_batch(shared)
    samples = [i.sample.token_ids for i in items]
    assert len(shared._pack([i.sample for i in items])) > 2
    forwarded, forwarded_alone = assert_same_step(shared, alone, items)
    assert tree_tokens(samples) < forwarded < forwarded_alone  # each row lays the prefix its samples need


def reference_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
    dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
) -> Tensor:  # fmt: skip
    """flash_attn_varlen_func's contract in torch: each sequence alone, causal from the bottom right, GQA."""
    assert causal and dropout_p == 0.0 and q.dtype in (torch.float16, torch.bfloat16)  # flash's own limits
    assert window_size == (-1, -1) and softcap == 0.0  # what a Llama asks (no sliding window, no soft cap)
    heads, out = q.shape[1], []
    for (q0, q1), (k0, k1) in zip(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True),
                                  zip(cu_k[:-1].tolist(), cu_k[1:].tolist(), strict=True), strict=True):  # fmt: skip
        assert q1 - q0 <= max_q and k1 - k0 <= max_k
        qs, ks, vs = q[q0:q1].float(), k[k0:k1].float(), v[k0:k1].float()  # (Lq, H, D), (Lk, Hkv, D)
        ks, vs = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (ks, vs))  # (Lk, H, D)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * softmax_scale  # (H, Lq, Lk)
        allowed = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril(diagonal=(k1 - k0) - (q1 - q0))
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", weights, vs).to(q.dtype))
    return torch.cat(out)  # (T, H, D)


@pytest.fixture
def fake_flash_attn(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A flash_attn module whose varlen kernel is ``reference_varlen``; counts its calls."""
    calls: list[int] = []
    module = types.ModuleType("flash_attn")
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)

    def varlen(*args: object, **kwargs: object) -> Tensor:
        calls.append(1)
        return reference_varlen(*args, **kwargs)  # type: ignore[arg-type]

    module.flash_attn_varlen_func = varlen  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return calls


def test_the_flash_layout_gathers_each_segments_path_and_scores_as_alone(
    tiny_model_dir: Path, fake_flash_attn: list[int]
) -> None:
    name = Attention("flash_attention_2", "a stand-in kernel").load_as()
    flash = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.bfloat16, attn_implementation=name)
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.bfloat16, attn_implementation="sdpa")
    samples = [*split_trajectory(4, seed=6), *split_trajectory(2, seed=7)]
    row = pack_row(samples, range(6), loss_only=False, device=CPU, varlen=True)
    assert row.attention_mask is None and row.varlen is not None
    assert row.tokens == tree_tokens([s.token_ids for s in samples])
    with torch.no_grad():
        logp, _ = chunked_logprobs(hidden_states(flash, row), row.targets, flash.get_output_embeddings(), 64)
    assert len(fake_flash_attn) == flash.config.num_hidden_layers  # every layer ran the varlen kernel
    for k, s in enumerate(samples):
        expected = reference_logprobs(plain, s.token_ids)[0]
        # bf16 activations: two kernels' roundings differ by a few bf16 ulps of values near -7 (2^-5 each)
        torch.testing.assert_close(logp[row.seq == k], expected, rtol=0, atol=0.1, msg=f"sample {k}")


def test_a_flash_step_over_split_trajectories_equals_the_flash_step_alone(
    tiny_model_dir: Path, fake_flash_attn: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The learner's flash branch: a model loaded as FLASH_TREE, varlen rows, attention cast to bf16 and back."""
    cfg = TrainConfig(lora_r=8, dtype="float32", micro_batch_tokens=4096)
    monkeypatch.setattr(_learner, "choose_attention", lambda *_: Attention("flash_attention_2", "a stand-in kernel"))
    shared, alone = shared_and_alone(tiny_model_dir, cfg)
    assert shared.model.config._attn_implementation == "tracetrain_varlen_tree"
    items = trajectory_batch(shared)
    forwarded, forwarded_alone = assert_same_step(shared, alone, items, rtol=1e-3)
    assert fake_flash_attn and forwarded == tree_tokens([i.sample.token_ids for i in items]) < forwarded_alone
