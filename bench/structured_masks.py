"""The training step with and without structured-output masks: the same batch, scored once under its grammar.

Builds ``--samples`` samples of the city task's constrained call (the chat prompt, then a JSON answer
``{"city": ...}`` and ``<|im_end|>``) on the model in ``--model-dir`` (the default SmolLM2-135M-Instruct that
``tracetrain model pull`` writes). The same samples train twice per round, alternating: as unconstrained
calls, and as calls sampled under the answer's JSON schema, so that the learner walks each through
xgrammar's matcher (``mask_ms``) and masks its logits before the log-softmax. Prints the median step
time of each, their ratio, and the masks' share.

    .venv/bin/python bench/structured_masks.py --model-dir ~/.tracetrain/models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
from pathlib import Path

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}  # fmt: skip
CITIES = ["Paris", "Oslo", "Lisbon", "Buenos Aires", "Kyoto", "Nairobi", "Reykjavik", "Santiago de Chile"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=Path(".tracetrain/models/smollm2-135m-instruct"))
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3, help="timed steps of each kind (after one warm-up of each)")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from trainer import TrainConfig
    from trainer._learner import Learner
    from trainer._samples import CapturedCall, build_samples
    from trainer._step import TrainItem

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    learner = Learner(args.model_dir, TrainConfig(dtype="float32"))
    spec = json.dumps({"json": CITY})
    rng = random.Random(0)
    constrained = []
    for k in range(args.samples):
        question = [{"role": "user", "content": f"Traveller {k} needs a hotel. Which city? Answer as JSON."}]
        prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=True, return_dict=False)
        answer = json.dumps({"city": rng.choice(CITIES)})
        completion = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
        call = CapturedCall(list(prompt), completion, [0.0] * len(completion), structured_outputs=spec)
        constrained += build_samples([call])[0]
    free = [dataclasses.replace(s, grammars=[]) for s in constrained]
    # On-policy old log-probs, each under its own kind's distribution.
    batches = {}
    for name, samples in (("unconstrained", free), ("constrained", constrained)):
        old = learner.logprobs(samples)
        batches[name] = [TrainItem(dataclasses.replace(s, old_logprobs=o.tolist()), 1.0 if i % 2 else -1.0)
                         for i, (s, o) in enumerate(zip(samples, old, strict=True))]  # fmt: skip
    seconds: dict[str, list[float]] = {name: [] for name in batches}
    mask_ms: list[float] = []
    for round_number in range(args.rounds + 1):
        for name, batch in batches.items():
            result = learner.step(batch)
            if round_number > 0:  # the first round warms up (allocations, the grammar's compilation)
                seconds[name].append(result.seconds)
                if name == "constrained":
                    mask_ms.append(result.mask_ms)
    free_s, masked_s = statistics.median(seconds["unconstrained"]), statistics.median(seconds["constrained"])
    tokens = sum(s.constrained_tokens for s in constrained)
    print(f"{args.samples} samples, {sum(len(s.token_ids) for s in constrained)} tokens, {tokens} sampled under "
          f"the grammar; median of {args.rounds} steps each")  # fmt: skip
    print(f"{'':16}{'step s':>10}{'ratio':>8}{'masks ms':>10}")
    print(f"{'unconstrained':16}{free_s:10.3f}{1.0:8.2f}{0.0:10.1f}")
    print(f"{'constrained':16}{masked_s:10.3f}{masked_s / free_s:8.2f}{statistics.median(mask_ms):10.1f}")


if __name__ == "__main__":
    main()
