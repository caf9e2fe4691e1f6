"""tracetrain's trainer: GRPO on a LoRA from captured token ids.

May use ``store._tables`` (the store's tables); the proxy never imports this package.
"""

from trainer._adapters import newest_adapter
from trainer._advantages import GroupAdvantages, group_advantages
from trainer._config import LossVariant, TrainConfig, TrainDType
from trainer._learner import Learner
from trainer._losses import policy_loss
from trainer._samples import CapturedCall, Sample, SampleStats, build_samples, pack
from trainer._step import StepResult, TrainItem

__all__ = [
    "CapturedCall",
    "GroupAdvantages",
    "Learner",
    "LossVariant",
    "Sample",
    "SampleStats",
    "StepResult",
    "TrainConfig",
    "TrainDType",
    "TrainItem",
    "build_samples",
    "group_advantages",
    "newest_adapter",
    "pack",
    "policy_loss",
]
