"""``tracetrain sft``: a LoRA warm start from the best captured trajectories, which the GRPO trainer starts from.

The data is real capture (the proxy in front of the fake vLLM, rewards posted over HTTP);
the model is the tiny random Llama with its ChatML template.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply, ToolCall
from peft import PeftModel
from safetensors.torch import load_file
from sqlalchemy import insert, select
from transformers import AutoModelForCausalLM, AutoTokenizer

import trainer.sft
from store import connect
from store._tables import AdapterVersion, Call, Group, TrainingJob, Trajectory
from tracetrain_cli._export import ExportFilter, ExportFormat, export_trajectories
from tracetrain_cli._main import main
from trainer._config import TrainConfig
from trainer._sft import SFTOptions, build_trainer, lora_parameters, read_export, sft_examples
from trainer._worker import Worker, WorkerSettings

# The tables, for arranging a store's state directly as another process would.
A = AdapterVersion.__table__
C = Call.__table__
G = Group.__table__
J = TrainingJob.__table__
T = Trajectory.__table__


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
QUESTION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
def captured(start_proxy: Callable[..., RunningProxy], fake: FakeVLLM) -> RunningProxy:
    """good (1.0: two calls, the second a tool call), fine (0.8, streamed), poor (0.1), open (unrewarded)."""
    proxy = start_proxy()

    def chat(trajectory_id: str, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        client = proxy.client(default_headers={"X-Trajectory-Id": trajectory_id})
        return client.chat.completions.create(model="agent", messages=messages, **kwargs)

    fake.script(
        Reply(content="I will look it up."),
        Reply(tool_calls=[ToolCall("get_weather", '{"city": "Paris"}')]),
        Reply(content="Sunny and warm."),
        Reply(content="No idea."),
        Reply(content="Maybe."),
    )
    chat("good", QUESTION)
    chat("good", [*QUESTION, {"role": "assistant", "content": "I will look it up."},
                  {"role": "user", "content": "Go on."}], tools=[TOOL])  # fmt: skip
    for _ in chat("fine", QUESTION, stream=True):
        pass
    chat("poor", QUESTION)
    chat("open", QUESTION)
    for trajectory_id, value in (("good", 1.0), ("fine", 0.8), ("poor", 0.1)):
        body = {"trajectory_id": trajectory_id, "reward": value}
        assert httpx.post(f"{proxy.v1}/rewards", json=body).status_code == 200
    return proxy


def export_best(proxy: RunningProxy, out: Path, fmt: ExportFormat = "jsonl") -> Path:
    url = proxy.settings.resolved_database_url
    asyncio.run(export_trajectories(url, out, fmt, ExportFilter(min_reward=0.5)))
    return out


def test_sft_trains_only_the_lora_and_only_on_the_assistants_completions(
    captured: RunningProxy, tiny_model_dir: Path, tmp_path: Path
) -> None:
    examples = sft_examples(read_export(export_best(captured, tmp_path / "best.jsonl")))
    assert (examples.trajectories, len(examples.rows), examples.skipped_calls) == (2, 3, 0)
    assert examples.reward_mean == pytest.approx(0.9)
    tool_example = examples.rows[1]
    assert tool_example["completion"][0]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": {"city": "Paris"}  # an object, as Hugging Face templates take it
    }  # fmt: skip
    assert json.loads(tool_example["tools"]) == [TOOL]
    from_parquet = sft_examples(read_export(export_best(captured, tmp_path / "best.parquet", fmt="parquet")))
    assert from_parquet == examples  # Parquet's null-filled fields give the same examples

    options = SFTOptions(epochs=2, learning_rate=1e-3, batch_size=2)
    sft = build_trainer(tiny_model_dir, examples, options, tmp_path / "scratch")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    trained_text = [
        tokenizer.decode([t for t, label in zip(row["input_ids"], row["labels"], strict=True) if label != -100])
        for row in sft.train_dataset
    ]
    assert trained_text[0] == "I will look it up.<|im_end|>\n"
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert trained_text[1] == f"<tool_call>{call}</tool_call><|im_end|>\n"
    assert trained_text[2] == "Sunny and warm.<|im_end|>\n"

    lora_before = lora_parameters(sft.model)
    base_before = {n: p.detach().clone() for n, p in sft.model.named_parameters() if "lora_" not in n}
    assert len(lora_before) == 2 * 2 * len(TrainConfig().target_modules)  # A and B, 2 layers, every projection
    result = sft.train()
    assert math.isfinite(result.training_loss) and result.global_step == 4
    after = dict(sft.model.named_parameters())
    for name, before in lora_before.items():
        assert not torch.equal(before, after[name]), f"{name} did not move"
    for name, before in base_before.items():
        assert torch.equal(before, after[name]), f"base weight {name} changed"


def test_sft_command_writes_an_adapter_that_the_grpo_worker_starts_from(
    captured: RunningProxy, tiny_model_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "warm"
    command = ["sft", "--min-reward", "0.5", "--data-dir", str(captured.settings.data_dir), "--model",
               str(tiny_model_dir), "--output", str(out), "--epochs", "2", "--learning-rate", "1e-3",
               "--batch-size", "2", "--device", "cpu"]  # fmt: skip
    assert main(command) == 0
    said = capfd.readouterr().out  # the child's, on the same file descriptor
    assert f"start GRPO from it: tracetrain serve --trainer-arg=--init-adapter={out.resolve()}" in said

    meta = json.loads((out / "sft.json").read_text())
    defaults = TrainConfig()
    assert (meta["source_trajectories"], meta["examples"], meta["min_reward"]) == (2, 3, 0.5)
    assert meta["base_model"] == str(tiny_model_dir.resolve()) and math.isfinite(meta["loss"])
    assert (meta["lora_r"], meta["lora_alpha"]) == (defaults.lora_r, defaults.lora_alpha)
    assert meta["target_modules"] == sorted(defaults.target_modules)
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (defaults.lora_r, defaults.lora_alpha)
    assert set(config["target_modules"]) == set(defaults.target_modules)
    saved = load_file(str(out / "adapter_model.safetensors"))
    assert saved and all("lora_A" in name or "lora_B" in name for name in saved)  # no base weight is saved
    assert all(w.abs().sum() > 0 for name, w in saved.items() if "lora_B" in name)  # moved from peft's zeros
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    ids = torch.tensor([[1, 50, 60, 70, 2]])
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        warm = PeftModel.from_pretrained(base, str(out))(input_ids=ids).logits
    assert not torch.allclose(plain, warm)

    settings = WorkerSettings(
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'grpo.db'}", data_dir=tmp_path / "grpo", policies=("agent",),
        base_model=tiny_model_dir, config=TrainConfig(dtype="float32", learning_rate=1e-3), init_adapter=out,
    )  # fmt: skip
    asyncio.run(queue_a_job(settings.database_url))
    learner_lora, job, adapter = asyncio.run(run_worker(settings))
    for name, weight in saved.items():  # the learner starts from the SFT weights, not from a fresh LoRA
        (match,) = [v for k, v in learner_lora.items() if k.replace(".default", "") == name]
        assert torch.equal(match, weight), name
    assert job.state == "succeeded" and job.error is None and job.metrics["trained_from"] == 0
    assert adapter.version == 1 and (Path(adapter.path) / "adapter_model.safetensors").is_file()
    assert json.loads((Path(adapter.path) / "trainer_config.json").read_text())["lora_r"] == defaults.lora_r


async def queue_a_job(url: str) -> None:
    """One group of two rewarded trajectories, with token ids inside the tiny model's vocabulary."""
    engine = await connect(url)
    now = time.time()
    async with engine.begin() as conn:
        await conn.execute(insert(G).values(id="g", policy="agent", state="training", created_at=now))
        for k, value in enumerate((1.0, 0.0)):
            await conn.execute(insert(T).values(id=f"t{k}", group_id="g", policy="agent", keyed_by="header",
                                                created_at=now, updated_at=now, reward=value, metrics={}))  # fmt: skip
            await conn.execute(insert(C).values(
                id=f"c{k}", trajectory_id=f"t{k}", group_id="g", policy="agent", endpoint="chat.completions",
                model="agent", served_model="tiny", version=0, stream=False, request={},
                prompt_token_ids=[1, 40 + k, 50, 60, 2], completion_token_ids=[70 + k, 80, 90], logprobs=[-2.0] * 3,
                other_choices=[], status_code=200, latency_ms=1.0, started_at=now))  # fmt: skip
        await conn.execute(insert(J).values(policy="agent", state="queued", group_ids=["g"], metrics={}, progress=0.0,
                                            created_at=now))  # fmt: skip
    await engine.dispose()


async def run_worker(settings: WorkerSettings) -> tuple[dict[str, torch.Tensor], Any, Any]:
    """The worker's LoRA once it is ready, then the job it ran and the adapter it recorded."""
    worker = await Worker.open(settings)
    try:
        await worker.prepare()
        assert worker._held.learner is not None
        lora = lora_parameters(worker._held.learner.model)
        assert await worker.run(once=True) == 1
    finally:
        await worker.close()
    engine = await connect(settings.database_url)
    async with engine.connect() as conn:
        job = (await conn.execute(select(J))).one()
        adapter = (await conn.execute(select(A))).one()
    await engine.dispose()
    return lora, job, adapter


def test_sft_refuses_with_status_2_when_no_trajectory_passes_min_reward(
    captured: RunningProxy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "warm"
    command = ["sft", "--min-reward", "5", "--data-dir", str(captured.settings.data_dir), "--output", str(out)]
    assert main(command) == 2
    err = capsys.readouterr().err
    assert "no trajectory passes --min-reward 5" in err and "the best reward 1" in err
    assert "Lower --min-reward" in err
    assert not out.exists()


def test_sft_refuses_an_output_directory_that_exists(captured: RunningProxy, tmp_path: Path) -> None:
    (tmp_path / "warm").mkdir()
    with pytest.raises(SystemExit) as exc:
        main(["sft", "--min-reward", "0.5", "--data-dir", str(captured.settings.data_dir), "--output",
              str(tmp_path / "warm")])  # fmt: skip
    assert "exists; pass another --output" in str(exc.value.code)


def test_the_trainer_module_refuses_an_export_without_answered_chat_calls(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        {"id": "t1", "policy": "agent", "reward": 1.0, "calls": [
            {"status_code": 500, "messages": [{"role": "user", "content": "hi"}], "response": None},
            {"status_code": 200, "messages": None, "prompt": "Once upon", "response": {"role": "assistant",
                                                                                      "content": " a time"}},
        ]},
        {"id": "t2", "policy": "agent", "reward": 0.2, "calls": [
            {"status_code": 200, "messages": [{"role": "user", "content": "hi"}],
             "response": {"role": "assistant", "content": "hello", "tool_calls": None}},
        ]},
    ]  # fmt: skip
    data = tmp_path / "export.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert sft_examples(read_export(data)).rows == [
        {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "hello"}],
         "tools": None}
    ]  # fmt: skip
    out = tmp_path / "warm"
    argv = ["--data", str(data), "--base-model", str(tiny_model_dir), "--output", str(out)]
    assert trainer.sft.main([*argv, "--min-reward", "0.5"]) == 2
    assert "no trajectory with an answered chat call passes" in capsys.readouterr().err
    assert trainer.sft.main([*argv, "--min-reward", "0.9", "--policy", "other"]) == 2
    assert "no trajectory passes the filters" in capsys.readouterr().err
    assert not out.exists()
