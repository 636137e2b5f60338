"""Which of the sequence-tiled loss and MLP a run uses (config `tiled_loss`, `tiled_mlp`), and
applying them to the model: the one place where the Trainer integration (and anyone preparing a
model for training) turns them on.

`choose_tiling(...)` (plan/activations.py, pure) decides: "on" / "off" as given; "auto" off on
the CPU device, else on when the untiled term of the activation estimate (the loss's logits part;
one block's MLP intermediate) exceeds TILED_AUTO_SHARE of the free device memory at the batch's
size. `prepare_tiling(model, config, runtime)` applies what is known now and, for "auto" on an
accelerator, decides once at the model's first forward with labels (the batch's shape is known
only then), applying the tiled MLP before the decoder runs and the tiled loss in that call.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from superoffload_hf.config import AUTO, SuperOffloadConfig
from superoffload_hf.plan.activations import DecoderShape, TilingChoice, choose_tiling
from superoffload_hf.parallel.tiled_loss import _head_and_decoder, apply_tiled_loss, is_tiled_loss
from superoffload_hf.parallel.tiled_mlp import apply_tiled_mlp, decoder_mlps, is_tiled_mlp

logger = logging.getLogger("superoffload_hf.parallel.tiling")


def prepare_tiling(model, config: SuperOffloadConfig, device_is_host: bool,
                   free_device_bytes: Callable[[], int]) -> Optional[TilingChoice]:
    """Apply config `tiled_loss` / `tiled_mlp` to `model` (a transformers causal LM); returns the
    choice when made now, None when "auto" decides at the first forward with labels. "on" on a
    model the tiling cannot wrap is an error; "auto" leaves such a model alone."""

    if is_tiled_loss(model) or (_wraps(lambda: decoder_mlps(model)) and is_tiled_mlp(model)):
        logger.info("superoffload: the model is tiled already (by an earlier optimizer on it, or apply_tiled_*): "
                    "kept as it is")
        return None
    tiled_loss, tiled_mlp = config.tiled_loss, config.tiled_mlp
    estimable = _wraps(lambda: DecoderShape.from_config(model.config))  # a Llama-style config
    if tiled_loss == AUTO and not (estimable and _wraps(lambda: _head_and_decoder(model))):
        tiled_loss = "off"
    if tiled_mlp == AUTO and not (estimable and _wraps(lambda: decoder_mlps(model))):
        tiled_mlp = "off"
    if tiled_loss == "off" and tiled_mlp == "off":
        return None
    if AUTO not in (tiled_loss, tiled_mlp) or device_is_host:
        choice = choose_tiling(tiled_loss, tiled_mlp, device_is_host)
        _apply(model, config, choice)
        return choice
    if tiled_loss == "off":  # auto MLP only: decided at the first forward, by a hook on the model
        return _decide_mlp_at_first_forward(model, config, tiled_mlp, free_device_bytes)

    def decide(kwargs) -> bool:  # once, at the first forward with labels
        ids = kwargs.get("input_ids")
        shaped = ids if ids is not None else kwargs.get("inputs_embeds")
        batch, seq = (shaped.shape[0], shaped.shape[1]) if shaped is not None else (None, None)
        dtype_bytes = next(model.parameters()).element_size()
        choice = choose_tiling(tiled_loss, tiled_mlp, False, model_config=model.config,
                               micro_batch=batch, seq_len=seq, dtype_bytes=dtype_bytes,
                               free_device_bytes=free_device_bytes())
        if choice.mlp:
            apply_tiled_mlp(model, config.tiled_mlp_chunk_tokens)
        logger.info("superoffload: %s", choice.describe())
        return choice.loss

    apply_tiled_loss(model, config.tiled_loss_chunk_tokens, decide=decide)
    return None


def _decide_mlp_at_first_forward(model, config, tiled_mlp: str, free_device_bytes) -> None:
    def hook(module, args, kwargs):
        handle.remove()
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        choice = choose_tiling("off", tiled_mlp, False, model_config=model.config, micro_batch=ids.shape[0],
                               seq_len=ids.shape[1], dtype_bytes=next(model.parameters()).element_size(),
                               free_device_bytes=free_device_bytes())
        if choice.mlp:  # the decoder has not run yet: this forward already uses it
            apply_tiled_mlp(model, config.tiled_mlp_chunk_tokens)
        logger.info("superoffload: %s", choice.describe())

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    return None


def _wraps(check) -> bool:
    try:
        check()
        return True
    except (ValueError, AttributeError, TypeError):  # not a model (or config) of the kind it handles
        return False


def _apply(model, config: SuperOffloadConfig, choice: TilingChoice) -> None:
    if choice.mlp:
        apply_tiled_mlp(model, config.tiled_mlp_chunk_tokens)
    if choice.loss:
        apply_tiled_loss(model, config.tiled_loss_chunk_tokens)
    logger.info("superoffload: %s", choice.describe())
