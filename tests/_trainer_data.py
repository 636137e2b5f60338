"""The tiny in-memory dataset the Trainer tests train on (tests/integrations/test_trainer.py,
tests/parallel/test_tiling.py)."""

from __future__ import annotations

import torch

from _models import tiny_batch


class TinyDataset(torch.utils.data.Dataset):
    """`size` causal-LM examples of 16 tokens, the same for every run."""

    def __init__(self, size: int = 48):
        self.examples = [{k: v[0] for k, v in tiny_batch(batch=1, seed=i).items()} for i in range(size)]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        return self.examples[index]
