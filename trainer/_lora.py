"""The model a learner trains: a Hugging Face causal LM in the config's precision, with a peft LoRA.

What the learner (``trainer._learner``) and the SFT warm start (``trainer._sft``) share: the LoRA
on those of the config's target modules the model has, loaded fresh or resumed from an adapter
directory, and peft's deprecation warning kept quiet. Models whose logits are not
``lm_head(hidden)`` are refused: the chunked scoring (``trainer._logprobs``) would be wrong for them.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import load_peft_weights, set_peft_model_state_dict
from transformers import AutoModelForCausalLM, PreTrainedModel

from trainer._config import TrainConfig, TrainDType

# Config attributes of models whose logits are not plain lm_head(hidden): the chunked scoring would be wrong.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def precision(dtype: TrainDType, device: torch.device) -> tuple[torch.dtype, bool]:
    """(weights dtype, bf16 autocast?) for the config's dtype on this device."""
    bf16_cuda = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if dtype == "float32" or (dtype == "auto" and not bf16_cuda):
        return torch.float32, False
    if device.type == "cuda":
        return torch.bfloat16, False
    return torch.float32, True  # bfloat16 off CUDA: fp32 weights, bf16 autocast


def load_lora_model(
    base_model: Path, cfg: TrainConfig, *, adapter: Path | None, dtype: torch.dtype, attention: str
) -> PeftModel:
    """The base in ``dtype`` with ``cfg``'s new LoRA, or with ``adapter``'s (its own rank, alpha and targets).

    The new LoRA's initial weights follow the global RNG: the caller seeds it.
    """
    base = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=dtype, attn_implementation=attention)
    _refuse_transformed_logits(base)
    model: PeftModel
    with quiet_peft_deprecation():
        if adapter is None:
            model = get_peft_model(base, lora_config(base, cfg))
        else:
            model = PeftModel.from_pretrained(base, str(adapter), is_trainable=True)
    # vLLM and peft read this to name the base; the path this learner loaded is the truthful one.
    model.peft_config[model.active_adapter].base_model_name_or_path = str(base_model)
    return model


def lora_config(model: PreTrainedModel, cfg: TrainConfig) -> LoraConfig:
    """cfg's LoRA on those of its target modules this model has; ValueError if it has none."""
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    targets = [t for t in cfg.target_modules if t in names]
    if not targets:
        raise ValueError(f"none of target_modules {list(cfg.target_modules)} is a linear layer of this model")
    return LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )


def load_lora_weights(model: PeftModel, adapter: Path) -> bool:
    """Put ``adapter``'s LoRA weights into ``model``'s in place (another policy's adapter of the same shape: the
    trainer's switch between policies, without loading the base again). False, and nothing changed, when the
    adapter has another rank, alpha or set of target modules than the model's LoRA."""
    theirs = json.loads((adapter / "adapter_config.json").read_text())
    mine = model.peft_config[model.active_adapter]
    assert isinstance(mine, LoraConfig)
    same = (theirs.get("r") == mine.r and theirs.get("lora_alpha") == mine.lora_alpha
            and set(theirs.get("target_modules") or ()) == set(mine.target_modules or ()))  # fmt: skip
    if not same:
        return False
    weights = load_peft_weights(str(adapter), device="cpu")
    loaded: Any = set_peft_model_state_dict(model, weights, adapter_name=model.active_adapter)
    missing = [key for key in loaded.missing_keys if "lora_" in key]
    if missing or loaded.unexpected_keys:
        raise ValueError(f"{adapter} does not fit the model's LoRA ({len(missing)} weights missing, "
                         f"{len(loaded.unexpected_keys)} unexpected)")  # fmt: skip
    return True


@contextlib.contextmanager
def quiet_peft_deprecation() -> Iterator[None]:
    # peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing` whenever it wraps a
    # model; the FutureWarning is peft's to fix and nothing a user of the learner can act on.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def _refuse_transformed_logits(model: PreTrainedModel) -> None:
    for attr in _LOGIT_TRANSFORMS:
        value = getattr(model.config, attr, None)
        if value is not None and value != 1:
            raise NotImplementedError(f"{attr}={value}: logits other than lm_head(hidden) are not supported")
