"""Gradients in: from the autograd hooks into each bucket's host buffers, launching (and, when
speculating, stepping) a bucket as soon as its last micro-batch's gradients are complete.

Runs on autograd's thread (the hooks) and on the training thread (step(), zero_grad()); never
both at once, since backward() blocks its caller.

A host bucket's gradient goes on through the route (engine/step/route.py in one process, the
sharded engine/dp/route.py under data parallelism); a device-resident bucket's is accumulated here.
"""

from __future__ import annotations

from typing import Optional

import torch

from superoffload_hf.engine.state.buffers import BucketBuffers
from superoffload_hf.engine.step.hooks import HeldGrad, register_param_hooks
from superoffload_hf.engine.state.lifecycle import BucketRuntime

FP32 = torch.float32


class Collector:
    def __init__(self, *, params, buckets, worker, route, observer, live, unhooked: list, handles: list):
        self.params, self.buckets, self.worker, self.route, self.observer = params, buckets, worker, route, observer
        self.live = live  # read at use: fire_log changes over time
        self.unhooked, self.handles = unhooked, handles  # frozen parameters; every hook's handle
        self.held: list[Optional[HeldGrad]] = [None] * len(params)  # one placeholder per parameter
        self.held_out = False  # a p.grad may be a placeholder (cleared by the next forward)

    # ---- autograd thread ------------------------------------------------------------------

    def on_grad(self, index: int, p: torch.Tensor) -> None:
        """The post-accumulate-grad hook of parameter `index` (hooks.py).

        Lean path (`rt.lean`, set below once the bucket's first gradient of this step came through
        the full path): a parameter's first gradient of the step is kept as autograd made it and
        nothing else happens until step(), whose finish() closes the round. It runs inside
        backward, between kernels, where every Python statement runs from a cold cache (about
        25 us for the full path on a small model's parameter): keep it this short."""
        rt, k = self.buckets.where[index]
        if rt.lean and not rt.present[k]:
            grad = p.grad
            held = self.held[index]
            if grad.dtype is FP32 and held is not None and grad.is_contiguous():
                try:
                    p.grad = held  # any later use of p.grad raises (e.g. clip_grad_norm_)
                except RuntimeError:  # the parameter was resized under us: the full path says so
                    pass
                else:
                    self.held_out = True
                    rt.autograd_grads[k] = grad  # read in place by the step
                    rt.present[k] = rt.round_fired[k] = True
                    rt.fires[k] += 1
                    return
        self.observer.open_step()
        self.on_grad_accumulated(p, index)

    def on_grad_accumulated(self, p: torch.Tensor, index: Optional[int] = None) -> None:
        self.worker.raise_if_failed()
        if index is None:
            index = self.buckets.index_of[p]
        rt, k = self.buckets.where[index]
        grad = p.grad.detach().reshape(-1)
        slot = rt.bucket.slots[k]
        if grad.numel() != slot.numel:
            raise RuntimeError(
                f"Parameter {index} has a gradient of {grad.numel()} elements (shape {tuple(p.shape)}), but "
                f"the optimizer was built when it had {slot.numel} (shape {tuple(slot.shape)}): it was "
                "replaced or resized after the optimizer was built (`p.data = ...`). Build the optimizer "
                "from the final model; to set new values, write them in place after `optimizer.synchronize()` "
                "(`with torch.no_grad(): p.copy_(...)`, which the race check sees, unlike `p.data.copy_`).")
        held = self.held[index]
        if held is None or held.dtype != p.dtype or held.shape != p.shape:
            held = self.held[index] = HeldGrad(p)
        p.grad = held  # any later use of p.grad raises (e.g. clip_grad_norm_)
        self.held_out = True
        if self.live.fire_log is not None:
            self.live.fire_log.record(index)
        if rt.bucket.device_resident:
            self._accumulate_on_device(rt, k, grad)
        else:
            self.route.collect(rt, k, grad)

    def release_held(self) -> None:
        """Before a forward: every placeholder back to None, so that this forward's backward
        accumulates into a fresh gradient (the held ones are the optimizer's already)."""
        self.held_out = False
        for p in self.params:
            if type(p.grad) is HeldGrad:
                p.grad = None

    def _accumulate_on_device(self, rt: BucketRuntime, k: int, grad: torch.Tensor) -> None:
        view = BucketBuffers.view(rt.bufs.grad, rt.bucket.slots[k])
        if rt.present[k]:
            view.add_(grad)  # fp32 += low precision: summed in fp32
        else:
            view.copy_(grad)
        rt.present[k] = True
        rt.fires[k] += 1

    # ---- training thread, at step() -------------------------------------------------------

    def adopt_unhooked_grads(self) -> None:
        """Parameters frozen at construction and unfrozen since: hook them; take their grads."""
        for p in [p for p in self.unhooked if p.requires_grad]:
            self.unhooked.remove(p)
            register_param_hooks([p], self, self.buckets.index_of, self.handles)
            if p.grad is not None and not isinstance(p.grad, HeldGrad):
                self.on_grad_accumulated(p)

    def finish(self) -> bool:
        """Flush partial rounds and launch every staged bucket not launched yet. False when
        there is nothing to step (data parallel: no rank had a gradient)."""
        return self.route.finish()

    def discard(self) -> None:
        """Forget this step's gradients (zero_grad() between backward and step()), undoing any
        speculative step taken with them. The caller resets and synchronizes afterwards."""
        self.route.discard()
