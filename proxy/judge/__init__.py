"""The group judge (RULER-style): LLM scores as rewards, or beside them; ``--reward-timeout``."""

from proxy.judge._client import Judge, JudgeFailed
from proxy.judge._prompt import DEFAULT_RUBRIC, JudgePrompt, Score, build_prompt
from proxy.judge._service import JudgeService

__all__ = ["DEFAULT_RUBRIC", "Judge", "JudgeFailed", "JudgePrompt", "JudgeService", "Score", "build_prompt"]
