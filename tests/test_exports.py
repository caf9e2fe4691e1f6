"""The public faces of the server packages are pinned."""

from __future__ import annotations

import proxy


def test_proxy_public_names() -> None:
    assert sorted(proxy.__all__) == ["Settings", "create_app"]


def test_the_serving_path_never_imports_torch() -> None:
    import subprocess
    import sys

    code = "import sys, proxy, tracetrain_cli, store; print('torch' in sys.modules, 'trainer' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_trainer_public_names() -> None:
    import trainer

    assert sorted(trainer.__all__) == [
        "CapturedCall", "GroupAdvantages", "Learner", "LossVariant", "Sample", "SampleStats", "StepResult",
        "TrainConfig", "TrainDType", "TrainItem", "build_samples", "group_advantages", "newest_adapter", "pack",
        "policy_loss",
    ]  # fmt: skip
