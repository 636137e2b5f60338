"""The peak of live tensor storage that torch operators allocate inside a block, on any device.

`AllocationPeak` is a TorchDispatchMode: every operator's output storage that it has not seen is
counted (its nbytes) until the storage is freed (a weak reference's callback), and the largest
sum is the peak. Tensors that exist before the block (parameters, inputs) are not counted; their
gradients, made inside, are. Views share their base's storage and count once. Autograd's own
engine buffers that bypass the dispatcher (none for the ops of a decoder, as far as measured)
would be missed. The allocator's caching and fragmentation are not modelled: this is what
`torch.cuda.max_memory_allocated` reports, not the reserved memory.

    with AllocationPeak() as peak:
        loss = model(**batch).loss
        loss.backward()
    peak.peak_bytes
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class AllocationPeak(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[int, weakref.ref] = {}  # id(storage) -> a weak reference whose callback frees it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._count(t.untyped_storage())
        return out

    def _count(self, storage) -> None:
        key = id(storage)
        if key in self._refs:
            return
        nbytes = storage.nbytes()

        def freed(_ref, key=key, nbytes=nbytes):
            self.live_bytes -= nbytes
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(storage, freed)
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
