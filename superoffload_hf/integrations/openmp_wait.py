"""How torch's OpenMP threads wait between parallel regions: set by `superoffload train` and
`superoffload launch` before torch loads (libgomp reads it once, when torch is first imported)."""

from __future__ import annotations

# The spin a libgomp thread does before it sleeps, for models that train on the CPU: about a
# few microseconds, where libgomp's default (300,000 spins) busy-waits for up to milliseconds.
CPU_TRAINING_SPINCOUNT = "2000"


def set_openmp_waiting(environ, on_cpu: bool) -> None:
    """How torch's OpenMP threads wait, set before libgomp loads (it reads this once, when torch is
    first imported: nothing in the CLI or the launcher has imported it yet). A user's own setting
    stays. On an accelerator a passive policy: torch's workers spinning after each parallel region
    take the cores the host Adam needs (benchmarks/adam.py: 84% of its isolated speed right after a
    torch op, 100% passive). When the model trains on the CPU, torch's regions are the work and
    come back to back (passive there: 1.5x slower idle), but an unbounded spin on a busy machine
    waits for descheduled partners: a short spin keeps both (benchmarks/README.md, `cpu_overhead.py
    --recipe`: idle 1.04x stock, beside 2 busy processes 0.95x, against 0.52x with the default)."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return
    if on_cpu:
        environ["GOMP_SPINCOUNT"] = CPU_TRAINING_SPINCOUNT
    else:
        environ["OMP_WAIT_POLICY"] = "PASSIVE"
