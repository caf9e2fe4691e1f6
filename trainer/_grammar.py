"""The grammar a constrained call was sampled under, rebuilt for the learner: each position's allowed tokens.

vLLM samples a constrained call (``tool_choice`` "required" or a named tool, ``response_format`` json_schema,
the Responses API's ``text.format``, Anthropic's forced ``tool_choice`` or ``output_config.format``) from the
model's distribution with every token the grammar forbids at -inf, and the logprobs it returns are that masked
distribution's. The proxy records with each such call the structured-output specification vLLM sampled under
(``tracetrain_core.structured_outputs``: vLLM's ``StructuredOutputsParams`` as JSON). Here the same backend
vLLM uses (xgrammar) compiles it with the same tokenizer (``TokenizerInfo.from_huggingface`` at the logits'
width, stop tokens as vLLM's engine adds them: the tokenizer's EOS and the generation config's), a
``GrammarMatcher`` walks the sampled tokens, and each position's bitmask is kept: the learner sets the
forbidden logits to -inf before its log-softmax, so learner and sampler score the same masked policy.

A grammar that cannot be rebuilt (a kind this module does not compile, a backend or version vLLM's record does
not match, a sampled token the matcher rejects: the completion was not sampled under this grammar) gives
``None``: that call trains on the full distribution as before, and the step counts it (``grammar_fallbacks``).
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainer._samples import Sample

# Per sample, its constrained spans: (start, end, (end - start, W) int32 bitmask), from ``GrammarMasks.spans``.
SpanMasks = Sequence[tuple[int, int, Tensor]]

log = logging.getLogger("tracetrain.trainer")

# Compiled grammars kept per learner: an agent constrains its calls with a handful of schemas.
_CACHE_SIZE = 64


def unpack_bitmask(bitmask: Tensor, vocab: int) -> Tensor:
    """xgrammar's packed (N, ceil(V / 32)) int32 bitmask -> (N, V) bool, True where the token is allowed."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # (32,)
    unpacked = (bitmask[:, :, None] >> bits) & 1  # (N, W, 32)
    return unpacked.reshape(bitmask.shape[0], -1)[:, :vocab].bool()  # (N, V)


class GrammarMasks:
    """Compiles recorded structured-output specifications and walks sampled tokens through them.

    ``model_dir``: the base model's directory (its tokenizer and generation config, as vLLM loads them);
    ``vocab``: the model's logits width (vLLM's ``vocab_size`` for the grammar backend).
    """

    def __init__(self, model_dir: Path, vocab: int) -> None:
        self._model_dir = model_dir
        self.vocab = vocab
        self._compiler: Any = None
        self._stop: list[int] = []
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self.unavailable: str | None = None  # why no grammar can be rebuilt at all (xgrammar or a tokenizer missing)

    def _ready(self) -> bool:
        if self._compiler is not None or self.unavailable is not None:
            return self._compiler is not None
        try:
            import xgrammar as xgr
            from transformers import AutoTokenizer, GenerationConfig

            tokenizer = AutoTokenizer.from_pretrained(str(self._model_dir))
        except (ImportError, OSError, ValueError) as e:
            self.unavailable = f"{type(e).__name__}: {e}"
            log.warning("constrained calls train unmasked: %s", self.unavailable)
            return False
        stop = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        try:  # vLLM's engine adds the generation config's EOS ids to every request's stop tokens
            eos = GenerationConfig.from_pretrained(str(self._model_dir)).eos_token_id
        except OSError:
            eos = None
        stop |= {eos} if isinstance(eos, int) else set(eos or ())
        self._stop = sorted(stop)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return True

    def _compile(self, spec: str) -> Any:
        """The compiled grammar of ``spec`` as vLLM's xgrammar backend compiles it (its default options)."""
        if spec in self._compiled:
            self._compiled.move_to_end(spec)
            return self._compiled[spec]
        params = json.loads(spec)
        if not isinstance(params, dict):
            raise ValueError("a structured-output specification is an object")
        kinds = [k for k in ("json", "json_object", "regex", "grammar", "structural_tag")
                 if params.get(k) not in (None, False)]  # fmt: skip
        if len(kinds) != 1:
            raise ValueError(f"expected one kind of structured output, got {kinds or 'none'}")
        kind, value = kinds[0], params[kinds[0]]
        compiler = self._compiler
        if kind == "json":
            compiled = compiler.compile_json_schema(value if isinstance(value, str) else json.dumps(value),
                                                    any_whitespace=True)  # fmt: skip
        elif kind == "json_object":
            compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=True)
        elif kind == "regex":
            compiled = compiler.compile_regex(value)
        elif kind == "grammar":
            # vLLM reads a grammar as Lark unless it looks like GBNF (``::=``)
            compiled = compiler.compile_grammar(value) if "::=" in value else compiler.compile_lark(value)
        else:
            compiled = compiler.compile_structural_tag(value if isinstance(value, str) else json.dumps(value))
        self._compiled[spec] = compiled
        if len(self._compiled) > _CACHE_SIZE:
            self._compiled.popitem(last=False)
        return compiled

    def bitmasks(self, spec: str, tokens: list[int]) -> Tensor | None:
        """(len(tokens), ceil(V / 32)) int32: the tokens each position allowed, walking ``tokens`` through
        ``spec``'s grammar; None (logged) when the grammar cannot be rebuilt or rejects a sampled token."""
        if not self._ready():
            return None
        import xgrammar as xgr

        try:
            compiled = self._compile(spec)
        except (ValueError, RuntimeError, TypeError) as e:  # xgrammar raises RuntimeError on what it cannot compile
            log.warning("a constrained call trains unmasked: its grammar does not compile here (%s)", e)
            return None
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=self._stop)
        out = xgr.allocate_token_bitmask(len(tokens), self.vocab)  # (N, W) int32
        for i, token in enumerate(tokens):
            matcher.fill_next_token_bitmask(out, i)
            if not matcher.accept_token(token):
                log.warning("a constrained call trains unmasked: its grammar rejects sampled token %d at %d", token, i)
                return None
        return out

    def spans(self, samples: Sequence[Sample]) -> tuple[list[SpanMasks], int, float]:
        """Each sample's constrained spans with their bitmasks; how many spans could not be rebuilt (those train
        unmasked); the milliseconds the walk took."""
        start = time.perf_counter()
        masks: list[SpanMasks] = []
        fallbacks = 0
        for sample in samples:
            spans: list[tuple[int, int, Tensor]] = []
            for begin, end, spec in sample.grammars:
                bitmask = self.bitmasks(spec, sample.token_ids[begin:end])
                if bitmask is None:
                    fallbacks += 1
                else:
                    spans.append((begin, end, bitmask))
            masks.append(spans)
        return masks, fallbacks, (time.perf_counter() - start) * 1000
