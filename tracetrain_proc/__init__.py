"""Commands run as child process groups, each with its log: what ``tracetrain serve`` supervises
(vLLM, the trainer worker) and what ``tracetrain demo`` starts (serve itself, the reward service,
the agent).

Standard library only, below every package that starts a process: the command line and the demo
both use it, and neither imports the other's internals for it.
"""

from tracetrain_proc._child import ChildExited, ChildProcess

__all__ = ["ChildExited", "ChildProcess"]
