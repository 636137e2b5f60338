"""Weight-flow under data parallelism: the host copy that flows is the ranks' shards, so a unit's
whole weights are all-gathered (a collective: every rank fetches the same units in the same
order, engine/dp/gather.py `gather_for_flow`), for each fetch, for model.state_dict() and at close();
decisions that change what the ranks do (whether the weights fit back at close()) are agreed on.
engine/build.py picks this class where it picks the sharded route."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from superoffload_hf.engine.flow import FlowPlan, WeightFlow, _mark_resident, _Unit


class ShardedWeightFlow(WeightFlow):
    read_hint = ", a gather: call it on every rank together"

    def __init__(self, plan: FlowPlan, params: list[torch.Tensor], buckets, runtime, transfer, waiter, *,
                 gather: Callable, all_ranks_true: Callable[[bool], bool], rank: int, counters=None, timeline=None):
        super().__init__(plan, params, buckets, runtime, transfer, waiter, counters=counters, timeline=timeline)
        # a bucket's rank shards all-gathered into its whole weights, on the current stream: a collective
        self.gather = gather
        self.all_ranks_true = all_ranks_true  # one decision for all ranks
        self.rank = rank  # the global rank (rank 0 keeps what fetch_weights() gathers)
        # prepare_state_dict(): rank 0's host copies of every flowing weight (id -> tensor) until
        # the next forward, step or write; on the other ranks `gathered_elsewhere`
        self.gathered: Optional[dict[int, torch.Tensor]] = None
        self.gathered_elsewhere = False

    def _state_values(self, unit: _Unit) -> dict[int, torch.Tensor]:
        if self.gathered is not None:
            return {id(p): self.gathered[id(p)] for p in unit.params}
        if self.gathered_elsewhere:
            raise RuntimeError(
                f"model.state_dict() on rank {self.rank} after optimizer.fetch_weights(): under data parallelism "
                "with `weights: flow` fetch_weights() gathers the flowing weights for rank 0 only (rank 0's "
                "state_dict() then needs no other rank; the Trainer saves there). Take the state dict on rank 0, "
                "or call model.state_dict() on every rank together without fetch_weights() (a gather, every rank "
                "gets the whole dict).")
        return self._gather_to_host(unit)

    def _gather_to_host(self, unit: _Unit) -> dict[int, torch.Tensor]:
        """Data parallel: the unit's buckets all-gathered (a collective, in bucket order on every
        rank) and its weights copied to the host, one bucket on the device at a time."""
        rt = self.runtime
        self.waiter.wait_for_params(unit.params)
        self._refuse_speculated(unit)
        hosts = {id(p): rt.host_empty(p.numel(), p.dtype) for p in unit.params}
        with torch.no_grad(), rt.on_stream(self.stream):
            if self.last_release is not None and self._keeps("fetch_waits_release"):
                self.stream.wait_event(self.last_release)  # (the gather's buffer may be released memory)
            for bucket_rt in self._buckets_of(unit):
                flat = self.gather(bucket_rt)
                for p, slot in zip(bucket_rt.params, bucket_rt.bucket.slots):
                    if id(p) in hosts:
                        rt.copy_(hosts[id(p)], flat[slot.offset:slot.offset + slot.numel])
            done = rt.new_event()
            done.record(self.stream)
        done.synchronize()  # the host tensors are read as soon as this returns
        return {id(p): hosts[id(p)].view(p.shape) for p in unit.params}

    def prepare_state_dict(self) -> None:
        """optimizer.fetch_weights(), on every rank together: every unit gathered now (the
        collectives), rank 0 keeping the host copies, so that rank 0's `model.state_dict()` needs
        no other rank (the Trainer's save: `save_model` on every rank, the writing on rank 0);
        kept until the next forward, step(), load or write."""
        self.forget_gathered()
        gathered = {}
        for unit in self.units:
            values = self._gather_to_host(unit)
            if self.rank == 0:
                gathered.update(values)
        if self.rank == 0:
            self.gathered = gathered
        else:
            self.gathered_elsewhere = True

    def forget_gathered(self) -> None:
        self.gathered, self.gathered_elsewhere = None, False
        super().forget_gathered()

    def _new_forward(self) -> None:
        if self.gathered is not None or self.gathered_elsewhere:
            self.forget_gathered()

    def _pieces(self, index: int, bucket_rt) -> list[tuple[int, int, int]]:
        return [(piece.offset, piece.param_start, piece.numel) for piece in bucket_rt.shard.pieces
                if piece.index == index]

    def _before_fetch(self, unit: _Unit) -> None:
        self._refuse_speculated(unit)

    def _fetch_unit(self, unit: _Unit) -> None:
        self._gather_unit(unit)

    def _gather_unit(self, unit: _Unit) -> None:
        """On the flow stream: each of the unit's buckets gathered whole (a bucket shared with the
        next unit is gathered for each), the unit's parameters copied out of it."""
        rt = self.runtime
        nbytes_of = {id(p): nbytes for p, nbytes in zip(unit.params, unit.nbytes)}  # (by id: never compare tensors)
        for bucket_rt in self._buckets_of(unit):
            flat = self.gather(bucket_rt)  # every rank's shard; a collective
            for p, slot in zip(bucket_rt.params, bucket_rt.bucket.slots):
                if id(p) not in nbytes_of:
                    continue
                rt.resize_storage(p, nbytes_of[id(p)])  # allocated on the flow stream
                rt.copy_(p.data, flat[slot.offset:slot.offset + slot.numel].view(p.shape))
                rt.record_stream(p.data, self.stream)

    def _refuse_speculated(self, unit: _Unit) -> None:
        """Data parallel: a speculatively stepped shard cannot be re-opened (its gradient has left
        the rank), and a forward between backward and step() must read the weights of before it."""
        for bucket_rt in self._buckets_of(unit):
            if bucket_rt.launched:
                self.waiter.wait_idle(bucket_rt)
                if bucket_rt.spec is not None:
                    raise RuntimeError(
                        f"A forward between backward and step() fetched unit {unit.spec.name}, whose bucket "
                        f"{bucket_rt.bucket.index} this rank has already stepped speculatively: under data "
                        "parallelism with `weights: flow` its weights before the step are no longer on the host. "
                        "Run the forward after step() (or before backward), set `speculation: off`, or use "
                        "`weights: stationary`.")

    def _all_agree(self, fits: bool) -> bool:
        return self.all_ranks_true(fits)

    def _restore_away_to_host(self, unit: _Unit) -> None:
        self._restore_to_host_through_the_device(unit)  # only a gather has the whole weights

    def _restore_to_host_through_the_device(self, unit: _Unit) -> None:
        rt = self.runtime
        self.ensure(unit)  # gathered on the flow stream, which the current stream now waits for
        hosts = []
        for p in unit.params:
            host = rt.host_empty(p.numel(), p.dtype)
            rt.copy_(host, p.data.reshape(-1))
            hosts.append(host.view(p.shape))
        done = rt.new_event()
        done.record(rt.current_stream())
        done.synchronize()  # the host tensors are read as soon as this returns
        self.release(unit)
        _mark_resident(unit)
        for p, host in zip(unit.params, hosts):
            p.data = host
        rt.disown(unit.params)
        unit.resident = True

    def restore_after_failure(self) -> bool:
        """Nothing: the whole weights need a gather, a collective the other ranks may never join."""
        return False
