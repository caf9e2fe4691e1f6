"""The ``tracetrain`` command: help that explains, clear refusals, and a real serve/stop cycle."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from fake_vllm import FakeVLLM

from tracetrain_cli._main import main
from tracetrain_cli._serve_command import _vllm_child, settings_from
from tracetrain_cli._serve_devices import device_plan
from tracetrain_cli._serve_flags import add_serve_parser


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_help_explains_serve(capsys) -> None:
    try:
        main(["serve", "--help"])
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--upstream",
        "--host",
        "--port",
        "--data-dir",
        "--no-train",
        "--database-url",
        "OPENAI_BASE_URL",
        "--model",
        "--device",
        "--vllm-arg",
        "--trainer-arg",
        "smollm2-135m-instruct",
    ):
        assert flag in out


def test_reasoning_parser_reaches_vllms_command_line_and_the_proxys_settings(capsys, tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--reasoning-parser NAME" in help_text and "qwen3" in help_text and "deepseek_r1" in help_text

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    args = parser.parse_args(["serve", "--reasoning-parser", "qwen3", "--data-dir", str(tmp_path), "--no-train",
                              "--device", "cpu"])  # fmt: skip
    settings = settings_from(args)
    assert settings.reasoning_parser == "qwen3"
    _, launch = _vllm_child(args, settings, model, "cpu", "float32", device_plan(args, "cpu", model))
    argv = launch.argv()
    assert argv[argv.index("--reasoning-parser") + 1] == "qwen3"
    assert "--reasoning-parser" not in parser.parse_args(["serve"]).vllm_arg  # none unless asked
    without = settings_from(parser.parse_args(["serve", "--data-dir", str(tmp_path)]))
    assert without.reasoning_parser is None

    for refused in (["--reasoning-parser", "qwen3; rm -rf /"], ["--vllm-arg=--reasoning-parser=qwen3"]):
        with pytest.raises(SystemExit, match=r"reasoning_parser|serve's own --reasoning-parser"):
            settings_from(parser.parse_args(["serve", "--data-dir", str(tmp_path), *refused]))


def test_canary_flags_and_a_human_reward_source_reach_the_proxys_settings(capsys, tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--canary FRACTION" in help_text and "--canary-groups N" in help_text and "human" in help_text
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    serve = ["serve", "--data-dir", str(tmp_path)]
    flags = ["--canary", "0.1", "--canary-groups", "12", "--canary-minutes", "20", "--reward-source", "human"]
    settings = settings_from(parser.parse_args([*serve, *flags]))
    assert (settings.canary, settings.canary_groups, settings.canary_minutes) == (0.1, 12, 20.0)
    assert settings.reward_source == "human" and not settings.judge_configured
    assert settings_from(parser.parse_args(serve)).canary is None  # off unless asked
    for refused in (["--canary", "1"], ["--canary", "0"], ["--canary", "nan"], ["--canary-groups", "2"]):
        with pytest.raises(SystemExit, match=r"invalid settings\n  canary"):
            settings_from(parser.parse_args([*serve, *refused]))


def test_serve_on_a_public_address_without_keys_says_what_to_do(tmp_path: Path) -> None:
    try:
        main(["serve", "--upstream", "http://127.0.0.1:9/v1", "--host", "0.0.0.0", "--data-dir", str(tmp_path)])
    except SystemExit as exc:
        assert "TRACETRAIN_API_KEYS" in str(exc.code)
    else:
        raise AssertionError("serve started on 0.0.0.0 without keys")


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_serve_proxies_and_stops_cleanly(tmp_path: Path, fake: FakeVLLM, stop_signal: signal.Signals) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACETRAIN_")}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tracetrain_cli",
            "serve",
            "--upstream",
            f"{fake.url}/v1",
            "--port",
            str(port),
            "--data-dir",
            str(tmp_path),
            "--no-train",
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120  # a loaded machine has taken over 20 s to import and start serve
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "ping"}])
        assert reply.choices[0].message.content == "echo: ping"
    finally:
        process.send_signal(stop_signal)
        output, _ = process.communicate(timeout=120)  # it returns at the exit: only a hung stop waits this long
    assert process.returncode == 0, output
    assert "Traceback" not in output
    assert (tmp_path / "tracetrain.db").exists()


def test_demo_has_its_own_help(capsys) -> None:
    try:
        main(["demo", "--help"])
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    for flag in ("--minutes", "--steps", "--url", "held-out"):
        assert flag in out


def test_help_explains_export(capsys) -> None:
    try:
        main(["export", "--help"])
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    for flag in ("--format", "jsonl", "parquet", "--min-reward", "--policy", "--data-dir", "--database-url",
                 "--output", "prompt_token_ids", "load_dataset", "pyarrow"):  # fmt: skip
        assert flag in out, flag


def test_help_explains_sft(capsys) -> None:
    try:
        main(["sft", "--help"])
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    for flag in ("--min-reward", "--policy", "--model", "--data-dir", "--output", "--epochs", "--learning-rate",
                 "--lora-rank", "SFTTrainer", "--init-adapter", "status 2", "tracetrain[train]"):  # fmt: skip
        assert flag in " ".join(out.split()), flag


def test_top_level_help_lists_export_and_sft(capsys) -> None:
    assert main([]) == 2
    out = capsys.readouterr().out
    assert "export" in out and "sft" in out
