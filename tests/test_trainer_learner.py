"""The training step on the tiny random Llama: packing, chunked log-probs, LoRA updates, adapter files.

Reference values come from the plain transformers forward (full logits, one sample at a time),
never from the code under test.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from trainer._adapters import newest_adapter
from trainer._config import TrainConfig
from trainer._learner import Learner
from trainer._logprobs import chunked_logprobs, hidden_states, pack_row
from trainer._samples import Sample
from trainer._step import StepResult, TrainItem

VOCAB = 1000  # the tiny model has 1026 tokens; random ids stay below the special ones


def sample(n: int, prompt: int, seed: int) -> Sample:
    """n random tokens, the first `prompt` of them a prompt; old logprobs filled in by `with_old_logprobs`."""
    ids = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return Sample(ids, [False] * prompt + [True] * (n - prompt), [0.0] * n, 1, 0)


def with_old_logprobs(learner: Learner, samples: list[Sample], advantages: list[float]) -> list[TrainItem]:
    """Items whose old logprobs are the learner's own: an on-policy batch (ratio 1)."""
    items = []
    for s, logp, adv in zip(samples, learner.logprobs(samples), advantages, strict=True):
        old = [v if m else 0.0 for v, m in zip(logp.tolist(), s.loss_mask, strict=True)]
        items.append(TrainItem(Sample(s.token_ids, s.loss_mask, old, 1, 0), adv))
    return items


def batch(learner: Learner, advantages: list[float] | None = None) -> list[TrainItem]:
    advantages = advantages if advantages is not None else [1.0, -1.0, 0.5, -0.5, 1.5, -1.5]
    samples = [sample(20 + 3 * k, 8 + k, seed=k) for k in range(len(advantages))]
    return with_old_logprobs(learner, samples, advantages)


def lora_state(learner: Learner) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in learner.model.named_parameters() if "lora_" in n}


def base_state(learner: Learner) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in learner.model.named_parameters() if "lora_" not in n}


def reference_logprobs(model: torch.nn.Module, ids: list[int]) -> tuple[Tensor, Tensor]:
    """Full-logits log-probs of tokens 1.. of one sequence, and the entropy before each: (n - 1,) each."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()  # (n - 1, V)
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


# --- packing and chunked log-probs ----------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_sample_packed_beside_others_scores_as_it_does_alone(tiny_model_dir: Path, attn: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32, attn_implementation=attn)
    model.eval()
    lm_head = model.get_output_embeddings()
    samples = [sample(17, 5, seed=1), sample(23, 5, seed=2), sample(9, 5, seed=3)]

    def score(members: list[int]) -> Tensor:
        row = pack_row(samples, members, loss_only=False, device=torch.device("cpu"))
        with torch.no_grad():
            logp, _ = chunked_logprobs(hidden_states(model, row), row.targets, lm_head, 1024)
        return logp[row.seq == members.index(1)]  # sample 1's tokens

    alone = score([1])
    torch.testing.assert_close(alone, reference_logprobs(model, samples[1].token_ids)[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(score([0, 1, 2]), alone, rtol=0, atol=1e-5)

    # The check has teeth: the same row without position restarts lets sample 1 attend to sample 0.
    joined = Sample(samples[0].token_ids + samples[1].token_ids, [False] * 40, [0.0] * 40, 1, 0)
    row = pack_row([joined], [0], loss_only=False, device=torch.device("cpu"))
    with torch.no_grad():
        crossed = chunked_logprobs(hidden_states(model, row), row.targets, lm_head, 1024)[0][-22:]
    assert (crossed - alone).abs().max() > 1e-2


def group(prompt_len: int, completions: list[int], seed: int) -> list[Sample]:
    """A GRPO group: samples that share a prompt and differ after it."""
    prompt = sample(prompt_len, prompt_len, seed=seed).token_ids
    out = []
    for k, n in enumerate(completions):
        rest = sample(n, 0, seed=seed * 100 + k).token_ids
        out.append(Sample(prompt + rest, [False] * prompt_len + [True] * n, [0.0] * (prompt_len + n), 1, 0))
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_group_sharing_its_prompt_scores_each_sample_as_alone(tiny_model_dir: Path, attn: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32, attn_implementation=attn)
    model.eval()
    lm_head = model.get_output_embeddings()
    samples = group(12, [6, 9, 4], seed=5)
    row = pack_row(samples, [0, 1, 2], loss_only=False, device=torch.device("cpu"))
    assert row.input_ids.shape[1] == 12 + 6 + 9 + 4  # the prompt once
    assert row.attention_mask is not None
    with torch.no_grad():
        logp, _ = chunked_logprobs(hidden_states(model, row), row.targets, lm_head, 7)
    for k, s in enumerate(samples):
        expected = reference_logprobs(model, s.token_ids)[0]
        torch.testing.assert_close(logp[row.seq == k], expected, rtol=0, atol=1e-5)


def test_a_shared_prompt_gives_the_lora_the_same_gradient_as_separate_rows(tiny_model_dir: Path) -> None:
    learner = Learner(tiny_model_dir, TrainConfig(lora_r=8, dtype="float32"))
    samples = group(10, [5, 7, 6, 3], seed=9)

    def lora_grads(rows: list[list[int]]) -> list[Tensor]:
        learner.model.zero_grad(set_to_none=True)
        lm_head = learner.model.get_output_embeddings()
        for members in rows:
            row = pack_row(samples, members, loss_only=True, device=torch.device("cpu"))
            logp, _ = chunked_logprobs(hidden_states(learner.model, row), row.targets, lm_head, 1024)
            (logp * (row.seq.float() + 1)).sum().backward()  # a different weight per sample
        return [p.grad.clone() for p in learner.model.parameters() if p.requires_grad and p.grad is not None]

    for p in learner.model.parameters():  # a LoRA with B != 0, so every LoRA matrix gets a gradient
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    shared = lora_grads([[0, 1, 2, 3]])
    separate = [g for members in ([0], [1], [2], [3]) for g in [lora_grads([members])]]
    # Each separate run weights its only sample by 1; rescale to the shared run's weights 1..4.
    weighted = [sum((k + 1) * parts[k] for k in range(4)) for parts in zip(*separate, strict=True)]
    assert len(shared) == len(weighted) > 0
    for got, want in zip(shared, weighted, strict=True):  # equal up to float32 summation order
        assert float((got - want).norm() / want.norm()) < 1e-5


def test_micro_batches_group_samples_by_their_prompt() -> None:
    from trainer._prefix_tree import pack_tree

    a = group(8, [3, 4], seed=1)
    b = group(6, [5, 2, 4], seed=2)
    lone = [sample(9, 4, seed=3)]
    samples = [a[0], b[0], lone[0], a[1], b[1], b[2]]
    rows = pack_tree([s.token_ids for s in samples], 64)
    assert rows == [[0, 1, 2, 3, 4, 5]]  # 8 + 3 + 4, 6 + 5 + 2 + 4 and 9 tokens: one tree of 41
    rows = pack_tree([s.token_ids for s in samples], 20)
    assert sorted(map(sorted, rows)) == [[0, 3], [1, 4, 5], [2]]  # each group's prompt once, the lone one apart


def test_learner_logprobs_of_a_packed_batch_equal_each_sample_alone(tiny_model_dir: Path) -> None:
    learner = Learner(tiny_model_dir, TrainConfig(micro_batch_tokens=4096))
    samples = [sample(30, 4, seed=k) for k in range(4)]
    packed = learner.logprobs(samples)
    for s, got in zip(samples, packed, strict=True):
        (alone,) = learner.logprobs([s])
        assert got[0] == 0.0
        torch.testing.assert_close(got, alone, rtol=0, atol=1e-5)
    assert learner.logprobs([Sample([5], [False], [0.0], 1, 0)])[0].tolist() == [0.0]  # nothing to score


def test_chunked_logprobs_and_their_gradient_equal_the_full_logits_computation(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    lm_head = model.get_output_embeddings()
    targets = torch.randint(0, VOCAB, (50,), generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(50, 128, generator=torch.Generator().manual_seed(1))
    weights = torch.randn(50, generator=torch.Generator().manual_seed(2))

    h_full = hidden.clone().requires_grad_()
    full = lm_head(h_full).log_softmax(-1)  # (50, V)
    logp_full = full.gather(-1, targets[:, None]).squeeze(-1)
    (logp_full * weights).sum().backward()

    h_chunked = hidden.clone().requires_grad_()
    logp, entropy = chunked_logprobs(h_chunked, targets, lm_head, chunk_tokens=7)  # 8 chunks, the last short
    (logp * weights).sum().backward()

    torch.testing.assert_close(logp, logp_full, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, -(full.exp() * full).sum(-1).detach(), rtol=0, atol=1e-5)
    assert not entropy.requires_grad
    assert h_full.grad is not None and h_chunked.grad is not None
    # Chunks sum in another order: the error follows the gradient's largest element (seen: 1e-6 of it).
    torch.testing.assert_close(h_chunked.grad, h_full.grad, rtol=1e-5, atol=1e-5 * float(h_full.grad.abs().max()))


def test_learner_logprobs_equal_the_full_forward_whatever_the_chunk_size(tiny_model_dir: Path) -> None:
    learner = Learner(tiny_model_dir, TrainConfig(logprob_chunk_tokens=5))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    s = sample(33, 3, seed=7)
    (got,) = learner.logprobs([s])
    torch.testing.assert_close(got[1:], reference_logprobs(model, s.token_ids)[0], rtol=0, atol=1e-5)


# --- the optimizer step ---------------------------------------------------------------------


def test_a_step_moves_every_lora_matrix_and_leaves_base_weights_bit_identical(tiny_model_dir: Path) -> None:
    learner = Learner(tiny_model_dir, TrainConfig(learning_rate=1e-3))
    lora_before, base_before = lora_state(learner), base_state(learner)
    items = batch(learner)
    learner.step(items)
    learner.step(items)  # lora_A only gets a gradient once lora_B is no longer zero

    for name, before in lora_before.items():
        assert not torch.equal(before, dict(learner.model.named_parameters())[name]), f"{name} did not move"
    for name, before in base_before.items():
        assert torch.equal(before, dict(learner.model.named_parameters())[name]), f"base weight {name} changed"


def test_zero_advantages_change_lora_weights_by_weight_decay_alone(tiny_model_dir: Path) -> None:
    cfg = TrainConfig(learning_rate=1e-2, weight_decay=0.1)
    learner = Learner(tiny_model_dir, cfg)
    before = lora_state(learner)
    result = learner.step(batch(learner, [0.0] * 4))

    assert result.grad_norm == 0.0
    decay = 1 - cfg.learning_rate * cfg.weight_decay  # AdamW's decoupled decay; the Adam update is 0 / (0 + eps)
    for name, after in lora_state(learner).items():
        torch.testing.assert_close(after, before[name] * decay, rtol=1e-6, atol=0)


def gradients_of_step(learner: Learner, items: list[TrainItem]) -> tuple[StepResult, dict[str, Tensor]]:
    """Run a step, capturing the (clipped) gradients the optimizer is about to apply."""
    seen: dict[str, Tensor] = {}
    optimizer_step = learner.optimizer.step

    def record() -> None:
        seen.update({n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None})
        optimizer_step()

    learner.optimizer.step = record  # type: ignore[method-assign]
    return learner.step(items), seen


def test_micro_batches_accumulate_to_the_gradient_of_the_whole_batch(tiny_model_dir: Path) -> None:
    whole = Learner(tiny_model_dir, TrainConfig(micro_batch_tokens=4096))
    split = Learner(tiny_model_dir, TrainConfig(micro_batch_tokens=40))
    for learner in (whole, split):  # move lora_B off zero, so every LoRA matrix gets a gradient
        learner.step(batch(learner, [1.0, -1.0]))
    items = batch(whole)
    # Off-policy old logprobs, so the ratios (and the clip) differ from 1 as in real traffic.
    items = [
        TrainItem(
            Sample(i.sample.token_ids, i.sample.loss_mask, [v * 0.9 for v in i.sample.old_logprobs], 1, 0), i.advantage
        )
        for i in items
    ]

    (a, grads_a), (b, grads_b) = gradients_of_step(whole, items), gradients_of_step(split, items)

    assert (a.micro_batches, b.micro_batches) == (1, 6)
    assert a.clip_fraction > 0
    for key in ("loss", "clip_fraction", "ratio_mean", "entropy", "grad_norm"):
        assert getattr(b, key) == pytest.approx(getattr(a, key), rel=1e-5, abs=1e-7), key
    assert grads_a.keys() == grads_b.keys() == lora_state(whole).keys()
    for name, grad in grads_a.items():
        # Summed in another order, float32 gradients differ by ulps of the terms summed, not of the
        # result: an element where terms cancel is off by far more than rtol of itself. So the
        # absolute tolerance follows the tensor's largest gradient (seen: up to 2e-5 of it).
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-4, atol=1e-4 * float(grad.abs().max()))


def test_step_reports_its_metrics(tiny_model_dir: Path) -> None:
    learner = Learner(tiny_model_dir, TrainConfig(micro_batch_tokens=64))
    items = batch(learner)
    items.append(TrainItem(Sample([1, 2, 3], [False] * 3, [0.0] * 3, 1, 0), 1.0))  # nothing sampled: skipped
    result = learner.step(items)

    assert isinstance(result, StepResult)
    assert result.samples == 6 and result.kl is None
    assert result.tokens == sum(len(i.sample.token_ids) for i in items[:6])
    assert result.loss_tokens == sum(i.sample.loss_tokens for i in items)
    assert result.micro_batches >= 3
    assert result.ratio_mean == pytest.approx(1.0, abs=1e-5)  # on-policy: the old logprobs are the learner's own
    assert result.clip_fraction == 0.0
    assert result.logprob_mismatch_mean < 1e-5 and result.logprob_mismatch_max < 1e-4
    assert (result.log_ratio_clamped, result.step_skipped) == (0, False)
    assert 0.0 < result.entropy <= math.log(learner.model.config.vocab_size)
    assert result.seconds > 0 and result.tokens_per_second > 0
    assert result.peak_memory_kind == "process_max_rss" and (result.peak_memory_bytes or 0) > 0
    assert json.loads(json.dumps(result.to_dict())) == result.to_dict()


def test_scored_at_the_sampling_temperature_the_model_matches_its_own_sampling_logprobs(tiny_model_dir: Path) -> None:
    # Old logprobs from the plain forward at T=0.7, as vLLM's processed logprobs of a call at 0.7 would be.
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    prompts = [6, 9, 4]
    raw = [sample(24 + 4 * k, prompts[k], seed=10 + k) for k in range(3)]

    def at(temperature: float) -> list[Tensor]:
        """Each sample's sampled-token logprobs from full logits / T: (n - prompt,) each."""
        out = []
        for s, n_prompt in zip(raw, prompts, strict=True):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([s.token_ids])).logits[0, :-1].float() / temperature
            logp = logits.log_softmax(-1).gather(-1, torch.tensor(s.token_ids[1:])[:, None]).squeeze(-1)
            out.append(logp[n_prompt - 1 :])
        return out

    old, at_one = at(0.7), at(1.0)

    def items(claimed: float) -> list[TrainItem]:
        built = []
        for s, n_prompt, logp, adv in zip(raw, prompts, old, [1.0, -1.0, 0.5], strict=True):
            n = len(s.token_ids)
            temperatures = [1.0] * n_prompt + [claimed] * (n - n_prompt)
            built.append(TrainItem(Sample(s.token_ids, s.loss_mask, [0.0] * n_prompt + logp.tolist(), 1, 0,
                                          temperatures), adv))  # fmt: skip
        return built

    cfg = TrainConfig(lora_r=8, lora_alpha=16, dtype="float32", micro_batch_tokens=64)
    honest = Learner(tiny_model_dir, cfg).step(items(0.7))
    scale = float(torch.cat(old).abs().mean())  # the values' size: float32 rounding is relative to it
    assert honest.logprob_mismatch_mean <= 1e-6 * scale and honest.logprob_mismatch_max <= 1e-5 * scale
    assert honest.ratio_mean == pytest.approx(1.0, abs=1e-5)

    # The same tokens said to be sampled at 1.0: the trainer scores another distribution than vLLM's.
    wrong = Learner(tiny_model_dir, cfg).step(items(1.0))
    expected = torch.cat([(a - b).abs() for a, b in zip(at_one, old, strict=True)])
    assert wrong.logprob_mismatch_mean == pytest.approx(float(expected.mean()), rel=1e-4)
    assert wrong.logprob_mismatch_max == pytest.approx(float(expected.max()), rel=1e-4)
    assert wrong.logprob_mismatch_mean > 1000 * honest.logprob_mismatch_mean
    assert abs(wrong.ratio_mean - 1.0) > 100 * abs(honest.ratio_mean - 1.0) + 1e-4


def test_a_step_with_a_non_finite_gradient_is_skipped_and_says_so(tiny_model_dir: Path) -> None:
    learner = Learner(tiny_model_dir, TrainConfig())
    items = batch(learner)
    lora_b = next(p for n, p in learner.model.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        lora_b[0, 0] = math.inf  # a diverged weight: the forward overflows, the gradient is not finite
    before = lora_state(learner)
    result = learner.step(items)
    assert result.step_skipped and not math.isfinite(result.grad_norm)
    assert all(torch.equal(v, lora_state(learner)[k]) for k, v in before.items())


def test_kl_to_the_base_is_zero_from_a_fresh_lora_and_grows_as_it_trains(tiny_model_dir: Path) -> None:
    learner = Learner(tiny_model_dir, TrainConfig(learning_rate=1e-2, kl_coef=0.1))
    items = batch(learner)
    kls = [learner.step(items).kl for _ in range(4)]
    assert kls[0] is not None and abs(kls[0]) < 1e-6  # lora_B starts at zero: policy == base
    assert all(kl is not None and kl > 1e-4 for kl in kls[1:])


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (TrainItem(Sample([1, 2], [False, True], [0.0], 1, 0), 1.0), "differ in length"),
        (TrainItem(Sample([1, 2], [True, True], [0.0, 0.0], 1, 0), 1.0), "first token"),
        (TrainItem(Sample([1, 5000], [False, True], [0.0, 0.0], 1, 0), 1.0), "vocabulary"),
        (TrainItem(Sample([1, 2], [False, True], [0.0, 0.0], 1, 0), math.nan), "not finite"),
        (TrainItem(Sample([1, 2], [False, False], [0.0, 0.0], 1, 0), 1.0), "no sampled tokens"),
        (TrainItem(Sample([1, 2], [False, True], [0.0, math.nan], 1, 0), 1.0), "old logprob"),
        (TrainItem(Sample([1, 2], [False, True], [0.0, 0.0], 1, 0, [1.0, 0.0]), 1.0), "temperatures"),
        (TrainItem(Sample([1, 2], [False, True], [0.0, 0.0], 1, 0, [1.0]), 1.0), "temperatures"),
    ],
)
def test_step_rejects_a_malformed_batch_before_touching_weights(
    tiny_model_dir: Path, broken: TrainItem, message: str
) -> None:
    learner = Learner(tiny_model_dir, TrainConfig())
    before = lora_state(learner)
    with pytest.raises(ValueError, match=message):
        learner.step([broken])
    assert all(torch.equal(v, lora_state(learner)[k]) for k, v in before.items())


def test_bfloat16_autocast_on_cpu_trains_in_float32_weights(tiny_model_dir: Path) -> None:
    learner = Learner(tiny_model_dir, TrainConfig(dtype="bfloat16", learning_rate=1e-3))
    exact = Learner(tiny_model_dir, TrainConfig(dtype="float32"))
    s = sample(24, 4, seed=3)
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())
    torch.testing.assert_close(learner.logprobs([s])[0], exact.logprobs([s])[0], rtol=0, atol=0.15)
    before = lora_state(learner)
    assert learner.step(batch(learner)).grad_norm > 0
    assert any(not torch.equal(v, lora_state(learner)[k]) for k, v in before.items())


# --- adapter directories --------------------------------------------------------------------


def test_a_saved_adapter_resumes_with_identical_logprobs_and_optimizer_state(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = TrainConfig(learning_rate=1e-2)
    learner = Learner(tiny_model_dir, cfg)
    items = batch(learner)
    learner.step(items)
    out = tmp_path / "adapters" / "policy" / "1"
    learner.save(out, {"step": 1, "reward": 0.5})

    assert {p.name for p in out.iterdir()} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
        "trainer_config.json",
        "metrics.json",
        "optimizer.pt",
    }
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(tiny_model_dir)
    assert adapter_config["peft_type"] == "LORA" and adapter_config["r"] == cfg.lora_r
    assert TrainConfig.from_dict(json.loads((out / "trainer_config.json").read_text())) == cfg
    assert json.loads((out / "metrics.json").read_text()) == {"step": 1, "reward": 0.5}
    assert not [p for p in out.parent.iterdir() if p.name != "1"], "the temporary directory was left behind"

    resumed = Learner(tiny_model_dir, cfg, adapter=out)
    assert resumed.restored_optimizer
    probe = [i.sample for i in items[:2]]
    for a, b in zip(learner.logprobs(probe), resumed.logprobs(probe), strict=True):
        assert torch.equal(a, b)
    # The resumed run continues exactly: the same next step gives the same weights.
    learner.step(items)
    resumed.step(items)
    for name, value in lora_state(learner).items():
        torch.testing.assert_close(lora_state(resumed)[name], value, rtol=0, atol=0)

    with pytest.raises(FileExistsError):
        learner.save(out, {})


def test_an_adapter_without_optimizer_state_loads_trainable_with_fresh_moments(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    learner = Learner(tiny_model_dir, TrainConfig(learning_rate=1e-2))
    learner.step(batch(learner))
    learner.model.save_pretrained(str(tmp_path / "sft"))  # a bare peft adapter, as an SFT warm start

    warm = Learner(tiny_model_dir, TrainConfig(), adapter=tmp_path / "sft")
    assert not warm.restored_optimizer
    assert any(p.requires_grad for n, p in warm.model.named_parameters() if "lora_" in n)
    s = [batch(learner)[0].sample]
    torch.testing.assert_close(warm.logprobs(s)[0], learner.logprobs(s)[0], rtol=0, atol=0)


def test_newest_adapter_is_the_highest_complete_step_directory(tmp_path: Path) -> None:
    root = tmp_path / "adapters" / "policy"
    assert newest_adapter(root) is None

    def step_dir(name: str, files: tuple[str, ...]) -> None:
        (root / name).mkdir(parents=True)
        for f in files:
            (root / name / f).write_text("{}")

    complete = ("adapter_config.json", "adapter_model.safetensors", "trainer_config.json", "metrics.json")
    step_dir("2", complete)
    step_dir("10", complete)
    step_dir("11", complete[:2])  # a copy interrupted half way
    step_dir(".12.tmp-999", complete)  # a write in progress
    step_dir("latest", complete)
    (root / "13").write_text("not a directory")

    assert newest_adapter(root) == (10, root / "10")


def test_a_learner_told_the_sampler_computes_in_bf16_corrects_with_tis_and_still_trains(tiny_model_dir: Path) -> None:
    learner = Learner(tiny_model_dir, TrainConfig(sampler_dtype="bfloat16"))
    assert learner.correction == "tis" and learner.cfg.sampler_correction == "auto"  # saved as given
    items = batch(learner, [1.0, -1.0])
    # The sampler's log-probs 0.5 nats above the learner's on one sample: a ratio of e^-0.5 there, 1 elsewhere.
    shifted = items[0].sample
    items[0] = TrainItem(Sample(shifted.token_ids, shifted.loss_mask,
                                [v + 0.5 if m else v for v, m in zip(shifted.old_logprobs, shifted.loss_mask,
                                                                     strict=True)], 1, 0),
                         items[0].advantage, on_policy=False)  # fmt: skip
    before, base = lora_state(learner), base_state(learner)
    result = learner.step(items)
    n0, total = shifted.loss_tokens, sum(i.sample.loss_tokens for i in items)
    assert result.sampler_correction == "tis"
    assert result.sampler_weight_mean == pytest.approx((n0 * math.exp(-0.5) + total - n0) / total, rel=1e-4)
    assert result.ratio_mean == pytest.approx(1.0, abs=1e-6)  # the PPO ratio is to the learner itself
    assert result.logprob_mismatch_on_policy is not None and result.logprob_mismatch_on_policy < 1e-5
    assert result.logprob_mismatch_mean > 0.5 * n0 / total * 0.99
    assert any(not torch.equal(before[k], v) for k, v in lora_state(learner).items())
    assert all(torch.equal(base[k], v) for k, v in base_state(learner).items())


def test_float32_on_both_sides_needs_no_correction(tiny_model_dir: Path) -> None:
    learner = Learner(tiny_model_dir, TrainConfig(sampler_dtype="float32"))
    result = learner.step(batch(learner))
    assert (learner.correction, result.sampler_correction, result.sampler_weight_mean) == ("none", "none", 1.0)
