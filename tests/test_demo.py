"""The demo's parts: the task's checker, the agent and the reward service, on loopback.

The agent and the reward service run against the real proxy (the fake vLLM behind it):
an attempt is captured as one trajectory in its group, the reward service reads it back
and posts the checker's reward. The whole demo on real vLLM is `make demo`.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from conftest import RunningProxy
from fake_vllm import FakeVLLM, Reply

from tracetrain import Client
from tracetrain_demo import agent, reward_service
from tracetrain_demo.task import by_prompt, json_city, scenarios, score
from tracetrain_demo.tasks import TASKS, Task


def test_the_split_is_fixed_and_held_out_requests_name_only_cities_never_trained_on() -> None:
    train, held_out = scenarios()
    assert (len(train), len(held_out)) == (400, 100)
    trained_cities = {c for s in train for c in (s.origin, s.destination)}
    assert not trained_cities & {c for s in held_out for c in (s.origin, s.destination)}
    assert len({s.prompt for s in train + held_out}) == 500
    assert all(s.origin != s.destination and s.destination in s.prompt for s in train + held_out)


@pytest.mark.parametrize(
    ("reply", "reward", "success"),
    [
        ('{"city": "DEST"}', 1.0, True),
        ('```json\n{"city": "LOWER"}\n```', 1.0, True),  # a code fence, another case
        ('{"city": "ORIGIN"}', 0.4, False),  # valid JSON, the city the traveller leaves
        ('{"city": "DEST"}\nThat is where the hotel is.', 0.2, False),  # prose after the JSON
        ("The hotel is in DEST.", 0.2, False),  # right city, not JSON
        ("The hotel is in DESTville.", 0.0, False),  # a word containing it is not it
        ('{"city": ["DEST"]}', 0.2, False),
        ('{"town": "DEST"}', 0.2, False),
        ("", 0.0, False),
    ],
)
def test_the_checker_gives_partial_credit(reply: str, reward: float, success: bool) -> None:
    request = scenarios()[0][0]
    names = {"DEST": request.destination, "ORIGIN": request.origin, "LOWER": request.destination.lower()}
    for marker, name in names.items():
        reply = reply.replace(marker, name)
    result = score(request, reply)
    assert result.reward == pytest.approx(reward)
    assert result.success is success


def test_accents_and_case_do_not_matter_and_every_request_is_found_by_its_prompt() -> None:
    malaga = next(s for s in scenarios()[0] + scenarios()[1] if s.destination == "Malaga")
    assert score(malaga, '{"city": "Málaga"}').success
    assert score(malaga, '{"city": "MALAGA"}').success
    assert json_city('{"city": 3}') is None
    assert all(by_prompt()[s.prompt] is s for s in scenarios()[0] + scenarios()[1])


@pytest.fixture
def rewards_url(proxy: RunningProxy) -> Iterator[str]:
    client = Client(proxy.url)
    handler = type("Handler", (reward_service._Handler,), {"client": client})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/finished"
    server.shutdown()
    server.server_close()
    client.close()


def test_an_attempt_is_one_trajectory_and_the_reward_service_scores_it(
    proxy: RunningProxy, fake: FakeVLLM, rewards_url: str
) -> None:
    request = scenarios()[0][0]
    fake.script(Reply(content=f'{{"city": "{request.destination}"}}'), Reply(content=f'{{"city": "{request.origin}"}}'))
    client = proxy.client()
    first = agent.attempt(client, "agent", request, "r-0", "r", temperature=1.0, max_tokens=16)
    second = agent.attempt(client, "agent", request, "r-1", "r", temperature=1.0, max_tokens=16)
    assert first["served_by"] == second["served_by"] == "agent@0"
    assert fake.requests[0]["messages"] == [{"role": "user", "content": request.prompt}]

    for trajectory_id in ("r-0", "r-1"):
        assert httpx.post(rewards_url, json={"trajectory_id": trajectory_id}).status_code == 204
    sdk = Client(proxy.url)
    rewards = {t.id: t.reward for t in sdk.list_trajectories(group_id="r").data}
    assert rewards == {"r-0": pytest.approx(1.0), "r-1": pytest.approx(0.4)}
    [group] = sdk.list_groups().data
    assert group.state == "ready" and group.size == 2
    sdk.close()

    assert httpx.post(rewards_url, json={"trajectory_id": "no-such-thing"}).status_code == 400


def test_the_agent_reads_only_the_environment_and_reports_each_attempt(
    proxy: RunningProxy, rewards_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", proxy.v1)
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    assert agent.main(["--questions", "2", "--attempts", "3", "--done-url", rewards_url, "--tag", "t"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(printed) == 6
    sdk = Client(proxy.url)
    trajectories = sdk.list_trajectories(limit=50).data
    assert len(trajectories) == 6 and all(t.n_calls == 1 for t in trajectories)
    # the fake echoes the request (no JSON): each reward is the checker's for what the agent printed
    rewards = {t.id: t.reward for t in trajectories}
    assert rewards == {e["trajectory_id"]: score(by_prompt()[e["prompt"]], e["reply"]).reward for e in printed}
    assert all(reward < 0.4 for reward in rewards.values())
    assert len({t.group_id for t in trajectories}) == 2
    sdk.close()


def test_the_structured_city_agent_asks_for_its_json_with_a_schema_and_the_call_records_its_grammar(
    proxy: RunningProxy, fake: FakeVLLM, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tracetrain_demo.city_agent import CITY_FORMAT
    from tracetrain_demo.run import _parse

    monkeypatch.setenv("OPENAI_BASE_URL", proxy.v1)
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    assert agent.main(["--questions", "1", "--attempts", "2", "--tag", "s", "--structured"]) == 0
    schema = CITY_FORMAT["json_schema"]["schema"]
    assert [r["structured_outputs"] for r in fake.requests] == [{"json": schema}] * 2
    sdk = Client(proxy.url)
    [trajectory, _] = sdk.list_trajectories(limit=50).data
    call = httpx.get(f"{proxy.v1}/trajectories/{trajectory.id}").json()["calls"][0]
    assert call["structured_outputs"] == {"json": schema}
    sdk.close()
    assert _parse(["--structured"]).structured
    with pytest.raises(SystemExit):
        _parse(["--task", "lookup", "--structured"])  # the tool tasks constrain their first call already


def test_the_demo_uses_the_admin_token_serve_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tracetrain_demo.serve_api import admin_token

    monkeypatch.delenv("TRACETRAIN_ADMIN_TOKEN", raising=False)
    with pytest.raises(SystemExit, match="set TRACETRAIN_ADMIN_TOKEN"):
        admin_token(tmp_path)
    (tmp_path / "admin-token").write_text("made-by-serve-" + "x" * 20 + "\n")  # as `tracetrain serve` writes it
    assert admin_token(tmp_path) == "made-by-serve-" + "x" * 20
    monkeypatch.setenv("TRACETRAIN_ADMIN_TOKEN", "from-the-environment-" + "y" * 10)
    assert admin_token(tmp_path) == "from-the-environment-" + "y" * 10


def test_busy_fractions_count_overlapping_spans_once() -> None:
    from tracetrain_demo.report import Report

    report = Report(training_window=(0.0, 100.0))
    report.sampling = [(0.0, 30.0), (20.0, 50.0), (90.0, 130.0)]  # overlapping rounds; one runs past the end
    report.training = [(40.0, 60.0), (-10.0, 5.0)]  # one began before the window
    busy = report.busy()
    assert busy == pytest.approx({"sampling": 0.6, "training": 0.25, "both": 0.15})


def test_the_summary_without_held_out_evaluations_still_writes_the_numbers_and_the_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tracetrain_demo.report import Report, Step, summary

    report = Report(seconds=90.0, training_window=(0.0, 90.0))
    report.steps = [Step(1, 0.2, 0.1, 5.0, 10.0, samples=32, off_policy=0), Step(2, 0.5, 0.1, 5.0, 10.0, samples=32,
                    off_policy=32)]  # fmt: skip
    summary(report, tmp_path)
    assert "held-out success: not measured" in capsys.readouterr().out
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["before"] is None and [s["version"] for s in results["steps"]] == [1, 2]
    assert (tmp_path / "reward-curve.png").stat().st_size > 0


def test_bf16_is_chosen_only_where_the_cpu_has_bf16_units_and_the_task_gains_by_it(tmp_path: Path) -> None:
    from tracetrain_demo.tasks import TASKS, precision

    bf16, avx2 = tmp_path / "bf16", tmp_path / "avx2"
    bf16.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n")
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\n")
    city, lookup, sdk = TASKS["city"], TASKS["lookup"], TASKS["agents-sdk"]
    # (vLLM's, the trainer's)
    assert precision(city, "auto", "auto", bf16) == ("bfloat16", "float32")  # sampling bound: vLLM alone
    assert precision(lookup, "auto", "auto", bf16) == ("bfloat16", "bfloat16")  # training bound: both
    assert precision(sdk, "auto", "auto", bf16) == ("bfloat16", "bfloat16")
    for task in (city, lookup, sdk):  # an AVX2 CPU (or none known): float32 on both sides, as serve's default
        assert precision(task, "auto", "auto", avx2) == ("float32", "float32")
        assert precision(task, "auto", "auto", tmp_path / "missing") == ("float32", "float32")
    assert precision(city, "float32", "auto", bf16) == ("float32", "float32")  # the user's choice wins
    assert precision(lookup, "auto", "float32", bf16) == ("bfloat16", "float32")
    assert precision(lookup, "auto", "bfloat16", avx2) == ("bfloat16", "bfloat16")  # vLLM follows the trainer


def test_each_versions_training_success_is_read_from_what_the_proxy_recorded(
    proxy: RunningProxy, fake: FakeVLLM, rewards_url: str
) -> None:
    from tracetrain_demo.serve_api import training_success

    request = scenarios()[0][0]
    right, wrong = f'{{"city": "{request.destination}"}}', f'{{"city": "{request.origin}"}}'
    fake.script(*[Reply(content=right)] * 12, *[Reply(content=wrong)] * 4)
    client = proxy.client()
    for k in range(16):  # the agent's headers are all that ties an attempt to its group; no agent log is read
        agent.attempt(client, "agent", request, f"v-{k}", "v", temperature=1.0, max_tokens=16)
        assert httpx.post(rewards_url, json={"trajectory_id": f"v-{k}"}).status_code == 204
    agent.attempt(client, "agent", request, "unrewarded", "u", temperature=1.0, max_tokens=16)
    assert training_success(proxy.url) == {0: pytest.approx(0.75)}  # served by agent@0; unrewarded ones left out
    assert training_success(proxy.url, "agent") == {0: pytest.approx(0.75)}  # a lane asks for its own policy
    assert training_success(proxy.url, "lookup") == {}  # another policy's attempts are not this one's


def test_the_demo_resumes_training_after_the_regression_guard_rolls_a_version_back(
    start_proxy: Callable[..., RunningProxy], tmp_path: Path
) -> None:
    """The guard pauses training until an admin resumes; the demo, the admin of its own serve, says why and resumes,
    so that the rest of its minutes train on the version restored instead of idling."""
    from test_regression_guard import GUARDED, baseline, publish, until_decided

    from tracetrain_demo.serve_api import resume_if_paused

    proxy = start_proxy(**GUARDED)  # no admin token: loopback is trusted (the guard tests' helpers rely on it)
    token = "unused-on-loopback"
    assert resume_if_paused(proxy.url, token) is None  # nothing to resume
    rng = random.Random(7)
    baseline(proxy, rng, 0.8)
    publish(proxy, 1, tmp_path)
    verdict, _ = until_decided(proxy, 1, lambda: [0.0, float(rng.random() < 0.1)])
    assert verdict["state"] == "rolled_back"

    reason = resume_if_paused(proxy.url, token, "agent")  # each lane resumes its own policy

    assert reason is not None and reason.startswith("regression guard: agent@1 rolled back to @0")
    assert not httpx.get(f"{proxy.url}/admin/training", params={"policy": "agent"}).json()["paused"]
    assert resume_if_paused(proxy.url, token, "agent") is None


def test_several_tasks_share_one_precision_and_train_for_the_longest_default(tmp_path: Path) -> None:
    from tracetrain_demo.run import _minutes, _parse, _precision

    bf16, avx2 = tmp_path / "bf16", tmp_path / "avx2"
    bf16.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n")
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\n")
    both = _parse(["--task", "city,agents-sdk"])
    assert both.tasks == ["city", "agents-sdk"]
    # One vLLM, one trainer: each side in bf16 only where every task gains by it.
    assert _precision(both, bf16) == ("bfloat16", "float32")
    assert _precision(_parse(["--task", "lookup,agents-sdk"]), bf16) == ("bfloat16", "bfloat16")
    assert _precision(both, avx2) == ("float32", "float32")
    chosen = _parse(["--task", "city,lookup", "--trainer-dtype", "bfloat16"])
    assert _precision(chosen, bf16) == ("bfloat16", "bfloat16")  # the user's choice wins
    assert _minutes(_parse([])) == 4.5  # the city task's
    assert _minutes(both) == 10.0  # the longest task's
    assert _minutes(_parse(["--task", "lookup"])) == 9.0
    assert _minutes(_parse(["--task", "city,lookup", "--minutes", "2"])) == 2.0


def test_the_trainer_takes_each_tasks_correction_and_advantage_scale_and_the_flag_wins() -> None:
    from tracetrain_demo.run import train_config
    from trainer import TrainConfig

    city, lookup, sdk = TASKS["city"], TASKS["lookup"], TASKS["agents-sdk"]

    def config(*tasks: Task, correction: str | None = None) -> TrainConfig:
        return TrainConfig.from_dict(train_config(tasks, 3e-4, "float32", correction))  # the trainer reads it

    assert (config(city).sampler_correction, config(city).scale_advantages) == ("auto", True)
    # The tool task: tis for its constrained first call, each group's rewards less their mean alone.
    assert (config(lookup).sampler_correction, config(lookup).scale_advantages) == ("tis", False)
    assert config(sdk).scale_advantages is True
    # One trainer for several tasks: the strictest correction, advantages scaled unless no task wants them so.
    assert (config(city, lookup).sampler_correction, config(city, lookup).scale_advantages) == ("tis", True)
    assert config(lookup, correction="mis").sampler_correction == "mis"
    assert config(lookup).learning_rate == 3e-4


def test_each_task_measures_held_out_success_during_training_at_its_own_pace() -> None:
    from tracetrain_demo.run import _eval_every, _parse

    assert (_eval_every(_parse([]), "city"), _eval_every(_parse([]), "agents-sdk")) == (3.0, 3.0)
    assert _eval_every(_parse(["--task", "lookup"]), "lookup") == 0.0  # before and after only
    assert _eval_every(_parse(["--task", "lookup", "--eval-every", "2"]), "lookup") == 2.0


def test_held_out_evaluations_beside_training_keep_few_attempts_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tracetrain_demo._lane as lane_module
    from tracetrain_demo._lane import Evaluation, Lane
    from tracetrain_demo.run import _BESIDE_TRAINING, _parse

    commands: list[list[str]] = []

    class Recorded:  # the agent's process, as far as an Evaluation starts it
        def __init__(self, name: str, command: list[str], env: dict[str, str], log: Path) -> None:
            commands.append(command)

        def start(self) -> None:
            pass

    monkeypatch.setattr(lane_module, "ChildProcess", Recorded)
    lane, args = Lane("lookup", "lookup", "http://127.0.0.1:1", tmp_path, 0), _parse([])
    Evaluation(lane, 0, 2, args, [], concurrency=_BESIDE_TRAINING)  # beside training
    Evaluation(lane, 3, 2, args, [])  # after training, on an idle vLLM
    beside, after = (command[command.index("--concurrency") + 1] for command in commands)
    assert (beside, after) == ("16", "64")
    assert commands[0][commands[0].index("--model") + 1] == "lookup@0"


def test_call_rewards_give_serve_the_turn_discount_and_need_a_task_whose_checker_judges_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tracetrain_demo.run as run

    commands: list[list[str]] = []

    class Recorded:  # serve, as far as the demo starts it and waits for it
        def __init__(self, name: str, command: list[str], env: dict[str, str], log: Path) -> None:
            commands.append(command)
            self.log_path = log

        def start(self) -> None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log_path.touch()

        async def wait_for_output(self, text: str, timeout_s: float) -> None:
            pass

    monkeypatch.setattr(run, "ChildProcess", Recorded)
    monkeypatch.setattr(run, "_pull_model", lambda data_dir: tmp_path / "model")

    def serve_command(*argv: str) -> list[str]:
        commands.clear()
        run._start_serve(run._parse(["--port", "8100", *argv]), tmp_path, tmp_path / "demo", [])
        return commands[0]

    assert "--turn-discount=0.0" in serve_command("--task", "lookup", "--call-rewards")  # the demo's default
    assert "--turn-discount=0.5" in serve_command("--task", "agents-sdk", "--call-rewards", "--turn-discount", "0.5")
    assert not any(arg.startswith("--turn-discount") for arg in serve_command("--task", "lookup"))
    for refused in (["--call-rewards"], ["--task", "lookup", "--turn-discount", "0.5"],
                    ["--task", "lookup", "--call-rewards", "--turn-discount", "1.5"]):  # fmt: skip
        with pytest.raises(SystemExit):
            run._parse(refused)
    assert run._parse(["--task", "city,lookup", "--call-rewards"]).turn_discount == 0.0  # lookup's lane takes them
