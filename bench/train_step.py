"""Our GRPO step against TRL's GRPOTrainer loss + backward: same batch, model and LoRA, one run.

The parent process never imports torch. It starts one subprocess that builds the model
(SmolLM2-135M shapes, random weights, unless ``--model-dir``), the batch (random token ids,
advantages +-1, old log-probs = on-policy log-probs) and the LoRA's initial weights, then one
subprocess per contender, so that each process's peak RSS is its own:

- ``ours``: ``trainer.Learner.step`` (pack, chunked log-probs, loss, backward, clip, AdamW),
  with the micro-batch budget of ``--micro-batch-tokens`` and, for transparency, the default 4096;
- ``trl``: TRL's ``GRPOTrainer.compute_loss`` on the equivalent padded inputs dict, then
  ``accelerator.backward``, the same global-norm clip and the same AdamW; without gradient
  checkpointing (the same work as ours) and with it (GRPOConfig's default, which the Trainer
  switches on inside ``train()``, so it is switched on here by hand).

Both sides time the whole optimizer step; the TRL rows also show their loss + backward part.
Memory: ``getrusage`` peak RSS of the process (absolute), and the step's extra memory: the
peak during the timed steps (the kernel's high-water mark is reset after the warm-up step)
minus the RSS right after loading (every weight paged in). The first step also checks that the two agree: both see
identical weights (TRL's LoRA gets ours' initial A and B), so the losses, the pre-clip gradient
norms and the gradients' directions should match. bench/README.md says how to read the output.

    .venv/bin/python bench/train_step.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

# bench/ is not a package: Python puts this script's folder first on sys.path, so its helpers
# (bench/_train/, bench/_host.py) import as top-level names.
from _train.agreement import first_step_agreement
from _train.batch import prepare
from _train.children import run_child
from _train.ours import run_ours
from _train.report import report
from _train.trl_grpo import run_trl


def _versions() -> dict[str, str]:
    from importlib import metadata

    return {p: metadata.version(p) for p in ("torch", "transformers", "peft", "trl", "accelerate")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Run it on a quiet machine: the 'other CPU' column (cores used by other "
                                            "processes meanwhile) should be near 0.")  # fmt: skip
    parser.add_argument("--samples", type=int, default=8, help="samples in the batch (>= 2: TRL's num_generations)")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per sample")
    parser.add_argument("--completion", type=int, default=128, help="completion (sampled) tokens per sample")
    parser.add_argument(
        "--group-size",
        type=int,
        default=1,
        help="samples per GRPO group; a group's samples share their prompt tokens (default 1: none do)",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per contender, after 1 warm-up")
    parser.add_argument("--micro-batch-tokens", type=int, default=512,
                        help="our packing budget; on a CPU sdpa pays T x T per packed row, so keep it near the "
                             "sample length (a run with the default 4096 is added for transparency)")  # fmt: skip
    parser.add_argument("--model-dir", help="a Hugging Face causal LM directory (default: random SmolLM2-135M shapes)")
    parser.add_argument("--no-extras", action="store_true",
                        help="skip ours at 4096 and TRL with gradient checkpointing")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the token ids and advantages")
    parser.add_argument("--out", type=Path, help="write every number as JSON here")
    parser.add_argument("--keep-work", action="store_true", help="keep the temporary model, batch and logs")
    parser.add_argument("--role", choices=["prepare", "ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--role-name", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--trl-gradient-checkpointing", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.samples < 2:
        parser.error("--samples must be at least 2")

    if opts.role:
        if opts.role == "prepare":
            prepare(opts.work, opts)
            return 0
        result = (run_ours if opts.role == "ours" else run_trl)(opts.work, opts)
        (opts.work / f"{opts.role_name}.json").write_text(json.dumps(result, indent=2))
        return 0

    work = Path(tempfile.mkdtemp(prefix="tracetrain-train-bench-"))
    mb = str(opts.micro_batch_tokens)
    run_child(work, opts, "prepare", "prepare", ["--micro-batch-tokens", mb])
    plan = [("ours", "ours", ["--micro-batch-tokens", mb]), ("trl", "trl", [])]
    if not opts.no_extras:
        if opts.micro_batch_tokens != 4096:
            plan.append(("ours", "ours-default", ["--micro-batch-tokens", "4096"]))
        plan.append(("trl", "trl-gc", ["--trl-gradient-checkpointing"]))
    results = [r for role, name, extra in plan if (r := run_child(work, opts, role, name, extra)) is not None]
    numerics = first_step_agreement(work, results)
    summary = report(opts, results, numerics)
    if opts.out:
        payload = {"options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()},
                   "versions": _versions(), "results": results, "numerics": numerics, **summary}  # fmt: skip
        opts.out.write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {opts.out}")
    if opts.keep_work:
        print(f"(work files: {work})")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
