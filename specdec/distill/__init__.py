"""`specdec distill`: a draft trained to match the target's next-token distributions.

`data.py` (recorded traffic, text, prompts the target answers; held-out part; windows),
`objectives.py` (the target's top-k distributions and the KL and TV losses), `prepare.py` (the
target's pass over the data, kept for --resume), `trainer.py` (the loop, full or LoRA, its
checkpoints), `evaluate.py` (α before and after, through specdec/maths/alignment.py) and
`run.py` (one run, its report). With `--heads K` no draft: `heads_training.py` (Medusa-style heads
trained on the target's last hidden states) and `heads_run.py` (one heads run, its report).
Needs torch; LoRA needs peft (the `distill` extra).
"""
