"""Several policies as ``tracetrain serve`` runs them and as an operator sees them: the flags, vLLM's LoRA
limits and the memory plan, the trainer's command line, the dashboard, /metrics, the trainer's switch
between policies, the demo's two tasks at once."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from conftest import RunningProxy
from test_admin import csrf_of
from test_gpu_plan import QWEN_1_5B, model_dir

SQL_KEY = "sql-key-" + "q" * 24


def serve_args(*flags: str) -> argparse.Namespace:
    from tracetrain_cli._serve_flags import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *flags])


def test_serve_takes_several_policies_each_ones_settings_file_and_keys(tmp_path: Path) -> None:
    from tracetrain_cli._serve import trainer_argv
    from tracetrain_cli._serve_command import kept_loaded, settings_from

    (tmp_path / "rubric.md").write_text("Correct SQL wins.")
    (tmp_path / "sql.toml").write_text('group_size = 4\nkeep_versions = 5\nreward_source = "both"\n'
                                       'judge_rubric = "@rubric.md"\n[sampling]\ntemperature = 0.7\n')  # fmt: skip
    (tmp_path / "support.json").write_text('{"batch_groups": 2}')
    settings = settings_from(serve_args(
        "--policy", "support", "--policy", "sql", "--policy-config", f"sql={tmp_path / 'sql.toml'}",
        "--policy-config", f"support={tmp_path / 'support.json'}", "--policy-key", f"sql={SQL_KEY}",
        "--data-dir", str(tmp_path),
    ))  # fmt: skip
    assert settings.policies == ("support", "sql")
    sql = settings.policy_configs["sql"]
    assert (sql.group_size, sql.keep_versions, sql.judge_rubric, sql.sampling and sql.sampling.temperature) == (
        4, 5, "Correct SQL wins.", 0.7)  # fmt: skip
    assert settings.policy_configs["support"].batch_groups == 2
    assert [(name, key.get_secret_value()) for name, key in settings.policy_keys] == [("sql", SQL_KEY)]
    assert kept_loaded(settings) == 3 + 5  # support's window (the server's) and sql's
    argv = trainer_argv(settings, tmp_path, "cpu", [])
    assert "--policy" not in argv  # the trainer trains every policy the store serves, added ones too
    assert settings_from(serve_args("--data-dir", str(tmp_path))).policies == ("agent",)  # as before

    for flags, problem in (
        (["--policy-config", "sql"], "NAME=FILE"),
        (["--policy-config", f"sql={tmp_path / 'missing.toml'}"], "cannot read"),
        (["--policy", "sql", "--policy-config", f"support={tmp_path / 'support.json'}"], "does not name"),
        (["--policy", "a", "--policy", "a"], "named twice"),
        (["--policy", "../x"], "policies"),
        (["--policy-key", "sql"], "NAME=KEY"),
    ):
        with pytest.raises(SystemExit, match=problem):
            settings_from(serve_args("--data-dir", str(tmp_path), *flags))
    (tmp_path / "bad.toml").write_text("group_size = 0\n")
    with pytest.raises(SystemExit, match="group_size"):
        settings_from(serve_args("--policy-config", f"agent={tmp_path / 'bad.toml'}", "--data-dir", str(tmp_path)))


def test_vllm_holds_every_policys_versions_and_the_plan_counts_them(tmp_path: Path) -> None:
    from tracetrain_cli._gpu_estimate import estimate_memory
    from tracetrain_cli._gpu_inputs import read_model_shape
    from tracetrain_cli._gpu_render import render_plan
    from tracetrain_cli._serve_devices import device_plan, launch_options

    model = model_dir(tmp_path, QWEN_1_5B)
    one, three = (device_plan(serve_args("--device", "cpu"), "cpu", model, kept) for kept in (3, 9))
    assert (one.vllm_lora.max_loras, three.vllm_lora.max_loras) == (4, 10)  # every policy's window, plus one
    assert launch_options(three)["max_loras"] == 10 and "--max-loras 10" in render_plan(three)
    asked = device_plan(serve_args("--device", "cpu", "--max-loras", "16"), "cpu", model, 9)
    assert asked.vllm_lora.max_loras == 16  # room for the policies to be added at run time
    shape = read_model_shape(model)
    small, large = (estimate_memory(shape, None, vllm_lora=p.vllm_lora) for p in (one, three))
    assert large.vllm_weights - small.vllm_weights == large.host_vllm_loras - small.host_vllm_loras > 0
    with pytest.raises(SystemExit, match="serve's own --max-loras"):
        device_plan(serve_args("--device", "cpu", "--vllm-arg=--max-loras=2"), "cpu", model)


def test_the_dashboard_picks_a_policy_and_shows_each_page_per_policy(
    start_proxy: Callable[..., RunningProxy],
) -> None:
    proxy = start_proxy(policies=("support", "sql"))
    for model in ("support", "sql"):
        proxy.client().chat.completions.create(model=model, messages=[{"role": "user", "content": model}])
    overview = httpx.get(f"{proxy.url}/admin").text
    assert 'id="policy-picker"' in overview and 'id="policy-support"' in overview and 'id="policy-sql"' in overview
    only_sql = httpx.get(f"{proxy.url}/admin/ui/trajectories", params={"policy": "sql"}).text
    assert only_sql.count("<td>sql</td>") == 1 and "<td>support</td>" not in only_sql
    assert "Training of sql" in httpx.get(f"{proxy.url}/admin/ui/training").text  # the first served, by name
    training = httpx.get(f"{proxy.url}/admin/ui/training", params={"policy": "sql"}).text
    assert "Training of sql" in training and 'href="/admin/ui/adapters?policy=sql"' in training
    adapters = httpx.get(f"{proxy.url}/admin/ui/adapters", params={"policy": "sql"}).text
    assert 'name="policy" value="sql"' in adapters and "Train sql now" in adapters
    assert httpx.get(f"{proxy.url}/admin/ui/adapters", params={"policy": "nope"}).status_code == 404
    assert httpx.get(f"{proxy.url}/admin/ui/adapters", params={"policy": "../x"}).status_code == 400

    page = httpx.get(f"{proxy.url}/admin/ui/policies").text
    token = csrf_of(page)
    added = httpx.post(f"{proxy.url}/admin/ui/policies", data={"csrf_token": token, "name": "tickets"})
    assert added.status_code == 303 and "notice=added" in added.headers["location"]
    assert "Serving tickets" in httpx.get(f"{proxy.url}{added.headers['location']}").text
    retired = httpx.post(f"{proxy.url}/admin/ui/policies/tickets/retire", data={"csrf_token": token})
    assert retired.status_code == 303
    page = httpx.get(f"{proxy.url}/admin/ui/policies").text
    assert re.search(r'id="policy-tickets".*?retired.*?Serve again', page, re.S)
    queued = httpx.post(f"{proxy.url}/admin/ui/train", data={"csrf_token": token, "policy": "sql"})
    assert queued.status_code == 400 and "No group is ready to train sql on" in queued.text


def test_metrics_label_each_policys_series(start_proxy: Callable[..., RunningProxy]) -> None:
    proxy = start_proxy(policies=("support", "sql"))
    for model in ("support", "sql", "sql"):
        proxy.client().chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
    text = httpx.get(f"{proxy.url}/metrics").text
    for policy, calls in (("support", 1), ("sql", 2)):
        requests = f'tracetrain_requests_total{{endpoint="chat.completions",policy="{policy}",status="200"}}'
        assert f"{requests} {calls}.0" in text
        assert f'tracetrain_captured_calls_total{{policy="{policy}"}} {calls}.0' in text
        assert f'tracetrain_versions_loaded{{policy="{policy}"}} 1.0' in text
        assert f'tracetrain_training_jobs{{policy="{policy}",state="queued"}} 0.0' in text


def test_the_trainer_moves_to_another_policys_adapter_in_place_as_if_it_had_loaded_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Learner.switch: the base stays, the LoRA and AdamW state become the adapter's: equal to a learner built
    from it, and its next step equal too."""
    import torch
    from distributed_learner import batch
    from tiny_model import build_tiny_lora

    from trainer import Learner, TrainConfig

    cfg = TrainConfig(lora_r=8, lora_alpha=16, dtype="float32")
    other = build_tiny_lora(tiny_model_dir, tmp_path / "other", r=8, seed=3)
    learner = Learner(tiny_model_dir, cfg)
    fresh = {n: p.detach().clone() for n, p in learner.model.named_parameters() if p.requires_grad}
    learner.step(batch())
    assert learner.switch(other)
    built = Learner(tiny_model_dir, cfg, adapter=other)
    mine = dict(learner.model.named_parameters())
    for name, param in built.model.named_parameters():
        if param.requires_grad:
            assert torch.equal(mine[name], param), name
    assert learner.step(batch()).loss == pytest.approx(built.step(batch()).loss, rel=1e-5)
    assert learner.switch(None)  # a policy with no adapter yet: the fresh LoRA this learner began with
    assert all(torch.equal(mine[name], value) for name, value in fresh.items())
    assert not learner.switch(build_tiny_lora(tiny_model_dir, tmp_path / "r4", r=4))  # another shape: rebuild


def test_the_demo_takes_both_tasks_as_two_policies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from tracetrain_demo.report import Report, Step, summary
    from tracetrain_demo.run import _parse

    assert _parse(["--task", "city,lookup"]).tasks == ["city", "lookup"]
    assert _parse([]).tasks == ["city"]
    for bad in ("city,city", "city,nope", ","):
        with pytest.raises(SystemExit):
            _parse(["--task", bad])
    for policy in ("city", "lookup"):
        report = Report(policy=policy, seconds=60.0, training_window=(0.0, 60.0))
        report.steps = [Step(1, 0.4, 0.1, 5.0, 10.0, samples=32)]
        summary(report, tmp_path, suffix=f"-{policy}")
    assert "city:" in capsys.readouterr().out
    for policy in ("city", "lookup"):
        assert json.loads((tmp_path / f"results-{policy}.json").read_text())["policy"] == policy
        assert (tmp_path / f"reward-curve-{policy}.png").stat().st_size > 0
