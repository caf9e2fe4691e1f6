"""The parts of ``bench/train_step.py``, one concept each.

- ``config``: what both sides share: threads, the LoRA, the optimizer, our TrainConfig;
- ``batch``: the model, the batch and the LoRA's initial weights, written for every contender;
- ``measure``: timing, peak RSS and the first step's gradients, inside a contender's process;
- ``ours``: our ``trainer.Learner.step``;
- ``trl_grpo``: TRL's ``GRPOTrainer.compute_loss`` + backward + clip + AdamW;
- ``children``: the parent's side: each contender in a process of its own, with the CPU it used;
- ``agreement``: the first step of each contender against ours;
- ``report``: the table, the ratios and verdicts, the Markdown.
"""
