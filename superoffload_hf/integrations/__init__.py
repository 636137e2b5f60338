"""Hugging Face integrations of SuperOffload (they import the core; the core never imports them).

- `trainer`: `TrainingArguments` / `Trainer` with `superoffload=True`, and `SuperOffloadHooks`.
- `callback`: `SuperOffloadCallback` (grad norm and engine counters in the Trainer's logs).
- `accelerate`: `SuperOffloadPlugin`, the optimizer wrapper and `prepare` for custom loops.
- `launcher`: `superoffload launch` (accelerate launch + a `superoffload:` config block).
- `resume`, `checkpoint_save`: what a resume loads, and a checkpoint save that fails cleanly.
- `autopatch`: the one place a stock `transformers.Trainer` gets superoffload under the launcher.

Importing this package imports neither transformers nor accelerate; its modules do.
"""
