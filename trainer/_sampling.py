"""The sampling parameters a captured call was sampled with, resolved as vLLM resolves them.

A call's stored request holds what the client sent. A parameter it left out takes the
server's default: with vLLM's default ``--generation-config auto`` that is the base
model's ``generation_config.json`` (Qwen's sets temperature 0.7, top-p 0.8, top-k 20),
else OpenAI's neutral values (temperature 1.0, no truncation). The trainer reads the same
file from the base model directory it trains; ``TrainConfig.default_temperature``
overrides the temperature for a vLLM started with other defaults.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What vLLM applies to a request that names no temperature, top-p, top-k or min-p."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0

    @classmethod
    def of_model(cls, model_dir: Path, *, temperature: float | None = None) -> SamplingDefaults:
        """The defaults vLLM takes from ``model_dir/generation_config.json``; ``temperature`` overrides its own.

        >>> SamplingDefaults.of_model(Path("/nonexistent"))
        SamplingDefaults(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0)
        """
        found = cls()
        try:
            config: Any = json.loads((model_dir / "generation_config.json").read_text())
        except (OSError, ValueError):
            config = {}
        if isinstance(config, dict):
            found = cls(
                temperature=_number(config.get("temperature"), found.temperature),
                top_p=_number(config.get("top_p"), found.top_p),
                top_k=int(_number(config.get("top_k"), found.top_k)),
                min_p=_number(config.get("min_p"), found.min_p),
            )
        return found if temperature is None else replace(found, temperature=temperature)

    def temperature_of(self, requested: float | None) -> float:
        return self.temperature if requested is None else requested

    def truncates(self, top_p: float | None, top_k: float | None, min_p: float | None) -> bool:
        """Whether a call with these requested values (None: the default) was sampled from a truncated distribution."""
        p = self.top_p if top_p is None else top_p
        k = self.top_k if top_k is None else top_k
        m = self.min_p if min_p is None else min_p
        return p < 1.0 or k > 0 or m > 0.0


def _number(value: Any, default: float) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default
