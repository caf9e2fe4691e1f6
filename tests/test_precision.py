"""Sampler and learner compute alike by default: the one choice of both dtypes (tracetrain_cli._precision)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tracetrain_cli._precision import agree, trainer_dtype
from tracetrain_cli._serve_command import _precision_args
from tracetrain_cli._vllm_process import VLLMLaunch
from trainer._config import TrainConfig


def test_on_a_cpu_vllm_samples_in_the_trainers_float32_by_default() -> None:
    precision = agree("cpu")
    assert (precision.sampler, precision.learner, precision.agree) == ("float32", "float32", True)
    assert "they agree" in precision.line()
    argv = VLLMLaunch(model="m", port=8001, data_dir=Path("/d"), dtype=precision.sampler).argv()
    assert argv[argv.index("--dtype") + 1] == "float32"


def test_bfloat16_asked_for_both_makes_both_bfloat16_and_turns_the_correction_on() -> None:
    precision = agree("cpu", dtype="bfloat16")
    assert (precision.sampler, precision.learner, precision.agree) == ("bfloat16", "bfloat16", False)
    assert "corrects" in precision.line()


def test_the_trainers_own_config_dtype_wins_and_vllm_follows_it(tmp_path: Path) -> None:
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"dtype": "bfloat16", "learning_rate": 1e-4}))
    named = trainer_dtype([f"--config={config}", "--lora-r=8"])
    assert named == "bfloat16"
    assert agree("cpu", trainer_dtype=named).sampler == "bfloat16"
    assert trainer_dtype(["--dtype", "float32", f"--config={config}"]) == "float32"  # the flag overrides the file
    assert trainer_dtype([]) is None


def test_a_forced_sampler_dtype_differs_from_the_learner_and_says_why() -> None:
    precision = agree("cpu", sampler_dtype="bfloat16")
    assert (precision.sampler, precision.learner, precision.agree) == ("bfloat16", "float32", False)
    assert "--sampler-dtype" in precision.line()


def test_on_a_gpu_vllm_keeps_its_own_dtype_and_the_two_never_agree_by_default() -> None:
    precision = agree("cuda")
    assert (precision.sampler, precision.learner, precision.agree) == ("auto", "auto", False)


def test_an_unreadable_trainer_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="cannot read the trainer's settings"):
        trainer_dtype([f"--config={tmp_path / 'missing.json'}"])


@pytest.mark.parametrize(("sampler", "expected"), [("float32", "none"), ("bfloat16", "tis")])
def test_the_trainer_corrects_exactly_when_serve_says_the_sampler_differs(sampler: str, expected: str) -> None:
    # What serve passes the trainer decides the loss's default correction.
    args = argparse.Namespace(upstream=None)
    flags = _precision_args(agree("cpu", sampler_dtype=sampler), args)  # type: ignore[arg-type]
    assert flags == ["--dtype=float32", f"--sampler-dtype={sampler}"]
    cfg = TrainConfig(dtype="float32", sampler_dtype=sampler)  # type: ignore[arg-type]
    assert cfg.resolved_correction(learner_float32=True, cuda=False) == expected


def test_with_a_vllm_someone_else_runs_the_trainer_is_not_told_a_sampler_dtype() -> None:
    assert _precision_args(agree("cpu"), argparse.Namespace(upstream=["http://x/v1"])) == ["--dtype=float32"]
    cfg = TrainConfig()
    assert cfg.resolved_correction(learner_float32=True, cuda=False) == "none"
    assert cfg.resolved_correction(learner_float32=True, cuda=True) == "tis"
    assert cfg.resolved_correction(learner_float32=False, cuda=False) == "tis"
    assert TrainConfig(sampler_correction="mis").resolved_correction(learner_float32=True, cuda=False) == "mis"
