"""Sequence parallelism under the Trainer (`sequence_parallel_size: N` in the superoffload settings).

Two Trainer behaviours change, for one Trainer instance, and nothing else:

- the train dataloader: Accelerate shards batches by process index; here by SP group
  (`process_index = rank // N` of `num_processes = world // N`), so the N ranks of one SP group
  get the same batch. `accelerator.prepare_data_loader` is the one place this is decided.
- `compute_loss`: the batch goes through `SequenceParallel.shard_batch` and the model runs on
  this rank's part of every sequence (Ulysses attention over the group). The loss is divided by
  the Trainer's step target count (`num_items_in_batch`: every accumulation micro-batch, as one
  process divides) and scaled for the optimizer's world mean (parallel/loss.py); without that
  count, the SP group's token-weighted mean of the micro-batch (the Trainer divides by the
  accumulation steps).

The model's attention implementation is swapped in place (parallel/sequence_parallel.py).
"""

from __future__ import annotations

import weakref
from typing import Any

from superoffload_hf.parallel.groups import sequence_parallel_groups
from superoffload_hf.parallel.loss import local_sum_and_count, sequence_parallel_loss, sequence_parallel_window_loss
from superoffload_hf.parallel.sequence_parallel import SequenceParallel


class TrainerSequenceParallel:
    """The Trainer's dataloader sharding and loss under Ulysses sequence parallelism."""

    def __init__(self, trainer, size: int):
        check_trainer_can_shard(trainer, size)
        self._trainer = weakref.ref(trainer)
        self.groups = sequence_parallel_groups(size)  # a collective: every rank builds its Trainer
        self.sp = SequenceParallel(trainer.accelerator.unwrap_model(trainer.model), self.groups.group)
        self._shard_dataloaders_by_replica(trainer.accelerator)
        trainer.compute_loss = self.compute_loss

    def set_optimizer(self, optimizer) -> None:
        """SuperOffloadAdamW: its weight all-gathers are issued before each forward's all-to-alls."""
        self.sp.optimizer = optimizer

    def _shard_dataloaders_by_replica(self, accelerator) -> None:
        import accelerate.accelerator as accelerate_module

        unbound, accelerator_ref = type(accelerator).prepare_data_loader, weakref.ref(accelerator)
        groups = self.groups

        def prepare_data_loader(data_loader, *args, **kwargs):
            stock = accelerate_module.prepare_data_loader

            def by_replica(*inner_args, **inner_kwargs):
                inner_kwargs.update(num_processes=groups.dp_size, process_index=groups.dp_rank)
                return stock(*inner_args, **inner_kwargs)

            # Hazard: Accelerator.prepare_data_loader reads its process index from its state; the
            # module-level function it calls is swapped for the duration of this call only.
            accelerate_module.prepare_data_loader = by_replica
            try:
                return unbound(accelerator_ref(), data_loader, *args, **kwargs)
            finally:
                accelerate_module.prepare_data_loader = stock

        accelerator.prepare_data_loader = prepare_data_loader

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch: Any = None):
        if return_outputs:
            raise NotImplementedError(
                "superoffload sequence parallelism: the Trainer asked for the model outputs (evaluation or "
                "prediction); each rank holds only its part of every sequence's logits. Evaluate without "
                "`sequence_parallel_size` (set `eval_strategy: no` for the training run).")
        trainer = self._trainer()
        batch = self.sp.shard_batch({k: v for k, v in inputs.items() if k != "num_items_in_batch"})
        logits = self.sp.logits(batch["input_ids"], batch["position_ids"])
        if num_items_in_batch is None:  # the Trainer divides by the accumulation steps itself
            return sequence_parallel_loss(logits, batch["shift_labels"], self.groups.group, self.sp.ignore_index)
        local, _ = local_sum_and_count(logits, batch["shift_labels"], self.sp.ignore_index)
        world = trainer.args.world_size
        if trainer.args.average_tokens_across_devices and world > 1:
            denominator = num_items_in_batch / self.groups.size  # gathered over every rank: each group's N times
        else:  # this replica's count: each replica's loss its own token mean, as stock DDP without averaging
            denominator = num_items_in_batch * self.groups.dp_size
        return sequence_parallel_window_loss(local, self.groups.group, denominator, world, self.groups.dp_size)


def check_trainer_can_shard(trainer, size: int) -> None:
    from transformers import Trainer as HFTrainer

    if type(trainer).compute_loss is not HFTrainer.compute_loss:
        raise ValueError(
            f"`sequence_parallel_size` is {size} but {type(trainer).__name__} overrides `compute_loss`: under "
            "sequence parallelism superoffload computes the loss on each rank's part of the sequence and cannot "
            "shard a custom loss. Use transformers.Trainer (or superoffload_hf.Trainer), or set "
            "`sequence_parallel_size: 1`.")
    for name in ("label_smoother", "compute_loss_func"):
        if getattr(trainer, name, None) is not None:
            raise ValueError(f"`sequence_parallel_size` is {size} with the Trainer's `{name}` set: the sequence-"
                             "parallel loss is the plain causal-LM cross-entropy. Drop it, or set "
                             "`sequence_parallel_size: 1`.")
    strategy = str(getattr(trainer.args.eval_strategy, "value", trainer.args.eval_strategy))
    if strategy != "no":
        raise ValueError(f"`sequence_parallel_size` is {size} with `eval_strategy` {strategy!r}: evaluation under "
                         "sequence parallelism is not supported yet (each rank holds only part of the logits). "
                         "Set `eval_strategy: no`, or `sequence_parallel_size: 1`.")
