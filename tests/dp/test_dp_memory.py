"""The memory estimate under data parallelism (`superoffload train --dry-run --num_processes N`:
plan.layout.estimate with a shard world of N) against what 2 gloo ranks allocate, per kind:
the host arenas from the engine's Ledger (the same arithmetic: equal to the byte), the device
buffers of engine/dp/route.py (outside the Ledger: every allocation they make is tracked while the
ranks train) within 5% of their measured peak. (The copy-backs reuse one pair of all-gather
buffers: fresh ones per bucket stayed alive until gloo's thread dropped the finished collective,
so the peak depended on timing, 1 to 3 buckets under load.)

The ranks run fp32 on the CPU (gloo, the CPU as the device): gradients cross in fp32, so every
device buffer dp.py makes comes from `device_empty` (no upcast copy escapes the tracker); the
rows for a bf16 link (cast "host" on an accelerator) are not measured here."""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict

import pytest

from _dist import run_ranks
from superoffload_hf.testing.engine_parts import parts

pytestmark = pytest.mark.timeout(240)

LEDGER_KIND = {"grad staging": "grad", "grad landing": "recv"}  # footprint row -> Ledger kind
SCENARIOS = {
    # one micro-batch: the open gradient buckets are one per param group; replicated device bucket
    "accumulation_1_snapshot_device_bucket": dict(accumulation=1, config={"device_buckets": 1, "rollback": "snapshot"}),
    # three micro-batches: every host bucket's gradient on the device; a landing arena on the host
    "accumulation_3": dict(accumulation=3, config={"device_buckets": 0}),
}


class DeviceTracker:
    """Live and peak bytes of the device tensors `runtime.device_empty` hands out, per phase of
    engine/dp/route.py that asked for them (the innermost wrapped method on this thread)."""

    def __init__(self):
        self.live: dict[str, int] = defaultdict(int)
        self.peak: dict[str, int] = defaultdict(int)
        self.phase = threading.local()

    def wrap_allocator(self, runtime) -> None:
        allocate = runtime.device_empty

        def device_empty(numel, dtype):
            t = allocate(numel, dtype)
            stack = getattr(self.phase, "stack", None)
            if stack:
                self._add(stack[-1], t.numel() * t.element_size())
                weakref.finalize(t, self._add, stack[-1], -t.numel() * t.element_size())
            return t

        runtime.device_empty = device_empty

    def within(self, phase: str, method):
        def wrapped(*args, **kwargs):
            self.phase.stack = getattr(self.phase, "stack", []) + [phase]
            try:
                return method(*args, **kwargs)
            finally:
                self.phase.stack = self.phase.stack[:-1]
        return wrapped

    def _add(self, phase: str, nbytes: int) -> None:
        self.live[phase] += nbytes
        self.peak[phase] = max(self.peak[phase], self.live[phase])


def adam_groups(model) -> list[dict]:
    """As the Trainer groups parameters (matrices decay), every hyperparameter spelled out (as the
    dry run builds its groups from the recipe)."""
    from _models import decay_groups

    return [dict(betas=(0.9, 0.999), eps=1e-8, **g) for g in decay_groups(model, lr=1e-3, weight_decay=0.1)]


def _measure(rank, world, accumulation, config):
    import torch

    from superoffload_hf import SuperOffloadAdamW
    from superoffload_hf.config import SuperOffloadConfig
    from superoffload_hf.plan.layout import estimate
    from _dp_train import TinyLM
    from _models import engine_config, micro_batches

    torch.manual_seed(0)
    model = TinyLM(vocab=127, hidden=33)  # odd sizes: buckets of odd numel, padded to 2 shards
    config = engine_config(speculation="on", gradient_accumulation_steps=accumulation, **config)
    groups = adam_groups(model)
    # the dry run's arithmetic, on the CPU (as the ranks run here: gloo, the CPU as the device)
    _, rows = estimate([p for g in groups for p in g["params"]], groups, SuperOffloadConfig.coerce(config),
                       accelerator=False, accumulation_steps=accumulation, shard_world=world)
    tracker = DeviceTracker()
    with SuperOffloadAdamW(groups, config=config) as opt:
        e = parts(opt)
        assert e.footprint() == rows, "the engine's own footprint differs from the dry run's"
        tracker.wrap_allocator(e.runtime)
        e.route.collect = tracker.within("grad buckets", e.route.collect)
        e.route.launch = tracker.within("reduce-scatter shard", e.route.launch)
        e.route.gather.gather_back = tracker.within("all-gather", e.route.gather.gather_back)
        for step in range(2):
            for batch in micro_batches(step * world + rank, accumulation, vocab_size=127):
                (model(**batch).loss / accumulation).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        assert opt.counters.speculative_steps > 0, opt.counters.as_dict()
        ledger = defaultdict(int)  # host and pinned bytes per kind (the device-resident buckets' are below)
        for (kind, place), nbytes in e.buckets.ledger.live.items():
            if place != "device":
                ledger[kind] += nbytes
        measured = {"device params": sum(p.numel() * p.element_size() for p in model.parameters()),
                    "device-resident buckets": e.buckets.ledger.bytes(place="device"), **tracker.peak}
    return [(r.what, r.place, r.nbytes) for r in rows], dict(ledger), measured


def _run_scenarios(rank, world, scenarios):
    return [_measure(rank, world, **kw) for kw in scenarios]


@pytest.fixture(scope="module")
def two_ranks():
    results = run_ranks(_run_scenarios, 2, list(SCENARIOS.values()), deadline_s=200)
    return dict(zip(SCENARIOS, zip(*results)))  # name -> (rank 0's, rank 1's)


@pytest.mark.parametrize("name", SCENARIOS)
def test_two_rank_allocation_matches_the_dry_run_estimate_per_kind(two_ranks, name):
    for rank, (rows, ledger, measured) in enumerate(two_ranks[name]):
        estimated_kinds = set()
        for what, place, nbytes in rows:
            if place != "device":  # a host arena or the snapshot: the Ledger, the same arithmetic
                kind = LEDGER_KIND.get(what, what)
                estimated_kinds.add(kind)
                assert ledger.get(kind) == nbytes, f"{name}, rank {rank}: {what} estimated {nbytes} B, Ledger {ledger}"
            else:
                got = measured.get("grad buckets" if what.startswith("grad buckets (") else what)
                assert got is not None and abs(got - nbytes) <= 0.05 * nbytes, (
                    f"{name}, rank {rank}: {what} estimated {nbytes} B, allocated {got} B at its peak "
                    f"(measured: {measured})")
        assert set(ledger) == estimated_kinds, f"{name}: Ledger kinds {sorted(ledger)}, rows {sorted(estimated_kinds)}"
        device_rows = {what for what, place, _ in rows if place == "device"}
        assert "reduce-scatter shard" in device_rows, device_rows
        assert {what.split(" (")[0] for what in device_rows} >= {"grad buckets", "all-gather"}, device_rows


def test_each_rank_holds_half_of_the_single_process_host_state():
    """The dry run's arithmetic alone (no ranks): 2 shards of a bucket hold its elements, padded."""
    from superoffload_hf.config import SuperOffloadConfig
    from superoffload_hf.plan.layout import estimate
    from _dp_train import TinyLM
    from _models import engine_config

    groups = adam_groups(TinyLM(vocab=127, hidden=33))
    params = [p for g in groups for p in g["params"]]
    config = SuperOffloadConfig.coerce(engine_config(device_buckets=0))
    plan, alone = estimate(params, groups, config, accelerator=False)
    _, rank = estimate(params, groups, config, accelerator=False, shard_world=2)
    single, sharded = ({r.what: r.nbytes for r in rows if r.place != "device"} for rows in (alone, rank))
    # one process on the CPU with fp32 reads autograd's gradients in place (no grad staging:
    # BufferPolicy.grad_on_demand); a rank stages its shard of the reduced gradient
    assert sharded.keys() - single.keys() == {"grad staging"} and "master" in single
    for what, nbytes in single.items():
        # each bucket: ceil(numel / 2) elements, in 64-element aligned slots of the arena
        assert nbytes / 2 <= sharded[what] <= nbytes / 2 + len(plan.buckets) * 64 * 4, (what, nbytes, sharded[what])
