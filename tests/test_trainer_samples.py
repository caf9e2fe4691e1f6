"""Training samples from captured token ids, and packing them into micro-batches."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from store import RewardedTrajectory, StoredCall
from trainer._batch import TrajectoryData
from trainer._samples import CapturedCall, Sample, SampleStats, build_samples, pack
from trainer._sampling import SamplingDefaults

# A ChatML-like vocabulary: <|im_start|>=1, <|im_end|>=2, "\n"=3, role names 10-12.
IM_START, IM_END, NL = 1, 2, 3
SYSTEM, USER, ASSISTANT, TOOL = 10, 11, 12, 13


def turn(role: int, *content: int) -> list[int]:
    return [IM_START, role, NL, *content, IM_END, NL]


def header(role: int) -> list[int]:
    return [IM_START, role, NL]


def call(
    prompt: list[int], completion: list[int], status: int = 200, version: int = 0, temperature: float = 1.0
) -> CapturedCall:
    logprobs = [-0.1 * (i + 1) for i in range(len(completion))]
    return CapturedCall(prompt, completion, logprobs, status_code=status, version=version, temperature=temperature)


def test_a_single_call_is_one_sample_with_loss_on_the_completion_only() -> None:
    samples, stats = build_samples([CapturedCall([5, 6, 7], [8, 9], [-0.5, -0.25])])
    assert len(samples) == 1
    s = samples[0]
    assert s.token_ids == [5, 6, 7, 8, 9]
    assert s.loss_mask == [False, False, False, True, True]
    assert s.old_logprobs == [0.0, 0.0, 0.0, -0.5, -0.25]
    assert s.n_calls == 1
    assert (stats.calls, stats.samples, stats.merged, stats.mismatched, stats.loss_tokens) == (1, 1, 0, 0, 2)


def test_two_calls_with_a_tool_result_between_merge_into_one_sample() -> None:
    first_prompt = turn(USER, 20, 21) + header(ASSISTANT)
    first = CapturedCall(first_prompt, [30, 31, IM_END], [-1.0, -2.0, -0.5])
    tool_result = [NL, *turn(TOOL, 40, 41), *header(ASSISTANT)]
    second = CapturedCall([*first_prompt, 30, 31, IM_END, *tool_result], [32, IM_END], [-0.3, -0.1])
    samples, stats = build_samples([first, second])
    assert len(samples) == 1
    s = samples[0]
    assert s.token_ids == [*first_prompt, 30, 31, IM_END, *tool_result, 32, IM_END]
    assert s.loss_mask == [False] * len(first_prompt) + [True] * 3 + [False] * len(tool_result) + [True] * 2
    assert s.old_logprobs == [0.0] * len(first_prompt) + [-1.0, -2.0, -0.5] + [0.0] * len(tool_result) + [-0.3, -0.1]
    assert s.n_calls == 2
    assert (stats.merged, stats.mismatched, stats.samples, stats.loss_tokens) == (1, 0, 1, 5)


def test_the_stop_token_ends_a_completion_and_the_template_newline_joins_unmasked() -> None:
    # vLLM's completion ends with <|im_end|>; the next prompt renders it back and adds "\n".
    prompt = turn(SYSTEM, 20) + turn(USER, 21) + header(ASSISTANT)
    completion = [30, IM_END]
    next_prompt = [*prompt, 30, IM_END, NL, *turn(USER, 22), *header(ASSISTANT)]
    samples, stats = build_samples([call(prompt, completion), call(next_prompt, [31, IM_END])])
    assert stats.merged == 1
    s = samples[0]
    end = len(prompt) + len(completion)
    assert s.token_ids[end - 1 : end + 1] == [IM_END, NL]
    assert s.loss_mask[end - 1 : end + 1] == [True, False]


def test_a_completion_without_its_stop_token_still_merges_when_the_template_adds_it() -> None:
    # A stop string ended the call before <|im_end|> was sampled; the template writes it. Not sampled: no loss.
    prompt = turn(USER, 21) + header(ASSISTANT)
    next_prompt = [*prompt, 30, IM_END, NL, *turn(USER, 22), *header(ASSISTANT)]
    samples, stats = build_samples([call(prompt, [30]), call(next_prompt, [31])])
    assert stats.merged == 1
    assert samples[0].loss_mask[len(prompt) : len(prompt) + 2] == [True, False]


def test_a_re_rendered_assistant_turn_is_a_mismatch_that_starts_a_new_sample() -> None:
    # The agent sent its tool call back spelled with other tokens: 30, 31 became 35.
    prompt = turn(USER, 21) + header(ASSISTANT)
    first = call(prompt, [30, 31, IM_END])
    second_prompt = [*prompt, 35, IM_END, NL, *turn(TOOL, 40), *header(ASSISTANT)]
    samples, stats = build_samples([first, call(second_prompt, [32, IM_END])])
    assert len(samples) == 2
    assert samples[0].token_ids == [*prompt, 30, 31, IM_END]
    assert samples[1].token_ids == [*second_prompt, 32, IM_END]
    assert samples[1].loss_mask == [False] * len(second_prompt) + [True, True]
    assert (stats.merged, stats.mismatched, stats.samples) == (0, 1, 2)


def test_a_merge_needs_the_whole_sample_so_far_not_just_the_last_call() -> None:
    a = call([5, 6], [7])
    b = call([5, 6, 7, 8], [9])
    c = call([5, 6, 7, 8, 9, 10], [11])  # extends a + b
    d = call([5, 6, 7, 10], [12])  # extends a only: a new sample
    samples, stats = build_samples([a, b, c, d])
    assert [s.n_calls for s in samples] == [3, 1]
    assert (stats.merged, stats.mismatched) == (2, 1)


def test_a_failed_call_is_skipped_and_the_next_call_merges_past_it() -> None:
    first = call([5, 6], [7, 8])
    failed = CapturedCall([5, 6, 7, 8, 9], [], [], status_code=500)
    retry = call([5, 6, 7, 8, 9], [10])
    samples, stats = build_samples([first, failed, retry])
    assert [s.token_ids for s in samples] == [[5, 6, 7, 8, 9, 10]]
    assert (stats.calls, stats.skipped_failed, stats.merged) == (3, 1, 1)


def test_a_call_whose_logprobs_do_not_match_its_completion_is_skipped() -> None:
    bad = CapturedCall([5, 6], [7, 8], [-0.1])
    samples, stats = build_samples([bad, call([5, 6], [9])])
    assert [s.token_ids for s in samples] == [[5, 6, 9]]
    assert (stats.skipped_inconsistent, stats.samples, stats.mismatched) == (1, 1, 0)


def test_a_call_with_an_empty_prompt_is_skipped_as_inconsistent() -> None:
    # The first token of a sample has no logit to score it, so it could never carry loss.
    samples, stats = build_samples([call([], [7, 8])])
    assert samples == []
    assert stats.skipped_inconsistent == 1


def test_an_empty_completion_is_skipped_and_counted() -> None:
    samples, stats = build_samples([call([5, 6], []), call([5, 6], [7])])
    assert [s.token_ids for s in samples] == [[5, 6, 7]]
    assert (stats.skipped_empty, stats.samples) == (1, 1)


def test_no_calls_give_no_samples() -> None:
    samples, stats = build_samples([])
    assert samples == []
    assert stats == SampleStats()


def test_a_sample_remembers_the_oldest_policy_version_that_sampled_it() -> None:
    samples, _ = build_samples([call([5], [6], version=4), call([5, 6, 7], [8], version=3), call([9], [1], version=5)])
    assert [s.oldest_version for s in samples] == [3, 5]


def test_stats_add_up_over_trajectories() -> None:
    _, one = build_samples([call([5], [6]), call([5, 6, 7], [8])])
    _, two = build_samples([call([5], [6]), call([9], [8], status=502)])
    total = one + two
    assert (total.calls, total.samples, total.merged, total.skipped_failed, total.loss_tokens) == (4, 2, 1, 1, 3)


# --- sampling temperatures ------------------------------------------------------------------


def test_each_sampled_token_keeps_its_calls_temperature_and_context_is_at_one() -> None:
    samples, stats = build_samples(
        [call([5, 6], [7, 8], temperature=0.7), call([5, 6, 7, 8, 9], [10], temperature=1.3)]
    )
    assert stats.merged == 1
    assert samples[0].temperatures == [1.0, 1.0, 0.7, 0.7, 1.0, 1.3]


def test_a_greedy_call_is_context_without_loss_and_the_next_call_still_merges() -> None:
    greedy = call([5, 6], [7, 8], temperature=0.0)
    samples, stats = build_samples([greedy, call([5, 6, 7, 8, 9], [10], temperature=0.7, version=3)])
    [s] = samples
    assert s.token_ids == [5, 6, 7, 8, 9, 10]
    assert s.loss_mask == [False, False, False, False, False, True]
    assert s.old_logprobs == [0.0] * 5 + [-0.1]
    assert (s.n_calls, s.oldest_version, s.temperatures[-1]) == (2, 3, 0.7)
    assert (stats.skipped_greedy, stats.merged, stats.mismatched, stats.loss_tokens) == (1, 1, 0, 1)


def test_a_trajectory_of_greedy_calls_only_gives_no_sample() -> None:
    samples, stats = build_samples([call([5, 6], [7], temperature=0.0), call([5, 6, 7, 8], [9], temperature=1e-6)])
    assert samples == []
    assert (stats.skipped_greedy, stats.samples, stats.loss_tokens) == (2, 0, 0)


def test_a_request_without_sampling_parameters_takes_the_models_generation_defaults(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "eos_token_id": 2}))
    defaults = SamplingDefaults.of_model(tmp_path)
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=0, min_p=0.0)
    assert SamplingDefaults.of_model(tmp_path, temperature=1.0).temperature == 1.0
    assert SamplingDefaults.of_model(tmp_path / "missing") == SamplingDefaults()
    stored = RewardedTrajectory("t", "g", 1.0, [
        StoredCall("t", [5], [6], [-0.5], 200, 0),  # the request named nothing
        StoredCall("t", [5, 6, 7], [8], [-0.5], 200, 0, temperature=0.9, top_p=1.0),
        StoredCall("t", [9], [1], [-0.5], 200, 0, temperature=0.0),
    ])  # fmt: skip
    calls = TrajectoryData.from_store(stored, defaults).calls
    assert [(c.temperature, c.truncated) for c in calls] == [(0.6, True), (0.9, False), (0.0, True)]
    assert [c.temperature for c in TrajectoryData.from_store(stored).calls] == [1.0, 0.9, 0.0]
    _, stats = build_samples(calls)
    assert (stats.truncated, stats.skipped_greedy) == (1, 1)  # a greedy call is not counted as truncated


def test_top_k_and_min_p_truncate_and_their_off_values_do_not() -> None:
    defaults = SamplingDefaults()
    assert not defaults.truncates(None, None, None)
    assert not defaults.truncates(1.0, 0, 0.0) and not defaults.truncates(None, -1, None)
    assert defaults.truncates(None, 20, None) and defaults.truncates(None, None, 0.05)


# --- pack -----------------------------------------------------------------------------------


def sample_of(length: int) -> Sample:
    return Sample([0] * length, [True] * length, [0.0] * length, 1, 0)


def test_pack_fills_micro_batches_first_fit_decreasing() -> None:
    samples = [sample_of(n) for n in (3, 5, 2, 4)]
    assert pack(samples, 7) == [[1, 2], [0, 3]]


def test_pack_never_exceeds_the_budget_nor_splits_or_loses_a_sample() -> None:
    lengths = [7, 1, 9, 3, 3, 6, 2, 8, 5, 4, 10, 1]
    batches = pack([sample_of(n) for n in lengths], 10)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in batches)
    assert len(batches) == 6  # 59 tokens need at least 6 micro-batches of 10


def test_pack_gives_a_sample_longer_than_the_budget_a_micro_batch_of_its_own() -> None:
    batches = pack([sample_of(n) for n in (2, 12, 3)], 8)
    assert [1] in batches
    assert sorted(batches) == [[0, 2], [1]]


def test_pack_of_nothing_is_no_micro_batches_and_a_zero_budget_is_an_error() -> None:
    assert pack([], 8) == []
    with pytest.raises(ValueError, match="max_tokens"):
        pack([sample_of(1)], 0)


# --- multi-turn accounting ------------------------------------------------------------------


def test_a_template_that_re_renders_every_turn_splits_every_call_and_the_counts_say_so() -> None:
    # Each turn the agent sends its previous tool call back spelled differently (the template re-serializes
    # it): no call extends the sample before it, so four calls give four samples, each forwarding the
    # conversation again.
    prompt = turn(USER, 21) + header(ASSISTANT)
    calls = [call(prompt, [30, 31, IM_END])]
    for k in range(3):
        prompt = [*prompt, 35 + k, IM_END, NL, *turn(TOOL, 40 + k), *header(ASSISTANT)]
        calls.append(call(prompt, [30, 31, IM_END]))
    samples, stats = build_samples(calls)
    assert len(samples) == 4
    assert (stats.calls, stats.merged, stats.mismatched, stats.split_rerendered, stats.split_not_extended) == (
        4, 0, 3, 3, 0)  # fmt: skip
    assert stats.completion_tokens == stats.loss_tokens == 12
    assert stats.call_tokens == sum(len(c.prompt_token_ids) + 3 for c in calls)
    assert stats.tokens == stats.call_tokens  # nothing shared: every prompt forwarded whole


def test_merged_turns_forward_the_conversation_once() -> None:
    prompt = turn(USER, 21) + header(ASSISTANT)
    first = call(prompt, [30, 31, IM_END])
    second = call([*prompt, 30, 31, IM_END, NL, *turn(TOOL, 40), *header(ASSISTANT)], [32, IM_END])
    _samples, stats = build_samples([first, second])
    assert (stats.samples, stats.merged, stats.mismatched) == (1, 1, 0)
    assert stats.tokens == len(second.prompt_token_ids) + 2 < stats.call_tokens


# Token 50 reads "}}", 51 reads "}": a constrained decoder may sample "}" "}" where the template's text
# tokenizes to "}}"; 52 reads "]" (another text).
SPELLING = {50: "}}", 51: "}", 52: "]"}


def spell(ids: Sequence[int]) -> str:
    return "".join(SPELLING.get(i, f"<{i}>") for i in ids)


def test_a_turn_re_rendered_to_the_same_text_in_other_ids_merges_with_the_ids_as_sampled() -> None:
    prompt = turn(USER, 21) + header(ASSISTANT)
    first = call(prompt, [30, 51, 51, IM_END])
    rest = [NL, *turn(TOOL, 40), *header(ASSISTANT)]
    second = call([*prompt, 30, 50, IM_END, *rest], [32, IM_END])
    samples, stats = build_samples([first, second], decode=spell)
    assert (stats.samples, stats.merged, stats.merged_retokenized, stats.mismatched) == (1, 1, 1, 0)
    (sample,) = samples
    assert sample.token_ids == [*prompt, 30, 51, 51, IM_END, *rest, 32, IM_END]  # the sampled spelling kept
    assert sample.old_logprobs[len(prompt) : len(prompt) + 4] == list(first.logprobs)
    assert sample.loss_mask == [False] * len(prompt) + [True] * 4 + [False] * len(rest) + [True] * 2
    assert stats.tokens < stats.call_tokens  # the conversation is forwarded once


def test_a_turn_whose_opening_blanks_the_client_dropped_still_merges() -> None:
    # A Hermes-style parser's "\n\n" (53) before a tool call (30): Anthropic's clients send the answer back
    # without that text block, so the template re-renders the turn without it.
    blanks = {**SPELLING, 53: "\n\n", 30: "<tool_call>"}
    prompt = turn(USER, 21) + header(ASSISTANT)
    first = call(prompt, [53, 30, IM_END])
    rest = [NL, *turn(TOOL, 40), *header(ASSISTANT)]
    second = call([*prompt, 30, IM_END, *rest], [32, IM_END])
    samples, stats = build_samples([first, second], decode=lambda ids: "".join(blanks.get(i, f"<{i}>") for i in ids))
    assert (stats.samples, stats.merged_retokenized) == (1, 1)
    assert samples[0].token_ids == [*prompt, 53, 30, IM_END, *rest, 32, IM_END]  # as sampled


def test_a_turn_re_rendered_to_other_text_still_splits_and_without_decode_every_re_rendering_splits() -> None:
    prompt = turn(USER, 21) + header(ASSISTANT)
    first = call(prompt, [30, 51, 51, IM_END])
    rest = [NL, *turn(TOOL, 40), *header(ASSISTANT)]
    other_text = call([*prompt, 30, 52, IM_END, *rest], [32, IM_END])
    _, stats = build_samples([first, other_text], decode=spell)
    assert (stats.samples, stats.merged_retokenized, stats.split_rerendered) == (2, 0, 1)
    same_text = call([*prompt, 30, 50, IM_END, *rest], [32, IM_END])
    _, stats = build_samples([first, same_text])
    assert (stats.samples, stats.merged_retokenized, stats.split_rerendered) == (2, 0, 1)


def test_a_re_rendered_turn_with_no_stop_token_after_it_splits() -> None:
    # The completion was cut (no stop token of its own in the new prompt): where the turn ends is unknown.
    prompt = turn(USER, 21) + header(ASSISTANT)
    first = call(prompt, [30, 51, 51, 33])
    second = call([*prompt, 30, 50, 34, NL], [32, IM_END])
    _, stats = build_samples([first, second], decode=spell)
    assert (stats.samples, stats.merged_retokenized, stats.split_rerendered) == (2, 0, 1)


def test_a_reasoning_templates_dropped_thinking_and_its_opened_answer_are_a_re_rendering() -> None:
    # DeepSeek-R1's template opens each answer with <think> (99) and renders an earlier turn from its content
    # alone: the next prompt keeps neither the thinking (97, 98) nor the <think> that opened it.
    prompt = turn(USER, 21) + header(ASSISTANT)
    first = call([*prompt, 99], [97, 98, 96, 30, IM_END])  # thinking, </think> (96), the answer
    second = call([*prompt, 30, IM_END, NL, *turn(USER, 22), *header(ASSISTANT), 99], [31, IM_END])
    samples, stats = build_samples([first, second])
    assert (stats.samples, stats.split_rerendered, stats.split_not_extended) == (2, 1, 0)
    assert samples[0].token_ids == [*prompt, 99, 97, 98, 96, 30, IM_END]  # the thinking trains, in its own prompt
    assert samples[0].loss_mask[len(prompt) + 1 :] == [True] * 5


def test_a_prompt_that_drops_earlier_turns_is_a_split_of_another_kind() -> None:
    first = call(turn(SYSTEM, 20) + turn(USER, 21) + header(ASSISTANT), [30, IM_END])
    summarized = call(turn(USER, 22) + header(ASSISTANT), [31, IM_END])  # the agent dropped the history
    _, stats = build_samples([first, summarized])
    assert (stats.split_rerendered, stats.split_not_extended, stats.mismatched) == (0, 1, 1)


def test_a_steps_turn_metrics_are_per_trained_trajectory() -> None:
    from trainer._batch import build_batch
    from trainer._config import TrainConfig

    prompt = turn(USER, 21) + header(ASSISTANT)
    merged = [call(prompt, [30, IM_END]), call([*prompt, 30, IM_END, NL, *turn(TOOL, 40), *header(ASSISTANT)],
                                              [32, IM_END])]  # fmt: skip
    split = [call(prompt, [30, IM_END]), call([*prompt, 36, IM_END, NL, *turn(TOOL, 40), *header(ASSISTANT)],
                                             [32, IM_END])]  # fmt: skip
    trajectories = [TrajectoryData("a", "g", 1.0, merged), TrajectoryData("b", "g", 0.0, split)]
    metrics = build_batch(trajectories, TrainConfig(), trained_version=0).metrics
    assert metrics["calls_per_trajectory"] == 2.0
    assert metrics["samples_per_trajectory"] == 1.5
    assert metrics["samples_split_rerendered"] == 1
    assert metrics["trained_tokens"] == 8 and metrics["trained_token_share"] == 1.0


def test_the_models_decode_keeps_special_tokens_and_reads_two_spellings_of_one_text_alike(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    from trainer._tokenizer import model_decode

    decode = model_decode(tiny_model_dir)
    assert decode is not None
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    text = '<|im_start|>assistant\n{"city": "Oslo"}<|im_end|>'
    canonical = tokenizer.encode(text)
    one_by_one = [i for ch in text.split("<|im_end|>")[0] for i in tokenizer.encode(ch)] + canonical[-1:]
    assert decode(canonical) == decode(one_by_one) == text
    assert canonical != one_by_one  # the same text in other ids: what a constrained decoder may sample
    assert model_decode(tmp_path) is None  # no tokenizer: turns merge by ids only
