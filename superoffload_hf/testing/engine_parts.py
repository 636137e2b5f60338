"""The testing surface: the engine parts that tests (and the GPU checks) look into.

Tests reach an optimizer's private engine only through here, so that the engine's inside can
change with one place to follow. `parts(optimizer)` is a view naming the parts a test may read
(`PARTS`: an attribute not listed raises, naming this file); a test may still call what a part
offers, or wrap one of its methods to record or slow it (that is the test's own business, not
the engine's wiring). Not a public API: it follows the engine.

    parts(opt).buckets.ledger        the host/pinned/device bytes held, per kind
    parts(opt).route.coll            data parallel: the collectives (the local route has none)
    engine_ref(opt)                  a weak reference to the engine (does closing free it?)
"""

from __future__ import annotations

import weakref

# the parts and values a test may read, each with what tests use it for
PARTS = {
    "buckets": "the BucketSet: plan, runtimes, buffers, ledger, arenas",
    "plan": "the current BucketPlan",
    "runtimes": "every bucket's runtime (lifecycle state, events)",
    "params": "the managed parameters, in optimizer order",
    "layout": "the Layout value (decisions, flow choice)",
    "footprint": "what the current plan allocates, per buffer kind",
    "replan": "move the state into another plan (between steps)",
    "learned": "the learned plan's inputs, as checkpoints store them",
    "trade": "the snapshot trade (compact state, speculation auto)",
    "transfer": "the device seam: ring slots, copies, omitted syncs (mutation tests)",
    "runtime": "the device runtime",
    "adam": "the host kernel",
    "jobs": "the host jobs (mutation tests wrap the copy-back)",
    "waiter": "where the training thread waits",
    "inflight": "the buckets a forward may not read yet",
    "collector": "gradients in (placeholders)",
    "route": "local, or sharded (data parallel: coll, gather)",
    "flow": "weight-flow at run time (fetch counts, flowing parameters)",
    "step_returns_early": "whether step() returns before the host work is done",
    "synchronize": "wait for every queued host job",
    "_choose_prefetch_depth": "weight-flow's prefetch depth from measured figures (test_flow_choice)",
}


class EngineParts:
    """A view of one optimizer's engine, naming the parts in `PARTS`."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name: str):
        if name not in PARTS:
            raise AttributeError(f"{name!r} is not on the testing surface (superoffload_hf/testing/engine_parts.py "
                                 f"PARTS: {', '.join(sorted(PARTS))}); add it there with what tests use it for")
        return getattr(self._engine, name)


def parts(optimizer) -> EngineParts:
    """The engine parts of a SuperOffload optimizer (the innermost one of a wrapped optimizer)."""
    return EngineParts(optimizer._engine)


def engine_ref(optimizer) -> weakref.ref:
    """A weak reference to the optimizer's engine."""
    return weakref.ref(optimizer._engine)


def is_superoffload(optimizer) -> bool:
    """Whether `optimizer` is a SuperOffload optimizer (has an engine)."""
    return hasattr(optimizer, "_engine")


def return_early(optimizer) -> None:
    """step() returns before the host work is done, as on an accelerator (on the CPU device it
    finishes the host work): the next forward waits per bucket."""
    optimizer._engine.step_returns_early = True
