"""`superoffload train --dry-run`: the memory the run will need, per buffer kind, computed by
the engine's own allocation arithmetic (engine.layout.estimate) for the model built on the
meta device: nothing is downloaded but the model's config.json (read from a local directory or
the local hub cache), and no byte of the model is allocated."""

from __future__ import annotations

from typing import Any, Optional

from superoffload_hf.train.recipe import Recipe


def memory_report(recipe: Recipe) -> str:
    if recipe.superoffload is None:
        return "memory: not estimated (superoffload: false runs the stock optimizer)"
    import torch
    from transformers import AutoModelForCausalLM

    from superoffload_hf.config import SuperOffloadConfig
    from superoffload_hf.engine.layout import estimate
    from superoffload_hf.engine.memory import format_footprint

    model_config = _model_config(recipe)
    if model_config is None:
        name = recipe.model.name_or_path
        return (f"memory: not estimated: the config.json of {name!r} is not available locally "
                f"(`huggingface-cli download {name} config.json` fetches it)")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, dtype=getattr(torch, recipe.model_dtype))
    params = [p for p in model.parameters() if p.requires_grad]
    t = recipe.training
    hyper = dict(lr=float(t.get("learning_rate", 5e-5)), betas=(float(t.get("adam_beta1", 0.9)),
                 float(t.get("adam_beta2", 0.999))), eps=float(t.get("adam_epsilon", 1e-8)))
    decay = [p for p in params if p.ndim >= 2]  # as the Trainer groups them (norms, biases: no decay)
    groups = [g for g in ({"params": decay, "weight_decay": float(t.get("weight_decay", 0.0)), **hyper},
                          {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, **hyper}) if g["params"]]
    config = SuperOffloadConfig.coerce(recipe.superoffload)
    accelerator = not t.get("use_cpu", False)
    plan, rows = estimate(params, groups, config, accelerator, int(t.get("gradient_accumulation_steps", 1)))
    n = sum(p.numel() for p in params)
    where = "an accelerator (cast auto = host, device_buckets auto = 0)" if accelerator else "the CPU"
    return "\n".join([f"memory: {n / 1e9:.3f}B parameters, {len(plan.buckets)} buckets, on {where}; "
                      "activations and the device gradients of the model not included",
                      format_footprint(rows, n)])


def _model_config(recipe: Recipe) -> Optional[Any]:
    from transformers import AutoConfig

    if recipe.model.config is not None:
        values = dict(recipe.model.config)
        if recipe.tokenizer.shipped:
            values.setdefault("vocab_size", recipe.tokenizer.vocab_size)
        return AutoConfig.for_model(values.pop("model_type", "llama"), **values)
    try:
        return AutoConfig.from_pretrained(recipe.model.name_or_path, local_files_only=True)
    except (OSError, ValueError):
        return None
