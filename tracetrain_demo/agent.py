"""The demo's agent: an ordinary OpenAI-client program that knows nothing of tracetrain.

Like any OpenAI app it reads OPENAI_BASE_URL and OPENAI_API_KEY from the environment.
It passes a travel request to the model, asks which city needs a hotel as JSON, and
parses the reply (``tracetrain_demo.city_agent``; ``--task lookup``: the model looks the hotel up
with a function tool first, ``tracetrain_demo.lookup_agent``; ``--task agents-sdk``: the same with an OpenAI
Agents SDK agent, ``tracetrain_demo.agents_sdk_agent``). The only tracetrain-specific thing is
two headers naming the attempt's trajectory and its group (the attempts at one request), so that GRPO compares
them; an app that cannot set headers would use the path prefix /g/GROUP/t/TRAJECTORY/v1.

    OPENAI_BASE_URL=http://127.0.0.1:8100/v1 python -m tracetrain_demo.agent --split train --rounds 3

Each round asks --questions requests --attempts times each, all at once. Finished
attempts are printed as JSON lines, and, with --done-url, reported to the reward
service (the way an app would report that a task ended).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import random
import sys
import uuid
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai

from tracetrain_demo.city_agent import CITY_FORMAT, attempt
from tracetrain_demo.tasks import TASKS

__all__ = ["attempt", "main"]  # attempt: the city task's (tracetrain_demo.city_agent)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tracetrain_demo.agent", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=sorted(TASKS), default="city", help="which task (default city)")
    p.add_argument("--split", choices=["train", "held-out"], default="train", help="which questions (default train)")
    p.add_argument("--model", default="agent", help="the model name to ask for (default agent)")
    p.add_argument("--questions", type=int, default=8, help="questions per round (default 8; held-out: all)")
    p.add_argument("--attempts", type=int, default=8, help="attempts per question, one group (default 8)")
    p.add_argument("--rounds", type=int, default=1, help="rounds to run; 0 runs until killed (default 1)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    p.add_argument("--max-tokens", type=int, help="most tokens per reply (default: the task's, 24 for city)")
    p.add_argument("--tag", default="demo", help="prefix of trajectory and group ids (default demo)")
    p.add_argument("--structured", action="store_true",
                   help="ask for the JSON answer with response_format json_schema (the city task)")  # fmt: skip
    p.add_argument("--done-url", help="POST {trajectory_id} here when an attempt ends (the reward service)")
    p.add_argument("--seed", type=int, default=0, help="order of the training questions (default 0)")
    p.add_argument("--concurrency", type=int, default=64,
                   help="attempts in flight at once (default 64); fewer leave the server to other work "
                   "sooner")  # fmt: skip
    args = p.parse_args(argv)

    task = TASKS[args.task]
    train, held_out = task.scenarios()
    max_tokens = args.max_tokens or task.max_tokens
    order = random.Random(args.seed)
    pool = list(train)
    round_number = 0
    with httpx.Client(timeout=30.0) as reporter, asyncio.Runner() as loop:

        def report(episode: dict[str, object]) -> None:
            print(json.dumps(episode), flush=True)
            if args.done_url:
                reporter.post(args.done_url, json={"trajectory_id": episode["trajectory_id"]}).raise_for_status()

        sampling: dict[str, Any] = {"temperature": args.temperature, "max_tokens": max_tokens}
        if args.structured:
            sampling["response_format"] = CITY_FORMAT
        concurrency = max(1, args.concurrency)
        while args.rounds == 0 or round_number < args.rounds:
            round_number += 1
            if args.split == "held-out":
                questions = held_out
            else:
                if len(pool) < args.questions:
                    pool = list(train)
                order.shuffle(pool)
                questions, pool = pool[: args.questions], pool[args.questions :]
            jobs = []
            for scenario in questions:
                group = f"{args.tag}-{uuid.uuid4().hex[:8]}"
                jobs += [(scenario, f"{group}-{k}", group) for k in range(args.attempts)]
            if inspect.iscoroutinefunction(task.attempt):
                loop.run(_gather(task.attempt, args.model, jobs, report, concurrency, **sampling))
            else:
                _run_threads(task.attempt, args.model, jobs, report, concurrency, **sampling)
    return 0


_Jobs = list[tuple[Any, str, str]]  # (scenario, trajectory id, group id) of each attempt in a round


def _run_threads(attempt: Callable[..., dict[str, object]], model: str, jobs: _Jobs,
                 report: Callable[[dict[str, object]], None], concurrency: int, **sampling: Any) -> None:  # fmt: skip
    """A plain OpenAI-client attempt per thread, ``concurrency`` at once; reported in order."""
    # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    with (openai.OpenAI(max_retries=2, timeout=300.0) as client,
          ThreadPoolExecutor(max_workers=concurrency) as threads):  # fmt: skip
        futures = [threads.submit(attempt, client, model, *job, **sampling) for job in jobs]
        for future in futures:
            report(future.result())


async def _gather(attempt: Callable[..., Awaitable[dict[str, object]]], model: str, jobs: _Jobs,
                  report: Callable[[dict[str, object]], None], concurrency: int, **sampling: Any) -> None:  # fmt: skip
    """An async attempt (the Agents SDK's ``Runner.run``) per job, ``concurrency`` at once on one client; reported
    as each ends."""
    slots = asyncio.Semaphore(concurrency)

    async def one(client: openai.AsyncOpenAI, job: tuple[Any, str, str]) -> dict[str, object]:
        async with slots:
            return await attempt(client, model, *job, **sampling)

    async with openai.AsyncOpenAI(max_retries=2, timeout=300.0) as client:  # from the environment, as above
        for episode in asyncio.as_completed([one(client, job) for job in jobs]):
            await asyncio.to_thread(report, await episode)  # the reward service's POST off the loop


if __name__ == "__main__":
    sys.exit(main())
