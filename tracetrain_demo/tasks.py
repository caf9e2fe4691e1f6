"""The demo's built-in tasks, by name: what the agent does, how an attempt is scored, what serve needs.

``city`` (the default): one call, name the city that needs a hotel as JSON (``tracetrain_demo.task``).
``lookup``: look the hotel up with a function tool, read the result, answer as JSON; two calls or
more per attempt (``tracetrain_demo.lookup``).
``agents-sdk``: the same lookup by an OpenAI Agents SDK agent through the Responses API
(``tracetrain_demo.agents_sdk``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from tracetrain import Trajectory
from tracetrain_demo import agents_sdk, lookup, task
from tracetrain_vllm import cpu_has_bf16


class Scored(Protocol):
    @property
    def reward(self) -> float: ...
    @property
    def success(self) -> bool: ...

    def metrics(self) -> dict[str, float]: ...


@dataclass(frozen=True)
class Task:
    name: str
    scenarios: Callable[[], tuple[Sequence[Any], Sequence[Any]]]
    # The agent's attempt: (client, model, scenario, ids, ...) -> episode, or async (model, scenario, ids, ...).
    attempt: Callable[..., Any]
    score_episode: Callable[[dict[str, Any]], Scored]  # from what the agent printed
    score_trajectory: Callable[[Trajectory], Scored]  # from what the proxy captured (the reward service)
    max_tokens: int  # per call
    minutes: float  # the demo's training minutes by default (docs/BENCHMARKS.md: the runs that sized them)
    # Minutes between the demo's held-out measurements during training (0: before and after only). A tool task's
    # measurement (200 attempts of 2+ calls) takes vLLM about 3 minutes beside the rounds: taken every 3 minutes
    # they ran back to back, cost the lookup task about a fifth of its steps per minute, and the last one ran 2
    # minutes past the training's end (docs/BENCHMARKS.md).
    eval_every: float = 3.0
    serve_args: tuple[str, ...] = ()  # added to `tracetrain serve`'s command line
    sampler_correction: str = "auto"  # the trainer's default for this task (TrainConfig.sampler_correction)
    # Divide each group's advantages by its reward std (TrainConfig.scale_rewards). False: reward minus the group's
    # mean alone, as Dr. GRPO (Liu et al., 2025) argues, so that a group whose attempts nearly all score alike does
    # not weigh as much as one whose attempts differ.
    scale_rewards: bool = True
    # What computes in bf16 on a CPU with bf16 units (None: nothing; float32 on both sides, as on any other CPU).
    # "sampler": vLLM alone (the trainer stays in float32; TIS corrects the gap): the city task made 35 steps and
    # +90 points where float32 sampling made 17 and +68. "both": vLLM, and the trainer under bf16 autocast: the tool
    # task's step trains ~8,600 tokens, 2x faster so (docs/BENCHMARKS.md).
    bf16: Literal["sampler", "both"] | None = None
    # Each call's own reward, (call id, reward) for the calls the checker can judge apart from the answer (the
    # reward service's --call-rewards); None: the task's checker judges whole attempts only.
    score_calls: Callable[[Trajectory], list[tuple[str, float]]] | None = None


def _city_episode(episode: dict[str, Any]) -> Scored:
    return task.score(task.by_prompt()[episode["prompt"]], episode["reply"])


def _city_trajectory(trajectory: Trajectory) -> Scored:
    last = trajectory.calls[-1]
    scenario = task.by_prompt().get(last.request["messages"][0]["content"])
    if scenario is None:
        raise ValueError(f"trajectory {trajectory.id} does not start with one of the task's requests")
    return task.score(scenario, _reply(last.response))


def _lookup_episode(episode: dict[str, Any]) -> Scored:
    return lookup.score(lookup.by_prompt()[episode["prompt"]], list(episode["tool_cities"]), episode["reply"])


def _lookup_trajectory(trajectory: Trajectory) -> Scored:
    last = trajectory.calls[-1]
    messages = list(last.request["messages"])
    answer = _message(last.response)
    cities = lookup.tool_cities([*messages, answer])  # the last call's own tool calls count too
    return lookup.score(_lookup_scenario(trajectory), cities, "" if answer.get("tool_calls") else _reply(last.response))


def _lookup_calls(trajectory: Trajectory) -> list[tuple[str, float]]:
    scenario = _lookup_scenario(trajectory)
    rewards = [(call.id, lookup.call_reward(scenario, lookup.tool_cities([_message(call.response)])))
               for call in trajectory.calls]  # fmt: skip
    return [(call_id, reward) for call_id, reward in rewards if reward is not None]


def _lookup_scenario(trajectory: Trajectory) -> task.Scenario:
    messages = list(trajectory.calls[-1].request["messages"])
    user = next((m.get("content") for m in messages if m.get("role") == "user"), None)
    scenario = lookup.by_prompt().get(user) if isinstance(user, str) else None
    if scenario is None:
        raise ValueError(f"trajectory {trajectory.id} does not start with one of the task's requests")
    return scenario


def _agents_sdk_trajectory(trajectory: Trajectory) -> Scored:
    last = trajectory.calls[-1]
    return agents_sdk.score_call(last.request, last.response)


def _agents_sdk_calls(trajectory: Trajectory) -> list[tuple[str, float]]:
    rewards = [(c.id, agents_sdk.call_reward(c.request, c.response)) for c in trajectory.calls]
    return [(call_id, reward) for call_id, reward in rewards if reward is not None]


def _message(response: dict[str, Any] | None) -> dict[str, Any]:
    return dict(((response or {}).get("choices") or [{}])[0].get("message") or {})


def _reply(response: dict[str, Any] | None) -> str:
    return str(((response or {}).get("choices") or [{}])[0].get("message", {}).get("content") or "")


def _city_attempt(*args: Any, **kwargs: Any) -> dict[str, object]:
    from tracetrain_demo.city_agent import attempt

    return attempt(*args, **kwargs)


def _lookup_attempt(*args: Any, **kwargs: Any) -> dict[str, object]:
    from tracetrain_demo.lookup_agent import attempt

    return attempt(*args, **kwargs)


async def _agents_sdk_attempt(*args: Any, **kwargs: Any) -> dict[str, object]:
    from tracetrain_demo.agents_sdk_agent import attempt  # the SDK is imported by the agent's process alone

    return await attempt(*args, **kwargs)


TASKS: dict[str, Task] = {
    "city": Task(
        "city",
        task.scenarios,
        _city_attempt,
        _city_episode,
        _city_trajectory,
        max_tokens=24,
        minutes=4.5,
        bf16="sampler",
    ),
    "lookup": Task(
        "lookup",
        lookup.scenarios,
        _lookup_attempt,
        _lookup_episode,
        _lookup_trajectory,
        score_calls=_lookup_calls,
        max_tokens=48,
        minutes=9.0,
        eval_every=0.0,
        serve_args=(f"--vllm-arg=--chat-template={lookup.TEMPLATE}",),
        # The first call is constrained (tool_choice "required"): vLLM's logprobs are over what the grammar
        # allowed, the learner's over everything, a gap of ~0.27 nats per token even in float32 on both sides.
        sampler_correction="tis",
        # Its partial credit makes groups whose attempts differ by a step on the way (0.1 against 0.3): divided by
        # such a group's small std, a lone 0.1 got an advantage of -2.6, as loud as a failure beside successes.
        # Unscaled, three runs of three met the task's target, against two of three scaled (docs/BENCHMARKS.md).
        scale_rewards=False,
        bf16="both",
    ),
    "agents-sdk": Task(
        "agents-sdk",
        agents_sdk.scenarios,
        _agents_sdk_attempt,
        _lookup_episode,  # the agent prints what the tool task's agent prints
        _agents_sdk_trajectory,
        score_calls=_agents_sdk_calls,
        max_tokens=48,
        minutes=10.0,
        serve_args=(f"--vllm-arg=--chat-template={lookup.TEMPLATE}",),
        sampler_correction="tis",  # the first call is constrained, as the tool task's
        bf16="both",
    ),
}


def precision(task: Task, sampler: str, trainer: str, cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, str]:
    """(vLLM's dtype, the trainer's) for the demo: each as chosen unless "auto"; then bfloat16 where the task gains
    by it (``Task.bf16``) and the CPU has bf16 units (``tracetrain_vllm.cpu_has_bf16``), else float32.

    The trainer's "bfloat16" on a CPU is float32 weights under bf16 autocast (trainer/_lora.py).
    """
    bf16 = task.bf16 is not None and cpu_has_bf16(cpuinfo)
    if trainer == "auto":
        trainer = "bfloat16" if bf16 and task.bf16 == "both" else "float32"
    if sampler == "auto":
        sampler = "bfloat16" if bf16 else trainer
    return sampler, trainer
