"""``tracetrain serve``'s flags for rewards and what they decide: where rewards come from (and the judge), the
regression guard, canary trials. Each is the server's value, which a policy's own settings override
(``--policy-config``).
"""

from __future__ import annotations

import argparse

from tracetrain_cli._models import setting_default


def add_reward_flags(p: argparse.ArgumentParser) -> None:
    """Where rewards come from: posted, an LLM judge, both, or people."""
    p.add_argument(
        "--reward-source",
        choices=["external", "judge", "both", "human"],
        help="where rewards come from: POST /v1/rewards (external), an LLM judge that scores each group's "
        "trajectories against each other (judge; no reward function needed), both (posted rewards train, the "
        "judge's scores are recorded beside them), or people (human: the dashboard's review queue). Whatever the "
        "source, a person's score on the dashboard overrides a posted or judged reward"
        + setting_default("reward_source"),
    )
    p.add_argument(
        "--judge-model",
        metavar="MODEL",
        help="the judge, as a litellm model name: openai/gpt-4o-mini (reads OPENAI_API_KEY), anthropic/..., "
        "hosted_vllm/NAME (default: the base model vLLM serves, no key needed)",
    )
    p.add_argument(
        "--judge-api-base",
        metavar="URL",
        help="where --judge-model is served, when not at its provider's usual URL (an OpenAI-compatible gateway); "
        "env TRACETRAIN_JUDGE_API_BASE",
    )
    p.add_argument(
        "--judge",
        action="append",
        default=[],
        metavar="MODEL[=BASE_URL]",
        help="a further judge a policy may choose as its judge_model (--policy-config, the admin API), at its "
        "provider's usual URL with its usual key variable, or at BASE_URL; repeatable (env TRACETRAIN_JUDGES, "
        "comma-separated). A policy names one of these or --judge-model, never a URL (docs/OPERATIONS.md)",
    )
    p.add_argument(
        "--judge-rubric",
        metavar="TEXT_OR_@FILE",
        help="what makes one trajectory better than another, as text or @path/to/rubric.md "
        "(default: a generic rubric for agent tasks)",
    )


def add_guard_flags(p: argparse.ArgumentParser) -> None:
    """The regression guard: each new version's rewards watched, a worse one rolled back."""
    p.add_argument(
        "--no-regression-guard",
        action="store_true",
        help="do not watch each new version's rewards; by default a version that serves worse rewards than the "
        "one before it is rolled back and training pauses until an admin resumes it (docs/TRAINING.md)",
    )
    p.add_argument(
        "--regression-margin",
        type=float,
        metavar="REWARD",
        help="how much lower a new version's mean group reward may be and still count as not worse"
        + setting_default("regression_margin"),
    )
    p.add_argument(
        "--regression-alpha",
        type=float,
        metavar="P",
        help="the chance the guard rolls back a version that is not worse, over all its looks"
        + setting_default("regression_alpha"),
    )
    p.add_argument(
        "--regression-groups",
        type=int,
        metavar="N",
        help="the guard decides within this many rewarded groups of a new version"
        + setting_default("regression_groups"),
    )


def add_canary_flags(p: argparse.ArgumentParser) -> None:
    """Canary trials: a new version serves a share of new trajectories until its rewards decide."""
    p.add_argument(
        "--canary",
        type=float,
        metavar="FRACTION",
        help="try each new version on this share of new trajectories (e.g. 0.1) before it serves everyone: the "
        "version before it serves the rest, and a paired test of their rewards within groups promotes it or rolls "
        "it back (docs/TRAINING.md, 'Trying a version'). Each policy's trial is its own; a policy's own canary setting "
        "(--policy-config; 0: none) overrides this. Default: a new version serves everything at once",
    )
    p.add_argument(
        "--canary-groups",
        type=int,
        metavar="N",
        help="a trial decides within this many complete groups holding both versions"
        + setting_default("canary_groups"),
    )
    p.add_argument(
        "--canary-minutes",
        type=float,
        metavar="MINUTES",
        help="a trial decides within this many minutes, on the evidence it has" + setting_default("canary_minutes"),
    )
    p.add_argument(
        "--canary-margin",
        type=float,
        metavar="REWARD",
        help="how much lower the new version's rewards may be than the current one's and still count as not worse"
        + setting_default("canary_margin"),
    )
    p.add_argument(
        "--canary-alpha",
        type=float,
        metavar="P",
        help="the chance a trial rolls back a version that is not worse (and, alike, promotes early one that is), "
        "over all its looks" + setting_default("canary_alpha"),
    )
