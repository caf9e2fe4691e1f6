"""The ``tracetrain`` command line: serve (the supervisor of vLLM, proxy and trainer), demo,
model pull, db, export and sft. It sits above ``proxy``, ``trainer`` and ``store``; none of
them imports it.
"""

from tracetrain_cli._main import main

__all__ = ["main"]
