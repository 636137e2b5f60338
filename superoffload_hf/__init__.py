"""superoffload_hf: SuperOffload (ASPLOS 2026) as a Hugging Face training backend."""

from superoffload_hf.config import ConfigError, SuperOffloadConfig
from superoffload_hf.plan.buckets import BucketPlan
from superoffload_hf.metrics import OffloadCounters

__all__ = ["BucketPlan", "ConfigError", "OffloadCounters", "SuperOffloadAdam", "SuperOffloadAdamW",
           "SuperOffloadConfig", "patch_trainer", "unpatch_trainer"]
__version__ = "0.1.0"

# The Hugging Face integrations, imported on first use: importing the core (above) must not
# import transformers or accelerate. `from superoffload_hf import TrainingArguments, Trainer`, or
# `superoffload_hf.patch_trainer()` for any Trainer subclass (TRL's).
_INTEGRATIONS = {
    # the optimizers import torch: on first use, so that the CLI can set torch's OpenMP wait
    # policy before torch loads (superoffload_hf.cli.main)
    "SuperOffloadAdamW": "superoffload_hf.optimizer",
    "SuperOffloadAdam": "superoffload_hf.optimizer",
    "TrainingArguments": "superoffload_hf.integrations.trainer",
    "Trainer": "superoffload_hf.integrations.trainer",
    "SuperOffloadCallback": "superoffload_hf.integrations.callback",
    "SuperOffloadPlugin": "superoffload_hf.integrations.accelerate",
    # any Trainer subclass (TRL's SFTTrainer, DPOTrainer, ...) in this process
    "patch_trainer": "superoffload_hf.integrations.patch",
    "unpatch_trainer": "superoffload_hf.integrations.patch",
}


def __getattr__(name: str):
    if name not in _INTEGRATIONS:
        raise AttributeError(f"module 'superoffload_hf' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_INTEGRATIONS[name]), name)
