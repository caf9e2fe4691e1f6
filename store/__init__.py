"""tracetrain's store: the tables, migrations, the group-commit writer, every query, the life cycle.

The store is the only state the proxy, the trainer and the command line share. It imports
neither FastAPI/Starlette nor torch, so the trainer worker reads its jobs without loading
the proxy, and the proxy never loads torch. ``Store.open(url)`` is the way in.
"""

from store._adapter_files import FILE_NAME_PATTERN, AdapterFile, AdapterFiles, FileEntry
from store._adapters import ADAPTER_FIELDS, POLICY_NAME_PATTERN, Adapters
from store._batch import CallWrite
from store._compact import COMPACT_COLUMNS
from store._engine import connect
from store._errors import (
    DRIVER_ERRORS,
    KeyTaken,
    RecordRefused,
    SchemaTooNew,
    StoreError,
    StoreFull,
    StoreUnavailable,
    TransitionRefused,
    UnknownCalls,
    UnknownTrajectories,
    is_disk_full,
    store_error_of,
)
from store._evaluations import EVALUATION_FIELDS, Evaluations
from store._export import ExportFilter, ExportPage, ExportReads, RewardSummary
from store._full_disk import FULL_DISK
from store._guard import TRAINING_FIELDS, Guards
from store._jobs import JOB_FIELDS, Jobs, RewardedTrajectory, StoredCall
from store._judgements import JUDGEMENT_STATES, DueRule, GroupCalls, GroupChanged, Judgements
from store._lifecycle import (
    MOVES,
    AdapterState,
    GpuHandover,
    GroupState,
    JobState,
    PolicyState,
    TrainingState,
    TrialState,
    allowed,
)
from store._policies import Policies, PolicyAdded
from store._reads import GROUP_VIEW_STATES, GroupRecord, Reads, TrajectoryFilter, TrajectoryRecord
from store._redact import redact, without_userinfo
from store._retention import PruneReport, PruneRule
from store._rewards import REWARD_SOURCES, RewardIn, RewardRecord
from store._sessions import Sessions
from store._store import Store
from store._tables import Call
from store._timeouts import RewardTimeouts
from store._trials import TRIAL_FIELDS, ArmTotals, GroupArms, Trials, TrialUnit

__all__ = [
    "ADAPTER_FIELDS",
    "COMPACT_COLUMNS",
    "DRIVER_ERRORS",
    "EVALUATION_FIELDS",
    "FILE_NAME_PATTERN",
    "FULL_DISK",
    "GROUP_VIEW_STATES",
    "JOB_FIELDS",
    "JUDGEMENT_STATES",
    "MOVES",
    "POLICY_NAME_PATTERN",
    "REWARD_SOURCES",
    "TRAINING_FIELDS",
    "TRIAL_FIELDS",
    "AdapterFile",
    "AdapterFiles",
    "AdapterState",
    "Adapters",
    "ArmTotals",
    "Call",
    "CallWrite",
    "DueRule",
    "Evaluations",
    "ExportFilter",
    "ExportPage",
    "ExportReads",
    "FileEntry",
    "GpuHandover",
    "GroupArms",
    "GroupCalls",
    "GroupChanged",
    "GroupRecord",
    "GroupState",
    "Guards",
    "JobState",
    "Jobs",
    "Judgements",
    "KeyTaken",
    "Policies",
    "PolicyAdded",
    "PolicyState",
    "PruneReport",
    "PruneRule",
    "Reads",
    "RecordRefused",
    "RewardIn",
    "RewardRecord",
    "RewardSummary",
    "RewardTimeouts",
    "RewardedTrajectory",
    "SchemaTooNew",
    "Sessions",
    "Store",
    "StoreError",
    "StoreFull",
    "StoreUnavailable",
    "StoredCall",
    "TrainingState",
    "TrajectoryFilter",
    "TrajectoryRecord",
    "TransitionRefused",
    "TrialState",
    "TrialUnit",
    "Trials",
    "UnknownCalls",
    "UnknownTrajectories",
    "allowed",
    "connect",
    "is_disk_full",
    "redact",
    "store_error_of",
    "without_userinfo",
]
