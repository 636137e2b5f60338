"""How the engine's page-locked host arenas are pinned: a value computed once, applied around
each allocation of them.

torch's caching host allocator page-locks a new block either by cudaHostAlloc (its default) or,
with `pinned_use_cuda_host_register`, by malloc, faulting the pages in from several threads and
cudaHostRegister. The second is often several times faster for large blocks (the faulting is
parallel), and Llama-3.1-8B's pinned arenas are tens of GB: seconds to minutes of start-up.
Which is faster depends on the machine, so "auto" measures both once on a 64 MiB block
(perf/probe.py `measure_pinning`: the one that pins faster without costing over 5% of the other's
copy bandwidth) when the plan pins enough for it to matter. The allocator setting is global to
the process: it is switched on only while the engine allocates its arenas and set back to torch's
default after, so the user's own pinned tensors (a DataLoader's `pin_memory`) are not affected.
A pinning key the user set (PYTORCH_CUDA_ALLOC_CONF, PYTORCH_ALLOC_CONF or torch's setter) is never
changed, and every other setting of theirs is kept through the switch (device/accelerator.py
`pinning_settings`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

MEASURE_BYTES = 64 << 20  # page-locked once per method by "auto"
MEASURE_POINT_SECONDS = 0.02
AUTO_MIN_PINNED_BYTES = 1 << 30  # below this, pinning takes well under a second either way: torch's default
NO_CHOICE = ("{} has no choice of pinning method (or the user's allocator settings choose it, "
             "e.g. pinned_use_cuda_host_register in PYTORCH_CUDA_ALLOC_CONF: left as they are)")


@dataclass(frozen=True)
class PinMethod:
    register: bool  # cudaHostRegister (True) or cudaHostAlloc
    threads: int  # the threads that fault the pages in (cudaHostRegister)
    reason: str
    measured: Optional[dict] = None  # "auto": measure_pinning's figures

    @property
    def name(self) -> str:
        return "cudaHostRegister" if self.register else "cudaHostAlloc"

    def describe(self) -> str:
        threads = f", {self.threads} threads" if self.register else ""
        return f"{self.name}{threads} ({self.reason})"

    @contextlib.contextmanager
    def applied(self, runtime):
        """Pin the blocks allocated inside by this method; torch's default again after."""
        if not self.register:
            yield
            return
        runtime.host_register(True, self.threads)
        try:
            yield
        finally:
            runtime.host_register(False, self.threads)


def choose_pin_method(runtime, mode: str, threads: int, pinned_bytes: int,
                      measure: Optional[Callable[..., dict]] = None) -> PinMethod:
    """The method for `mode` ("alloc", "register", "auto": config.pin_method) on `runtime`, for a
    plan that page-locks `pinned_bytes`. `measure`: perf.probe.measure_pinning (tests pass their own)."""
    threads = max(1, int(threads))
    if pinned_bytes == 0:
        return PinMethod(False, threads, "nothing is page-locked")
    # host_register(False) is torch's default and changes nothing; it says whether there is a choice
    if not runtime.host_register(False, threads):
        return PinMethod(False, threads, NO_CHOICE.format(runtime.name))
    if mode == "alloc":
        return PinMethod(False, threads, "pin_method: alloc")
    if mode == "register":
        return PinMethod(True, threads, "pin_method: register")
    if pinned_bytes < AUTO_MIN_PINNED_BYTES:
        return PinMethod(False, threads, f"auto: {pinned_bytes / 1e9:.3f} GB page-locked, under "
                                         f"{AUTO_MIN_PINNED_BYTES / 1e9:.1f} GB: torch's default")
    if measure is None:
        from superoffload_hf.perf.probe import measure_pinning as measure
    measured = measure(runtime, MEASURE_BYTES, threads, MEASURE_POINT_SECONDS)
    if not measured:
        return PinMethod(False, threads, NO_CHOICE.format(runtime.name))
    figures = ", ".join(f"{m} {measured[m]['pin_gbps']:.2f} GB/s pinned, h2d {measured[m]['h2d_gbps']:.2f} GB/s"
                        for m in ("cudaHostAlloc", "cudaHostRegister"))
    return PinMethod(measured["faster"] == "cudaHostRegister", threads, f"auto, measured: {figures}", measured)
