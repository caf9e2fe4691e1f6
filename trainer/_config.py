"""The trainer's configuration, declared without torch in ``tracetrain_core`` (the command line reads its
defaults there): here under the name the trainer's modules import."""

from tracetrain_core import LossVariant, SamplerCorrection, SamplerDType, TrainConfig, TrainDType

__all__ = ["LossVariant", "SamplerCorrection", "SamplerDType", "TrainConfig", "TrainDType"]
