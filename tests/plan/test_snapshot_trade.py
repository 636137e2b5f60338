"""`speculation: auto` with compact state trades the rollback snapshot (plan/snapshot_trade.py):
fewer speculated buckets where host memory lacks room for their snapshots, none where copying
them takes longer than the backward they overlap; the engine follows the decision."""

from __future__ import annotations

import pytest
import torch

from superoffload_hf.plan.memory import BufferPolicy, footprint
from superoffload_hf.plan.buckets import BucketPlan
from superoffload_hf.plan.snapshot_trade import bucket_snapshot_bytes, snapshot_trade
from superoffload_hf.testing.engine_parts import parts

BF16 = torch.bfloat16


def policy(precision: str = "compact", speculate: bool = True) -> BufferPolicy:
    return BufferPolicy(device_dtype=BF16, link_dtype=BF16, lowp_dtype=None, pin=False,
                        snapshot=precision != "fp32" and speculate, micro_batches=1, state_precision=precision)


def plan() -> BucketPlan:
    shapes = [(64, 64)] * 6
    return BucketPlan.build(shapes, [list(range(6))], bucket_numel=2 * 64 * 64, device_buckets=1, align=32)


def test_snapshots_of_a_host_bucket_are_its_compact_bytes():
    sizes = bucket_snapshot_bytes(plan(), policy())
    assert sizes == [2 * 4096 * (2 + 1 + 1 + 1) + 2 * 2 * (2 * 4096 // 32)] * 2  # two host buckets of 8192
    rows = {r.what: r.nbytes for r in footprint(plan(), policy())}
    assert rows["snapshot"] == sum(sizes)


def test_auto_speculates_the_first_buckets_whose_snapshots_fit_the_memory_left():
    p, pol = plan(), policy()
    (first, second) = bucket_snapshot_bytes(p, pol)
    host = [b.index for b in p.buckets if not b.device_resident]
    everything = snapshot_trade(p, pol, "auto", memory_left=10**9, other_bytes=1000)
    assert everything.speculated_buckets == 2 and everything.allowed == frozenset(host)
    one = snapshot_trade(p, pol, "auto", memory_left=1000 + first + second - 1, other_bytes=1000)
    assert one.speculated_buckets == 1 and one.allowed == {host[0]} and one.snapshot_bytes == first
    assert "host memory" in one.reason and one.allows(host[0]) and not one.allows(host[1])
    none = snapshot_trade(p, pol, "auto", memory_left=1000 + first - 1, other_bytes=1000)
    assert none.speculated_buckets == 0 and none.allowed == frozenset()
    rows = {r.what: r.nbytes for r in footprint(p, pol, one.snapshot_buckets)}
    assert rows["snapshot"] == first  # the engine's check and table count the kept snapshots only
    assert "snapshot" not in {r.what for r in footprint(p, pol, none.snapshot_buckets)}


def test_auto_does_not_speculate_where_copying_the_snapshots_outlasts_the_backward():
    p, pol = plan(), policy()
    total = sum(bucket_snapshot_bytes(p, pol))
    slow = snapshot_trade(p, pol, "auto", host_bytes_per_second=2 * total / 0.010, backward_seconds=0.005)
    assert slow.speculated_buckets == 0 and slow.copy_seconds_per_step == pytest.approx(0.010)
    assert "no less than the 5.0 ms backward" in slow.reason
    fast = snapshot_trade(p, pol, "auto", host_bytes_per_second=2 * total / 0.010, backward_seconds=0.050)
    assert fast.speculated_buckets == 2 and fast.copy_bytes_per_step == 2 * total
    assert "copied per speculative step, 10.0 ms per step against a 50.0 ms backward" in fast.describe(6 * 4096)


def test_auto_keeps_no_snapshot_on_the_cpu_device_where_it_never_speculates():
    trade = snapshot_trade(plan(), policy(), "auto", memory_left=10**9, overlaps=False)
    assert trade.applies and trade.speculated_buckets == 0 and "the CPU" in trade.reason
    assert "snapshot" not in {r.what for r in footprint(plan(), policy(), trade.snapshot_buckets)}


@pytest.mark.parametrize("precision, mode, count", [("compact", "on", 2), ("compact", "off", 0), ("fp32", "auto", 0)])
def test_other_modes_and_fp32_state_are_the_users_decision(precision, mode, count):
    trade = snapshot_trade(plan(), policy(precision, speculate=mode != "off"), mode, memory_left=0)
    assert not trade.applies and trade.snapshot_buckets is None and trade.speculated_buckets == count


def test_the_engine_speculates_only_the_buckets_whose_snapshot_fits(monkeypatch):
    """On the simulated device (it overlaps: auto speculates) with a host budget that leaves room
    for one bucket's snapshot: that bucket speculates, the other never does, and the Ledger holds
    one snapshot, as the footprint says."""
    from superoffload_hf import SuperOffloadAdamW
    from superoffload_hf.engine import host_limit as trade_module

    monkeypatch.setenv("SUPEROFFLOAD_SIM_DEVICE", "1")
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(4)])
    config = {"device_dtype": "bf16", "state_precision": "compact", "host_threads": 1, "cast": "host",
              "speculation": "auto", "bucket_size_mb": 0.016, "device_buckets": 0}
    decided = []
    real = trade_module.snapshot_trade

    def with_room_for_one(p, pol, mode, **kw):
        sizes = bucket_snapshot_bytes(p, pol)
        # one bucket's snapshot fits; the tiny model's backward is too short for the time rule
        kw.update(memory_left=sizes[0] + 1, other_bytes=0, host_bytes_per_second=None, backward_seconds=None)
        decided.append(real(p, pol, mode, **kw))
        return decided[-1]

    monkeypatch.setattr(trade_module, "snapshot_trade", with_room_for_one)
    opt = SuperOffloadAdamW(model.parameters(), lr=1e-3, config=config)
    try:
        assert parts(opt).runtime.name.startswith("sim")
        for _ in range(4):
            model(torch.randn(4, 64).to(BF16)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        trade = parts(opt).trade
        assert trade.host_buckets >= 2 and trade.speculated_buckets == 1, trade
        assert opt.counters.speculative_steps > 0
        ledger = parts(opt).buckets.ledger
        rows = {r.what: r.nbytes for r in parts(opt).footprint()}
        assert ledger.bytes(kind="snapshot") == rows["snapshot"] == trade.snapshot_bytes
        assert f"speculates 1 of {trade.host_buckets} host buckets" in opt.describe()
    finally:
        opt.close()
