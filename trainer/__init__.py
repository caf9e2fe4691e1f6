"""tracetrain's trainer: GRPO on a LoRA from captured token ids.

May use ``proxy.schema`` (the store's tables); the proxy never imports this package.
"""

from trainer._advantages import GroupAdvantages, group_advantages
from trainer._config import LossVariant, TrainConfig, TrainDType
from trainer._losses import policy_loss
from trainer._samples import CapturedCall, Sample, SampleStats, build_samples, pack

__all__ = [
    "CapturedCall",
    "GroupAdvantages",
    "LossVariant",
    "Sample",
    "SampleStats",
    "TrainConfig",
    "TrainDType",
    "build_samples",
    "group_advantages",
    "pack",
    "policy_loss",
]
