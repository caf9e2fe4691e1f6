"""The ``tracetrain`` command line: serve (the supervisor of vLLM, proxy and trainer), demo,
model pull, db, export and sft. It sits above ``proxy``, ``trainer`` and ``store``; none of
them imports it. ``VLLMLaunch`` and ``VLLMProcess`` (vLLM's launch recipe and the running child)
are also what the benchmarks start vLLM with.
"""

from tracetrain_cli._main import main
from tracetrain_cli._vllm_process import VLLMLaunch, VLLMProcess, VLLMStartError

__all__ = ["VLLMLaunch", "VLLMProcess", "VLLMStartError", "main"]
