"""The base model's tokenizer as a ``decode`` function: what lets a re-tokenized turn merge (``trainer._samples``).

Loaded once per worker from the model directory vLLM serves (``tokenizer.json``: a fast tokenizer, no
weights). Special tokens are kept and spaces left as they are, so two spellings of one turn compare
equal exactly when they are the same text.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path

from trainer._samples import Decode

log = logging.getLogger("trainer")


@functools.cache
def model_decode(model_dir: Path) -> Decode | None:
    """The decode function, or None (logged) when the directory has no tokenizer: turns then merge by ids only."""
    from transformers import AutoTokenizer  # imported here: the worker loads transformers with the model anyway

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:
        log.warning("no tokenizer in %s (%s): a turn re-rendered in other token ids will not merge", model_dir, e)
        return None

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False))

    return decode
