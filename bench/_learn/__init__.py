"""The parts of ``bench/learning.py``: ``trl_loop`` (TRL's side, its own process) and ``evaluate`` (the judge)."""
