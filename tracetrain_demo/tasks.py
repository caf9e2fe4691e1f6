"""The demo's built-in tasks, by name: what the agent does, how an attempt is scored, what serve needs.

``city`` (the default): one call, name the city that needs a hotel as JSON (``tracetrain_demo.task``).
``lookup``: look the hotel up with a function tool, read the result, answer as JSON; two calls or
more per attempt (``tracetrain_demo.lookup``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tracetrain import Trajectory
from tracetrain_demo import lookup, task
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
    attempt: Callable[..., dict[str, object]]  # the agent's attempt: (client, model, scenario, ids, ...) -> episode
    score_episode: Callable[[dict[str, Any]], Scored]  # from what the agent printed
    score_trajectory: Callable[[Trajectory], Scored]  # from what the proxy captured (the reward service)
    max_tokens: int  # per call
    serve_args: tuple[str, ...] = ()  # added to `tracetrain serve`'s command line
    sampler_correction: str = "auto"  # the trainer's default for this task (TrainConfig.sampler_correction)
    # On a CPU with bf16 units vLLM samples in bf16 (the trainer stays in float32; TIS corrects the gap): the city
    # task made 35 steps and +90 points where float32 sampling made 17 and +68 (docs/BENCHMARKS.md, issue 22).
    bf16_sampling: bool = False


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
    scenario = lookup.by_prompt().get(messages[0]["content"])
    if scenario is None:
        raise ValueError(f"trajectory {trajectory.id} does not start with one of the task's requests")
    answer = ((last.response or {}).get("choices") or [{}])[0].get("message") or {}
    cities = lookup.tool_cities([*messages, answer])  # the last call's own tool calls count too
    return lookup.score(scenario, cities, "" if answer.get("tool_calls") else _reply(last.response))


def _reply(response: dict[str, Any] | None) -> str:
    return str(((response or {}).get("choices") or [{}])[0].get("message", {}).get("content") or "")


def _city_attempt(*args: Any, **kwargs: Any) -> dict[str, object]:
    from tracetrain_demo.city_agent import attempt

    return attempt(*args, **kwargs)


def _lookup_attempt(*args: Any, **kwargs: Any) -> dict[str, object]:
    from tracetrain_demo.lookup_agent import attempt

    return attempt(*args, **kwargs)


TASKS: dict[str, Task] = {
    "city": Task(
        "city", task.scenarios, _city_attempt, _city_episode, _city_trajectory, max_tokens=24, bf16_sampling=True
    ),
    "lookup": Task(
        "lookup",
        lookup.scenarios,
        _lookup_attempt,
        _lookup_episode,
        _lookup_trajectory,
        max_tokens=48,
        serve_args=(f"--vllm-arg=--chat-template={lookup.TEMPLATE}",),
        # The first call is constrained (tool_choice "required"): vLLM's logprobs are over what the grammar
        # allowed, the learner's over everything, a gap of ~0.27 nats per token even in float32 on both sides.
        sampler_correction="tis",
    ),
}


def sampler_dtype(task: Task, chosen: str, cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """vLLM's dtype for the demo: ``chosen`` unless "auto"; then bf16 where the task gains by it and the CPU has
    bf16 units (``tracetrain_vllm.cpu_has_bf16``), else None (serve's default: the trainer's float32)."""
    if chosen != "auto":
        return chosen
    return "bfloat16" if task.bf16_sampling and cpu_has_bf16(cpuinfo) else None
