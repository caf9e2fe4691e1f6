"""Structured outputs: the grammar a constrained call is sampled under is derived, sent, recorded, and rebuilt.

The real-vLLM proof that learner and sampler then agree is ``tests/test_integration_structured.py``; these
run on the fake vLLM and the tiny model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply

from tracetrain_core import structured_outputs

QUESTION = [{"role": "user", "content": "The capital of France, as JSON?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": CITY}}
STRICT = {"type": "function", "function": {"name": "answer", "strict": True, "parameters": CITY}}


def tag_of(spec: dict[str, Any] | None) -> dict[str, Any]:
    assert spec is not None
    tag: dict[str, Any] = json.loads(spec["structural_tag"])["format"]
    return tag


def test_a_json_schema_response_format_is_its_schema() -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    assert structured_outputs({"messages": QUESTION, "response_format": rf}) == {"json": CITY}
    assert structured_outputs({"response_format": {"type": "json_object"}}) == {"json_object": True}
    assert structured_outputs({"response_format": {"type": "text"}}) is None
    assert structured_outputs({"messages": QUESTION}) is None


def test_a_forced_tool_choice_is_the_hermes_structural_tag_and_wins_over_response_format() -> None:
    rf = {"type": "json_object"}
    required = tag_of(structured_outputs({"tools": [LOOKUP, STRICT], "tool_choice": "required", "response_format": rf}))
    assert [t["begin"] for t in required["tags"]] == [
        '<tool_call>\n{"name": "lookup", "arguments": ', '<tool_call>{"name": "lookup", "arguments": ',
        '<tool_call>\n{"name": "answer", "arguments": ', '<tool_call>{"name": "answer", "arguments": ',
    ]  # fmt: skip
    # A tool that is not strict takes any JSON as arguments (vLLM's default strictness); a strict one its schema.
    assert [t["content"]["json_schema"] for t in required["tags"]] == [True, True, CITY, CITY]
    assert required["at_least_one"] and not required["stop_after_first"]
    single = tag_of(structured_outputs({"tools": [LOOKUP], "tool_choice": "required", "parallel_tool_calls": False}))
    assert single["stop_after_first"]
    answer = {"type": "function", "function": {"name": "answer"}}
    named = tag_of(structured_outputs({"tools": [LOOKUP, STRICT], "tool_choice": answer}))
    assert {t["content"]["json_schema"] == CITY for t in named["tags"]} == {True}
    assert named["stop_after_first"] and len(named["tags"]) == 2


def test_a_constraint_that_cannot_be_derived_is_recorded_as_unsupported_not_dropped() -> None:
    assert structured_outputs({"tools": [STRICT], "tool_choice": "auto"}) == {
        "unsupported": "tool_choice auto with a strict tool"
    }
    assert "unsupported" in (structured_outputs({"response_format": {"type": "structural_tag"}}) or {})
    assert structured_outputs({"tools": [LOOKUP], "tool_choice": "auto"}) is None
    assert structured_outputs({"tools": [LOOKUP], "tool_choice": "none"}) is None


def test_the_proxy_sends_a_response_format_as_the_grammar_it_records(proxy: RunningProxy, fake: FakeVLLM) -> None:
    fake.script(Reply(content='{"city": "Paris"}'))
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    raw = proxy.client().chat.completions.with_raw_response.create(model="agent", messages=QUESTION, response_format=rf)  # type: ignore[arg-type]
    forwarded = fake.requests[-1]
    assert forwarded["structured_outputs"] == {"json": CITY}
    assert "response_format" not in forwarded
    trajectory = httpx.get(f"{proxy.v1}/trajectories/{raw.headers['x-trajectory-id']}").json()
    assert trajectory["calls"][0]["structured_outputs"] == {"json": CITY}


def test_an_unconstrained_call_sends_and_records_no_grammar(proxy: RunningProxy, fake: FakeVLLM) -> None:
    raw = proxy.client().chat.completions.with_raw_response.create(model="agent", messages=QUESTION)
    assert "structured_outputs" not in fake.requests[-1]
    trajectory = httpx.get(f"{proxy.v1}/trajectories/{raw.headers['x-trajectory-id']}").json()
    assert trajectory["calls"][0]["structured_outputs"] is None


# The trainer's side, on the tiny model's tokenizer.


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def learner(tiny_model_dir: Path) -> Any:
    from trainer import TrainConfig
    from trainer._learner import Learner

    return Learner(tiny_model_dir, TrainConfig(dtype="float32"))


def constrained_sample(tokenizer: Any, answer: str, spec: dict[str, Any]) -> Any:
    from trainer._samples import CapturedCall, build_samples

    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
    completion = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.convert_tokens_to_ids("<|im_end|>")]
    call = CapturedCall(list(prompt), completion, [-1.0] * len(completion), structured_outputs=json.dumps(spec))
    samples, stats = build_samples([call])
    assert stats.constrained == 1 and samples[0].grammars == [(len(prompt), len(prompt) + len(completion),
                                                               json.dumps(spec))]  # fmt: skip
    return samples[0]


def test_the_masked_learner_gives_each_constrained_token_at_least_its_full_distribution_logprob(
    learner: Any, tokenizer: Any
) -> None:
    from dataclasses import replace

    sample = constrained_sample(tokenizer, '{"city": "Paris"}', {"json": CITY})
    masked = learner.logprobs([sample])[0]
    free = learner.logprobs([replace(sample, grammars=[])])[0]
    start, end, _ = sample.grammars[0]
    assert torch.equal(masked[:start], free[:start])  # the prompt is not scored under any grammar
    # Renormalized over the tokens the grammar allows: never lower, higher wherever it forbade any.
    assert bool((masked[start:end] >= free[start:end] - 1e-6).all())
    assert bool((masked[start:end] > free[start:end] + 1e-3).all())


def test_a_step_reports_constrained_tokens_apart_and_counts_a_grammar_it_cannot_rebuild(
    learner: Any, tokenizer: Any
) -> None:
    from trainer._step import TrainItem

    good = constrained_sample(tokenizer, '{"city": "Paris"}', {"json": CITY})
    rejected = constrained_sample(tokenizer, "Paris", {"json": CITY})  # not JSON: not sampled under this grammar
    unknown = constrained_sample(tokenizer, "Paris", {"unsupported": "tool_choice auto with a strict tool"})
    old = [learner.logprobs([s])[0].tolist() for s in (good, rejected, unknown)]
    items = [TrainItem(type(s)(s.token_ids, s.loss_mask, o, 1, 0, [], s.grammars), a)
             for s, o, a in zip((good, rejected, unknown), old, (1.0, -1.0, 0.5), strict=True)]  # fmt: skip
    result = learner.step(items)
    assert result.grammar_fallbacks == 2
    assert result.constrained_samples == 3
    assert result.constrained_tokens == sum(s.constrained_tokens for s in (good, rejected, unknown))
    assert result.logprob_mismatch_constrained is not None and result.logprob_mismatch_unconstrained is None
    assert result.mask_ms > 0
    assert "grammar_fallbacks" in result.to_dict()
