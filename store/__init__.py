"""tracetrain's store: the tables, migrations, the group-commit writer, every query, the life cycle.

The store is the only state the proxy, the trainer and the command line share. It imports
neither FastAPI/Starlette nor torch, so the trainer worker reads its jobs without loading
the proxy, and the proxy never loads torch.
"""

from store._store import CallWrite, RewardIn, Store, connect

__all__ = ["CallWrite", "RewardIn", "Store", "connect"]
