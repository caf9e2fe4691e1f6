"""The trainer's attention kernel: chosen in one place, and packed rows scored right under each layout.

No GPU here: the CUDA choice is tested with flash_attn's availability monkeypatched, and the
layout flash attention would get (each sample laid whole, no mask, positions restarting) is
scored with sdpa and eager on this CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_trainer_learner import group, reference_logprobs, sample
from transformers import AutoModelForCausalLM

from trainer import _attention
from trainer._attention import choose_attention
from trainer._config import TrainConfig
from trainer._learner import Learner
from trainer._logprobs import chunked_logprobs, hidden_states, pack_row

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.mark.parametrize(
    ("device", "dtype", "flash", "expected"),
    [
        (CUDA, torch.bfloat16, True, "flash_attention_2"),
        (CUDA, torch.float16, True, "flash_attention_2"),
        (CUDA, torch.bfloat16, False, "sdpa"),
        (CUDA, torch.float32, True, "sdpa"),
        (CPU, torch.bfloat16, True, "sdpa"),
        (CPU, torch.float32, False, "sdpa"),
    ],
)
def test_auto_picks_flash_attention_on_cuda_in_half_precision_when_installed(
    monkeypatch: pytest.MonkeyPatch, device: torch.device, dtype: torch.dtype, flash: bool, expected: str
) -> None:
    monkeypatch.setattr(_attention, "flash_attn_available", lambda: flash)
    chosen = choose_attention("auto", device, dtype)
    assert chosen.implementation == expected
    assert chosen.varlen == (expected == "flash_attention_2")
    assert chosen.why


def test_a_named_kernel_is_forced_and_an_impossible_one_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_attention, "flash_attn_available", lambda: True)
    assert choose_attention("eager", CUDA, torch.bfloat16).implementation == "eager"
    assert choose_attention("sdpa", CUDA, torch.bfloat16).implementation == "sdpa"
    assert choose_attention("flash_attention_2", CUDA, torch.bfloat16).implementation == "flash_attention_2"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        choose_attention("flash_attention_2", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        choose_attention("flash_attention_2", CUDA, torch.float32)
    monkeypatch.setattr(_attention, "flash_attn_available", lambda: False)
    with pytest.raises(ValueError, match="flash_attn missing"):
        choose_attention("flash_attention_2", CUDA, torch.bfloat16)
    with pytest.raises(ValueError, match="one of auto, sdpa, eager, flash_attention_2"):
        choose_attention("flash", CPU, torch.float32)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_flash_layout_lays_each_sample_whole_and_scores_it_as_alone(tiny_model_dir: Path, attn: str) -> None:
    """What flash attention gets: no mask, the shared prompt repeated, positions restarting per sample."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32, attn_implementation=attn)
    model.eval()
    samples = group(12, [6, 9, 4], seed=5)
    row = pack_row(samples, [0, 1, 2], loss_only=False, device=CPU, share_prefix=False)
    assert row.attention_mask is None  # flash attention takes none: varlen from the position restarts
    assert row.input_ids.shape[1] == sum(len(s.token_ids) for s in samples)
    assert row.position_ids[0].tolist() == [p for s in samples for p in range(len(s.token_ids))]
    with torch.no_grad():
        logp, _ = chunked_logprobs(hidden_states(model, row), row.targets, model.get_output_embeddings(), 1024)
    for k, s in enumerate(samples):
        torch.testing.assert_close(logp[row.seq == k], reference_logprobs(model, s.token_ids)[0], rtol=0, atol=1e-5)


def test_sdpa_and_eager_learners_give_the_same_logprobs_of_packed_rows_shared_or_not(tiny_model_dir: Path) -> None:
    samples = [*group(12, [6, 9, 4], seed=5), *group(7, [5, 8], seed=6), sample(20, 8, seed=7), sample(15, 4, seed=8)]
    scores = {}
    for attn in ("sdpa", "eager"):
        for share in (True, False):
            cfg = TrainConfig(lora_r=8, dtype="float32", micro_batch_tokens=64, share_prefix=share)
            learner = Learner(tiny_model_dir, cfg, attn_implementation=attn)
            assert learner.attention.implementation == attn and not learner.attention.varlen
            assert learner._pack(samples) != [[i] for i in range(len(samples))]  # rows really hold several samples
            scores[f"{attn}, {'shared prefixes' if share else 'each sample whole'}"] = learner.logprobs(samples)
    expected = scores.pop("sdpa, shared prefixes")
    assert all(float(lp[1:].abs().max()) > 0 for lp in expected)  # scored, not left at zero
    for name, got in scores.items():
        for k, (g, e) in enumerate(zip(got, expected, strict=True)):
            # log-probs near -7 (a 1026-token vocabulary): 1e-5 absolute is float32 noise between kernels
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-5, msg=f"{name}, sample {k}")
