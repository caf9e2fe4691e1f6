"""What the GPU plan passes vLLM beyond its share of memory, and the figures it plans with at real sizes.

vLLM refuses to start when one request of the model's whole context does not fit its KV cache, and
refuses every adapter above its ``--max-lora-rank``; the plan fits both to the box and the trainer.
The estimate's activations are checked against what a real backward keeps (the tiny model on this CPU,
with peft's fp32 copies of the LoRA layers' inputs); the sleeping vLLM and the host RAM it pins are
in the estimate and the printed plan. No GPU is needed: nvidia-smi is a script, as in test_gpu_plan.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from test_gpu_plan import H100, QWEN_1_5B, fake_nvidia_smi, gpus, model_dir, plan, shape  # noqa: F401

from tracetrain_cli._gpu_estimate import DEFAULT_TARGET_MODULES, GiB, TrainerNeeds, VllmLora, estimate_memory
from tracetrain_cli._gpu_inputs import parse_nvidia_smi, read_model_shape
from tracetrain_cli._gpu_plan import Overrides, PlanError, kv_cache_per_gpu, plan_gpus
from tracetrain_cli._gpu_render import render_plan
from tracetrain_cli._main import main
from tracetrain_cli._vllm_process import VLLMLaunch

LLAMA_3_1_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 128256, "intermediate_size": 14336,
                "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False,
                "max_position_embeddings": 131072}  # fmt: skip
L40S = "{i}, NVIDIA L40S, 46068, 0"  # a 48 GB card


def serve_args(*flags: str) -> argparse.Namespace:
    from tracetrain_cli._serve_flags import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *flags])


def test_a_128k_context_model_shared_on_a_48gb_gpu_gets_a_max_model_len_its_kv_cache_holds(tmp_path: Path) -> None:
    from tracetrain_cli._serve_devices import launch_options

    model = shape(tmp_path, LLAMA_3_1_8B)
    p = plan(gpus(1, L40S), model, TrainerNeeds(micro_batch_tokens=1024))
    assert p.shared and p.memory_fraction is not None and p.max_model_len is not None
    kv = kv_cache_per_gpu(p.gpus[0], p.memory_fraction, 1, p.memory)
    assert 32_768 <= p.max_model_len < 131_072
    assert p.max_model_len * model.kv_bytes_per_token <= kv  # vLLM's start-up check: one such request fits
    argv = VLLMLaunch(model="m", port=8001, data_dir=tmp_path, device="cuda", **launch_options(p)).argv()
    assert argv[argv.index("--max-model-len") + 1] == str(p.max_model_len)
    assert f"--max-model-len {p.max_model_len} (the model's 131,072 would not fit)" in render_plan(p)

    roomy = plan(gpus(1, H100), read_model_shape(model_dir(tmp_path, {**QWEN_1_5B, "max_position_embeddings": 32768},
                                                           "qwen-32k")))  # fmt: skip
    assert roomy.max_model_len is None  # its whole context fits: vLLM keeps its default
    assert "--max-model-len" not in VLLMLaunch(model="m", port=1, data_dir=tmp_path, **launch_options(roomy)).argv()


@pytest.mark.parametrize(
    ("flags", "rank", "loras"),
    [
        ([], 16, 4),
        (["--trainer-arg=--lora-r=32", "--keep-versions", "5"], 32, 6),
        (["--trainer-arg=--lora-r=24"], 32, 4),
    ],
    ids=["defaults", "rank-32-keep-5", "rank-24"],
)
def test_vllms_lora_limits_follow_the_trainers_rank_and_the_versions_kept(
    tmp_path: Path, flags: list[str], rank: int, loras: int
) -> None:
    from tracetrain_cli._serve_command import settings_from
    from tracetrain_cli._serve_devices import device_plan, launch_options

    args = serve_args("--device", "cpu", "--data-dir", str(tmp_path), *flags)
    devices = device_plan(args, "cpu", model_dir(tmp_path, QWEN_1_5B), settings_from(args).keep_versions)
    argv = VLLMLaunch(model="m", port=8001, data_dir=tmp_path, **launch_options(devices)).argv()
    assert (argv[argv.index("--max-lora-rank") + 1], argv[argv.index("--max-loras") + 1]) == (str(rank), str(loras))


def test_a_warm_start_adapters_rank_wins_and_limits_vllm_cannot_serve_are_refused(tmp_path: Path) -> None:
    from tracetrain_cli._serve_devices import device_plan

    adapter = tmp_path / "sft"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 64, "target_modules": ["q_proj", "v_proj"]}))
    model = model_dir(tmp_path, QWEN_1_5B)
    warm = device_plan(serve_args("--device", "cpu", f"--trainer-arg=--init-adapter={adapter}"), "cpu", model)
    assert warm.vllm_lora == VllmLora(max_rank=64, max_loras=4)
    with pytest.raises(SystemExit, match="--keep-versions"):
        device_plan(serve_args("--device", "cpu", "--vllm-arg=--max-loras=2"), "cpu", model)
    with pytest.raises(SystemExit, match="up to rank 512"):
        device_plan(serve_args("--device", "cpu", "--trainer-arg=--lora-r=600"), "cpu", model)


def test_vllm_in_sleep_mode_never_inherits_expandable_segments_and_the_trainer_keeps_them(tmp_path: Path) -> None:
    from proxy import Settings
    from tracetrain_cli._serve import ServePlan, _trainer_env

    inherited = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:512",
                 "PYTORCH_ALLOC_CONF": "expandable_segments:True"}  # fmt: skip
    launch = VLLMLaunch(model="m", port=8001, data_dir=tmp_path, device="cuda", sleep_mode=True)
    env = launch.env(inherited)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512" and "PYTORCH_ALLOC_CONF" not in env
    awake = VLLMLaunch(model="m", port=8001, data_dir=tmp_path, device="cuda").env(inherited)
    assert awake["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"  # no memory pool without sleep mode
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
        serve_plan = ServePlan(settings=Settings(data_dir=tmp_path), vllm=launch, trainer_argv=[])
        assert _trainer_env(serve_plan)["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"


def test_the_activation_estimate_covers_what_a_peft_backward_keeps_on_this_cpu(tiny_model_dir: Path) -> None:
    """Every tensor the decoder body saves for its backward, counted once per storage, against the estimate."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    tokens, needs = 512, TrainerNeeds(lora_r=8, micro_batch_tokens=512)
    model_shape = read_model_shape(tiny_model_dir)
    for dtype, bytes_per_param in ((torch.bfloat16, 2), (torch.float32, 4)):
        base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=dtype, attn_implementation="sdpa")
        model = get_peft_model(base, LoraConfig(r=8, target_modules=list(needs.target_modules)))
        saved: dict[int, int] = {}

        def keep(t: torch.Tensor, saved: dict[int, int] = saved) -> torch.Tensor:
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
            return t

        ids = torch.randint(3, 200, (1, tokens), generator=torch.Generator().manual_seed(0))
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            model.get_base_model().get_decoder()(input_ids=ids, use_cache=False)
        memory = estimate_memory(model_shape, TrainerNeeds(lora_r=8, micro_batch_tokens=tokens,
                                                           bytes_per_param=bytes_per_param))  # fmt: skip
        kept = sum(saved.values())
        assert kept <= memory.activations <= 1.5 * kept, (dtype, kept, memory.activations)
        if dtype == torch.bfloat16:  # without peft's fp32 copies the estimate would fall short
            assert memory.activations - memory.peft_inputs < kept


def test_the_estimate_plans_what_a_sleeping_vllm_keeps_and_the_host_ram_of_its_backup(tmp_path: Path) -> None:
    model = shape(tmp_path, QWEN_1_5B)
    p = plan(gpus(1), model)
    m = p.memory
    assert m.host_vllm_backup == model.weight_bytes  # level 1 copies the bf16 weights into pinned host memory
    assert m.host_trainer_load == model.weight_bytes  # one trainer process reads the base on the host
    assert m.host_vllm_loras == 4 * 2 * model.lora_params(16, DEFAULT_TARGET_MODULES)  # vLLM's copies of 4 adapters
    loras = m.host_vllm_loras
    assert m.host_peak(shared=True) == 2 * model.weight_bytes + loras
    assert m.host_peak(shared=False) == model.weight_bytes + loras
    text = render_plan(p)
    assert "asleep it keeps ~1.7 GiB" in text and "level-1 backup" in text and "peft's fp32 inputs" in text
    gpu = p.gpus[0]
    room = gpu.free - gpu.margin - m.trainer_resident - m.step
    assert room >= int(1.7 * GiB)  # the step fits beside a sleeping vLLM of 1.7 GiB, not only of 1 GiB
    too_little = 2 * model.weight_bytes + loras - 1
    forced = plan_gpus(parse_nvidia_smi(gpus(1)), model, TrainerNeeds(), host_ram=too_little,
                       overrides=Overrides(memory_fraction=p.memory_fraction))  # fmt: skip
    assert any("host RAM" in w for w in forced.warnings)
    with pytest.raises(PlanError, match="host RAM"):
        plan_gpus(parse_nvidia_smi(gpus(1)), model, TrainerNeeds(), host_ram=too_little)


def test_share_gpu_with_your_own_vllm_plans_the_trainer_beside_it_and_says_how_to_start_vllm(
    tmp_path: Path,
    fake_nvidia_smi: Path,  # noqa: F811  (the fixture imported above)
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = shape(tmp_path, QWEN_1_5B)
    busy = "{i}, NVIDIA H100 80GB HBM3, 81559, 73000"  # the user's vLLM is up, awake, at 0.9
    p = plan(gpus(1, busy), model, vllm=False, share=True)
    assert p.shared and p.trainer_gpus == (0,) and p.vllm_gpus == () and not p.warnings
    advice = next(reason for reason in p.why if "your vLLM" in reason)
    assert "--enable-sleep-mode" in advice and "VLLM_SERVER_DEV_MODE=1" in advice and "--max-loras 4" in advice
    fraction = float(advice.split("--gpu-memory-utilization ")[1].split()[0])
    gpu = p.gpus[0]
    assert int(gpu.total * fraction) + p.memory.trainer_resident + gpu.margin <= gpu.total

    serve = ["serve", "--plan-only", "--device", "cuda", "--model", str(model_dir(tmp_path, QWEN_1_5B, "m")),
             "--upstream", "http://127.0.0.1:9/v1", "--share-gpu", "--data-dir", str(tmp_path / "d")]  # fmt: skip
    assert main(serve) == 0
    assert "your vLLM (--upstream) shares GPU 0" in capsys.readouterr().out
