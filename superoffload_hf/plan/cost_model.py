"""The cost model: measurements of a machine and a model in, a layout plan and a predicted step
time out. Pure: dataclasses and arithmetic, no torch, no device calls (the probe measures,
`superoffload_hf.perf.probe`; the engine decides with `choose_plan`).

One optimizer step, as the engine runs it (DESIGN.md section 4), is simulated bucket by bucket:

    backward delivers bucket j's gradients at ready_j (the workload's ready profile)
    D2H   on the copy stream:  starts at max(ready_j, previous D2H done)   link_bytes / d2h(size)
    host  on the worker:       starts at max(D2H done, previous host job)  host_bytes / host rate
          (without speculation: not before validation, i.e. every gradient is on the host)
    H2D   on the copy stream:  starts at max(host done, previous H2D done) link_bytes / h2d(size)
    the last `device_buckets` buckets are stepped on the device after backward (device Adam rate)
    the next forward starts when backward and the device Adam end, and reaches bucket j's layers
    after the share of the forward that precedes them (forward order is the reverse of ready
    order); it waits there until bucket j's H2D is done.

The exposed time is the longest such wait; it is split into host time (the wait that remains
with an infinitely fast link) and transfer time (the rest). Step time = forward + backward +
device Adam + exposed. When the device is the host itself (the CPU as the device), nothing
overlaps: host work competes with backward for the same cores, so every host second is exposed.

Bytes per element (fp32 master, Adam moments m and v; the engine's buffers, engine/state/buffers.py):

    cast "device": the gradient crosses in fp32 straight into the fp32 staging buffer; the
                   kernel reads p, g, m, v and writes p, m, v (28 B) after the norm reads g
                   (4 B); fp32 weights cross back (4 B) and the device casts them.
    cast "host":   the gradient crosses in the low-precision dtype into a landing buffer (2);
                   with one micro-batch the kernel reads it there as it is (engine/step/jobs.py: no
                   upcast): the norm reads it (2), the Adam pass reads a 2-byte gradient (26 B)
                   and writes the low-precision copy (2); that copy crosses back (2 B).
    Copies land in (and leave from) host memory too: their bytes count against host bandwidth.

The probe measures the host Adam rate on the 30-byte pass (fp32 gradient + low-precision copy);
host time = bytes / (30 x rate).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

GB = 1e9
MB = 2**20
FP32 = 4
MEASURED_PASS_BYTES = 30
"""Bytes per element of the host Adam call the probe times: read p, g, m, v (16), write p, m, v
(12) and a bf16 copy (2)."""
DEVICE_STATE_BYTES = 16
"""Device memory per element of a device-resident bucket: fp32 master, m, v and gradient."""
BUCKET_SIZES_MB = (4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
MIN_BUCKETS = 4
TIE_TOLERANCE = 0.005
"""Plans whose predicted step times differ by less than this fraction are ties; ties go to the
simpler plan (fewer device buckets, larger buckets, speculation off)."""
CASTS = ("device", "host")


def host_bytes_per_element(cast: str, lowp_bytes: int, aliased: bool = False) -> float:
    """Host memory traffic per element of one host bucket's step, copies included. `aliased`:
    the CPU device with fp32, where nothing is copied (the norm reads g, then the Adam pass)."""
    if aliased:
        return FP32 + 28
    if cast == "device":
        return FP32 + FP32 + 28 + FP32  # D2H lands g, norm reads g, Adam pass, H2D reads p
    return lowp_bytes + lowp_bytes + (28 - FP32 + lowp_bytes) + lowp_bytes + lowp_bytes  # land, norm, Adam, copy, H2D


def link_bytes_per_element(cast: str, lowp_bytes: int) -> tuple[int, int]:
    """(device-to-host gradient bytes, host-to-device weight bytes) per element."""
    return (FP32, FP32) if cast == "device" else (lowp_bytes, lowp_bytes)


# ---- measurements -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Bandwidth:
    """Copy bandwidth by transfer size: `points` are (bytes, GB/s), interpolated linearly in
    log(bytes) and clamped at both ends."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if not self.points or any(b <= 0 or g <= 0 for b, g in self.points):
            raise ValueError(f"`points` is {self.points!r}; expected (bytes > 0, GB/s > 0) pairs.")
        object.__setattr__(self, "points", tuple(sorted((float(b), float(g)) for b, g in self.points)))

    @classmethod
    def constant(cls, gbps: float) -> "Bandwidth":
        return cls(((1.0, gbps),))

    def gbps(self, nbytes: float) -> float:
        sizes = [b for b, _ in self.points]
        i = bisect.bisect_left(sizes, nbytes)
        if i == 0:
            return self.points[0][1]
        if i == len(sizes):
            return self.points[-1][1]
        (b0, g0), (b1, g1) = self.points[i - 1], self.points[i]
        w = (math.log(nbytes) - math.log(b0)) / (math.log(b1) - math.log(b0))
        return g0 + w * (g1 - g0)

    def seconds(self, nbytes: float) -> float:
        return nbytes / (self.gbps(nbytes) * GB) if nbytes > 0 else 0.0

    def scaled(self, factor: float) -> "Bandwidth":
        return Bandwidth(tuple((b, g * factor) for b, g in self.points))


@dataclass(frozen=True)
class Machine:
    """What the probe measures about one machine (or what a test makes up)."""

    name: str
    h2d: Bandwidth
    """Page-locked host-to-device copies (the engine pins its buffers on an accelerator)."""
    d2h: Bandwidth
    host_adam_rate: float
    """Elements per second of the host Adam (30-byte pass) at the engine's thread count, alone."""
    host_adam_rate_busy: float
    """The same while other host work runs (the training thread, copies landing in memory)."""
    device_adam_rate: float
    """Elements per second of an fp32 AdamW step on the device (a device-resident bucket)."""
    device_free_bytes: float
    host_is_device: bool = False
    """The CPU is the device: host work competes with forward and backward for the same cores."""
    lowp_bytes: int = 2
    device_memory_fraction: float = 0.25
    """Share of the free device memory that device-resident buckets may take."""

    def __post_init__(self) -> None:
        for name in ("host_adam_rate", "host_adam_rate_busy", "device_adam_rate"):
            if not getattr(self, name) > 0:
                raise ValueError(f"`{name}` is {getattr(self, name)!r}; expected elements per second > 0.")


@dataclass(frozen=True)
class Workload:
    """One model at one batch: its size, forward and backward times, and when its gradients
    arrive during backward."""

    num_params: int
    forward_s: float
    backward_s: float
    ready_profile: tuple[tuple[float, float], ...] = ()
    """(fraction of elements whose gradients are complete, fraction of backward elapsed)
    points in ready order, from the probe's hooks; empty: uniform (the i-th element is ready
    after the fraction i/N of backward)."""
    rollback_rate: float = 0.05
    """Expected fraction of steps whose speculative work is rolled back (clipped or skipped)."""
    tokens_per_step: int = 0

    def __post_init__(self) -> None:
        if self.num_params < 1 or self.forward_s < 0 or self.backward_s < 0:
            raise ValueError(f"Workload {self!r}: expected num_params >= 1 and non-negative times.")
        if not 0.0 <= self.rollback_rate <= 1.0:
            raise ValueError(f"`rollback_rate` is {self.rollback_rate!r}; expected a fraction in [0, 1].")

    def ready_seconds(self, elements_done: float) -> float:
        """Seconds after backward starts at which the first `elements_done` gradients are complete."""
        x = min(1.0, max(0.0, elements_done / self.num_params))
        points = ((0.0, 0.0),) + tuple(self.ready_profile) + ((1.0, 1.0),)
        xs = [p[0] for p in points]
        i = min(max(1, bisect.bisect_left(xs, x)), len(points) - 1)
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        y = y0 if x1 <= x0 else y0 + (x - x0) / (x1 - x0) * (y1 - y0)
        return self.backward_s * min(1.0, max(0.0, y))


# ---- predictions ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    forward_s: float
    backward_s: float
    device_adam_s: float
    exposed_host_s: float
    exposed_transfer_s: float
    host_busy_s: float
    """Host Adam seconds per step (hidden or not)."""

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s + self.device_adam_s + self.exposed_host_s + self.exposed_transfer_s

    @property
    def device_idle_fraction(self) -> float:
        return (self.exposed_host_s + self.exposed_transfer_s) / self.step_s if self.step_s > 0 else 0.0


@dataclass(frozen=True)
class Plan:
    """The layout `choose_plan` picked, with its predicted step and the reasons."""

    bucket_mb: float
    bucket_numel: int
    num_buckets: int
    device_buckets: int
    cast: str
    speculate: bool
    prediction: Prediction
    reasons: tuple[str, ...] = field(default=())

    def format(self) -> str:
        p = self.prediction
        lines = [
            f"plan: bucket {self.bucket_mb:g} MB ({self.bucket_numel:,} elements, {self.num_buckets} "
            f"bucket{'s' if self.num_buckets != 1 else ''}), "
            f"{self.device_buckets} device-resident, cast on the {self.cast}, speculation {'on' if self.speculate else 'off'}",
            f"predicted step {p.step_s * 1e3:.2f} ms = forward {p.forward_s * 1e3:.2f} + backward {p.backward_s * 1e3:.2f}"
            f" + device Adam {p.device_adam_s * 1e3:.2f} + exposed host {p.exposed_host_s * 1e3:.2f}"
            f" + exposed transfers {p.exposed_transfer_s * 1e3:.2f} (device idle {p.device_idle_fraction:.0%};"
            f" host Adam busy {p.host_busy_s * 1e3:.2f} ms)",
        ]
        lines += [f"  because {r}" for r in self.reasons]
        return "\n".join(lines)


def bucket_sizes(num_params: int, bucket_numel: int) -> list[int]:
    """Element counts of the buckets in ready order (the last one may be short)."""
    full, rest = divmod(num_params, bucket_numel)
    return [bucket_numel] * full + ([rest] if rest else [])


def predict(machine: Machine, workload: Workload, *, bucket_numel: int, device_buckets: int, cast: str,
            speculate: bool) -> Prediction:
    """The step time of one layout on one machine (see the module docstring)."""
    sizes = bucket_sizes(workload.num_params, bucket_numel)
    if not 0 <= device_buckets <= len(sizes):
        raise ValueError(f"`device_buckets` is {device_buckets}; expected 0..{len(sizes)} (the number of buckets).")
    return predictions_by_device_buckets(machine, workload, bucket_numel, cast, speculate)[device_buckets]


def predictions_by_device_buckets(machine: Machine, workload: Workload, bucket_numel: int, cast: str,
                                  speculate: bool) -> list[Prediction]:
    """`predict` for every number of device-resident buckets (index k = 0..num_buckets) in one
    pass: the timeline of the first m host buckets does not depend on the buckets after them."""
    if cast not in CASTS:
        raise ValueError(f"`cast` is {cast!r}; valid choices are {list(CASTS)}.")
    sizes = bucket_sizes(workload.num_params, bucket_numel)
    n = len(sizes)
    # the CPU with fp32: the parameters are views of the masters and the host Adam reads
    # autograd's gradients in place (engine/state/buckets.py, host/segmented.py): nothing is copied
    aliased = machine.host_is_device and machine.lowp_bytes == FP32
    host_seconds_per_element = host_bytes_per_element(cast, machine.lowp_bytes, aliased) / (
        MEASURED_PASS_BYTES * machine.host_adam_rate)
    late = {link: _lateness(machine, workload, sizes, cast, speculate, link) for link in (True, False)}
    out = []
    for k in range(n + 1):
        m = n - k
        host_numel = sum(sizes[:m])
        device_adam_s = (workload.num_params - host_numel) / machine.device_adam_rate
        host_busy = host_numel * host_seconds_per_element
        if machine.host_is_device:
            copies = 0.0 if aliased else sum(_copy_seconds(machine, cast, x) for x in sizes[:m])
            out.append(Prediction(workload.forward_s, workload.backward_s, device_adam_s, host_busy, copies, host_busy))
            continue
        exposed = max(0.0, late[True][m] - device_adam_s)
        exposed_host = min(exposed, max(0.0, late[False][m] - device_adam_s))
        out.append(Prediction(workload.forward_s, workload.backward_s, device_adam_s, exposed_host,
                              exposed - exposed_host, host_busy))
    return out


def _copy_seconds(machine: Machine, cast: str, numel: int) -> float:
    down, up = link_bytes_per_element(cast, machine.lowp_bytes)
    return machine.d2h.seconds(numel * down) + machine.h2d.seconds(numel * up)


def _lateness(machine: Machine, workload: Workload, sizes: Sequence[int], cast: str, speculate: bool,
              link: bool) -> list[float]:
    """late[m]: with the first m buckets on the host, how long after the end of backward the
    next forward waits on one of them, before subtracting the device Adam time (backward starts
    at 0; -inf for m = 0). `link=False`: copies take no time."""
    down, up = link_bytes_per_element(cast, machine.lowp_bytes)
    per_element_s = host_bytes_per_element(cast, machine.lowp_bytes) / MEASURED_PASS_BYTES
    backward_end, total = workload.backward_s, workload.num_params
    d2h_free = h2d_free = host_free = 0.0
    done, worst = 0, -math.inf
    late = [-math.inf]
    for n in sizes:
        done += n
        d2h_free = max(workload.ready_seconds(done), d2h_free) + (machine.d2h.seconds(n * down) if link else 0.0)
        # Speculation: the host job starts once its gradient has landed. Without it, every job
        # waits for validation (the last gradient landed, backward over): all start at one
        # gate, so they are timed from 0 here and the gate is added below.
        start = max(d2h_free, host_free) if speculate else host_free
        rate = machine.host_adam_rate_busy if speculate and start < backward_end else machine.host_adam_rate
        host_free = start + n * per_element_s / rate
        h2d_free = max(host_free, h2d_free) + (machine.h2d.seconds(n * up) if link else 0.0)
        needed_at = backward_end + workload.forward_s * (total - done) / total
        worst = max(worst, h2d_free - needed_at)
        gate = 0.0 if speculate else max(backward_end, d2h_free)  # validation needs every norm
        late.append(gate + worst)
    return late


# ---- choosing ---------------------------------------------------------------------------------


def candidate_bucket_numels(num_params: int, sizes_mb: Sequence[float] = BUCKET_SIZES_MB,
                            host_is_device: bool = False) -> list[int]:
    """Bucket sizes (elements) that give the model at least MIN_BUCKETS buckets; a small model
    gets one size, num_params / MIN_BUCKETS. Where the host is the device, the engine's own rule
    (plan/buckets.py auto_bucket_numel, never shrunk): its host jobs run inline after backward, so
    more buckets overlap nothing and only cost Python time per step, which this model leaves out."""
    if host_is_device:
        from superoffload_hf.plan.buckets import auto_bucket_numel

        sizes = ["auto"] if tuple(sizes_mb) == BUCKET_SIZES_MB else list(sizes_mb)
        return sorted({auto_bucket_numel(mb, num_params, min_buckets=1) for mb in sizes})
    numels = [int(mb * MB) // FP32 for mb in sizes_mb]
    fitting = [n for n in numels if math.ceil(num_params / n) >= MIN_BUCKETS]
    return fitting or [max(1, math.ceil(num_params / MIN_BUCKETS))]


def max_device_buckets(machine: Machine, num_buckets: int, bucket_numel: int) -> int:
    """At most half the buckets (offloading stays the point), within the device memory share."""
    if machine.host_is_device:
        return 0  # the device's memory is the host's: keeping state "on the device" gains nothing
    affordable = int(machine.device_free_bytes * machine.device_memory_fraction) // (DEVICE_STATE_BYTES * bucket_numel)
    return max(0, min(num_buckets // 2, affordable))


def expected_step_s(machine: Machine, workload: Workload, *, bucket_numel: int, device_buckets: int,
                    cast: str, speculate: bool) -> float:
    """Predicted step time averaged over rollbacks: a rolled-back step costs the non-speculative
    step plus undoing the speculative work (one more host pass), all exposed."""
    kwargs = dict(bucket_numel=bucket_numel, device_buckets=device_buckets, cast=cast)
    plain = predict(machine, workload, speculate=False, **kwargs)
    fast = predict(machine, workload, speculate=True, **kwargs) if speculate else None
    return _expected(plain, fast, workload.rollback_rate)


def _expected(plain: Prediction, fast: Optional[Prediction], rollback_rate: float) -> float:
    if fast is None:
        return plain.step_s
    return (1.0 - rollback_rate) * fast.step_s + rollback_rate * (plain.step_s + plain.host_busy_s)


def choose_plan(machine: Machine, workload: Workload, *, bucket_sizes_mb: Sequence[float] = BUCKET_SIZES_MB,
                casts: Sequence[str] = CASTS) -> Plan:
    """The layout with the lowest expected step time: bucket size, device-resident buckets, cast
    location and whether to speculate. Ties (within TIE_TOLERANCE) go to the simpler plan."""
    if machine.host_is_device:
        casts = ("device",)  # no link to save bytes on; a host cast is one more pass over host memory
    scored = []
    for cast in casts:
        for numel in candidate_bucket_numels(workload.num_params, bucket_sizes_mb, machine.host_is_device):
            count = len(bucket_sizes(workload.num_params, numel))
            plain = predictions_by_device_buckets(machine, workload, numel, cast, speculate=False)
            fast = predictions_by_device_buckets(machine, workload, numel, cast, speculate=True)
            for device_buckets in range(max_device_buckets(machine, count, numel) + 1):
                for speculate in (False, True):
                    t = _expected(plain[device_buckets], fast[device_buckets] if speculate else None,
                                  workload.rollback_rate)
                    choice = dict(bucket_numel=numel, device_buckets=device_buckets, cast=cast, speculate=speculate)
                    scored.append((t, (speculate, device_buckets, -numel, list(casts).index(cast)), choice))
    fastest = min(t for t, _, _ in scored)
    _, _, choice = min((s for s in scored if s[0] <= fastest * (1 + TIE_TOLERANCE)), key=lambda s: s[1])
    prediction = predict(machine, workload, **choice)
    return Plan(bucket_mb=choice["bucket_numel"] * FP32 / MB, bucket_numel=choice["bucket_numel"],
                num_buckets=len(bucket_sizes(workload.num_params, choice["bucket_numel"])),
                device_buckets=choice["device_buckets"], cast=choice["cast"], speculate=choice["speculate"],
                prediction=prediction, reasons=_reasons(machine, workload, choice, prediction))


def _reasons(machine: Machine, workload: Workload, choice: dict, prediction: Prediction) -> tuple[str, ...]:
    if machine.host_is_device:
        return (f"the device is the host: host Adam ({prediction.host_busy_s * 1e3:.2f} ms) competes with "
                "backward for the same cores, so nothing overlaps and device-resident buckets gain nothing",)
    other_cast = "host" if choice["cast"] == "device" else "device"
    kwargs = dict(choice, cast=other_cast)
    alt = expected_step_s(machine, workload, **kwargs)
    no_dev = expected_step_s(machine, workload, **dict(choice, device_buckets=0))
    no_spec = expected_step_s(machine, workload, **dict(choice, speculate=False))
    return (
        f"host Adam needs {prediction.host_busy_s * 1e3:.2f} ms a step against {workload.backward_s * 1e3:.2f} ms of backward",
        f"cast on the {other_cast} would take {alt * 1e3:.2f} ms",
        f"with no device buckets: {no_dev * 1e3:.2f} ms; without speculation: {no_spec * 1e3:.2f} ms",
    )
