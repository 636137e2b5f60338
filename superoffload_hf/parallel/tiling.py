"""Which of the sequence-tiled loss and MLP a run uses (config `tiled_loss`, `tiled_mlp`), and
applying them to the model: the one place where the Trainer integration (and anyone preparing a
model for training) turns them on.

`choose_tiling(...)` is pure: "on" / "off" as given; "auto" off on the CPU device, else on when
the untiled term of the activation estimate (perf/activation_memory.py: the loss's logits part;
one block's MLP intermediate) exceeds TILED_AUTO_SHARE of the free device memory at the batch's
size. `prepare_tiling(model, config, runtime)` applies what is known now and, for "auto" on an
accelerator, decides once at the model's first forward with labels (the batch's shape is known
only then), applying the tiled MLP before the decoder runs and the tiled loss in that call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

from superoffload_hf.config import AUTO, TILED_AUTO_SHARE, SuperOffloadConfig
from superoffload_hf.parallel.tiled_loss import _head_and_decoder, apply_tiled_loss, is_tiled_loss
from superoffload_hf.parallel.tiled_mlp import apply_tiled_mlp, decoder_mlps, is_tiled_mlp

logger = logging.getLogger("superoffload_hf.parallel.tiling")


@dataclass(frozen=True)
class TilingChoice:
    loss: bool
    mlp: bool
    reason: str

    def describe(self) -> str:
        on = lambda b: "on" if b else "off"  # noqa: E731
        return f"tiled loss {on(self.loss)}, tiled MLP {on(self.mlp)} ({self.reason})"


def untiled_terms(model_config: Any, micro_batch: int, seq_len: int, dtype_bytes: int) -> tuple[int, int]:
    """(the loss's logits bytes, one block's MLP intermediate bytes) untiled: what tiling removes."""
    from superoffload_hf.perf.activation_memory import estimate_activations

    untiled = estimate_activations(model_config, micro_batch, seq_len, dtype_bytes)
    tiled = estimate_activations(model_config, micro_batch, seq_len, dtype_bytes, tiled_loss=True, tiled_mlp=True,
                                 loss_chunk=1, mlp_chunk=1)
    return untiled.loss - tiled.loss, (untiled.mlp + untiled.backward) - (tiled.mlp + tiled.backward)


def choose_tiling(tiled_loss: str, tiled_mlp: str, device_is_host: bool, *, model_config: Any = None,
                  micro_batch: Optional[int] = None, seq_len: Optional[int] = None, dtype_bytes: int = 2,
                  free_device_bytes: Optional[int] = None) -> TilingChoice:
    """The switches' values for one run; "auto" needs the batch's size and the free device memory
    (else it stays off, saying so)."""
    if AUTO not in (tiled_loss, tiled_mlp):
        return TilingChoice(tiled_loss == "on", tiled_mlp == "on", "as configured")
    if device_is_host:
        return TilingChoice(tiled_loss == "on", tiled_mlp == "on", "auto: off on the CPU device")
    if model_config is None or micro_batch is None or seq_len is None or free_device_bytes is None:
        return TilingChoice(tiled_loss == "on", tiled_mlp == "on", "auto: off, the batch size or free memory unknown")
    loss_bytes, mlp_bytes = untiled_terms(model_config, micro_batch, seq_len, dtype_bytes)
    limit = TILED_AUTO_SHARE * free_device_bytes
    loss = tiled_loss == "on" or (tiled_loss == AUTO and loss_bytes > limit)
    mlp = tiled_mlp == "on" or (tiled_mlp == AUTO and mlp_bytes > limit)
    reason = (f"auto at {micro_batch} x {seq_len} tokens: tiling saves {loss_bytes / 1e9:.2f} GB of logits and "
              f"{mlp_bytes / 1e9:.2f} GB of one block's MLP, against 1/{round(1 / TILED_AUTO_SHARE)} of "
              f"{free_device_bytes / 1e9:.2f} GB free")
    return TilingChoice(loss, mlp, reason)


def prepare_tiling(model, config: SuperOffloadConfig, device_is_host: bool,
                   free_device_bytes: Callable[[], int]) -> Optional[TilingChoice]:
    """Apply config `tiled_loss` / `tiled_mlp` to `model` (a transformers causal LM); returns the
    choice when made now, None when "auto" decides at the first forward with labels. "on" on a
    model the tiling cannot wrap is an error; "auto" leaves such a model alone."""
    from superoffload_hf.perf.activation_memory import DecoderShape

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
