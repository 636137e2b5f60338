"""Host memory is checked before it is allocated (engine/host_limit.py), buffers a configuration
never writes are not allocated, a re-plan holds the state plus one kind and returns the freed
page-locked blocks, and the simulated device models CUDA's pinned-host caching allocator, a host
budget, and strict pinned mode (testing/host_memory.py, sim.py)."""

from __future__ import annotations

import os
import re

import pytest
import torch
from torch import nn

from superoffload_hf import SuperOffloadAdamW
from superoffload_hf.device import SIM_ENV_VAR
from superoffload_hf.device.transfer import Transfer
from superoffload_hf.engine.state.buffers import BucketBuffers
from superoffload_hf.config import ConfigError, SuperOffloadConfig
from superoffload_hf.engine import host_limit
from superoffload_hf.engine.host_limit import HostMemoryError, cgroup_left, host_memory_left
from superoffload_hf.engine.state.arenas import Ledger
from superoffload_hf.plan.memory import BufferPolicy, replan_transient
from superoffload_hf.testing.host_memory import SimHostMemory, SimHostMemoryError, pinned_block_bytes
from superoffload_hf.testing.sim import SimRaceError, SimRuntime

from _models import engine_config, one_torch_thread  # noqa: F401
from superoffload_hf.testing.engine_parts import parts

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(240)]

# cast "device" / "host" given: "auto" measures the link with a page-locked probe buffer first
SIM_CONFIG = engine_config(bucket_size_mb=0.05, device_buckets=0, device_dtype="bf16", cast="device")


@pytest.fixture
def sim(monkeypatch):
    SimRuntime.reset_shared()
    monkeypatch.setenv(SIM_ENV_VAR, "1")
    runtime = SimRuntime.shared()
    yield runtime
    errors = list(runtime.errors)
    SimRuntime.reset_shared()
    assert not errors, errors


def mlp(width: int = 128, depth: int = 4, tied: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    if tied:
        model[-1].weight = model[0].weight  # one parameter used twice: its bucket is re-opened
    return model.to(torch.bfloat16)


def train(model: nn.Module, opt, steps: int, after_first=None, backwards: int = 1) -> None:
    generator = torch.Generator().manual_seed(0)
    width = model[0].in_features
    for step in range(steps):
        for _ in range(backwards):  # more than one: a second gradient re-opens launched buckets
            x = torch.randn(4, width, generator=generator).to(torch.bfloat16)
            model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 0 and after_first is not None:
            after_first()


def replan_to(opt, device_buckets: int) -> None:
    """Re-plan with `device_buckets` device-resident buckets: the host arenas change size, so no
    freed block fits a new one and each kind really moves (the learned plan of these models is
    their initial one: the re-plan after step 1 is a no-op)."""
    engine = parts(opt)
    plan = engine.layout.plan(device_buckets)
    assert plan != engine.plan
    engine.replan(plan)


def pinned_rows(opt) -> int:
    return sum(r.nbytes for r in parts(opt).footprint() if r.place == "pinned")


# ---- the limit ---------------------------------------------------------------------------------


def test_cgroup_v2_limit_is_the_tightest_on_the_path_less_its_usage(tmp_path):
    (tmp_path / "proc").write_text("0::/a/b\n")
    for path, limit, current in (("a", "1000000", "300000"), ("a/b", "max", "200000")):
        d = tmp_path / "cg" / path
        d.mkdir(parents=True)
        (d / "memory.max").write_text(limit + "\n")
        (d / "memory.current").write_text(current + "\n")
    left, source = cgroup_left(str(tmp_path / "proc"), str(tmp_path / "cg"))
    assert left == 700_000
    assert "a/memory.max" in source


def test_cgroup_v1_limit_is_read_and_its_no_limit_value_ignored(tmp_path):
    (tmp_path / "proc").write_text("5:cpu,cpuacct:/x\n4:memory:/job\n")
    d = tmp_path / "cg" / "memory" / "job"
    d.mkdir(parents=True)
    (d / "memory.limit_in_bytes").write_text("5000\n")
    (d / "memory.usage_in_bytes").write_text("1000\n")
    (tmp_path / "cg" / "memory" / "memory.limit_in_bytes").write_text(str(2**63 - 4096))
    assert cgroup_left(str(tmp_path / "proc"), str(tmp_path / "cg"))[0] == 4000
    (tmp_path / "none").write_text("0::/\n")
    assert cgroup_left(str(tmp_path / "none"), str(tmp_path / "nothing")) is None


GIB = 2**30


@pytest.fixture
def vm_host(tmp_path, monkeypatch):
    """A VM whose memory grows as it is used (the GPU machine): MemTotal 128 GiB, MemAvailable
    only 2 GiB, no cgroup limit, two processes resident (1 GiB and 3 GiB), heuristic overcommit."""
    page = os.sysconf("SC_PAGE_SIZE")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {128 * GIB // 1024} kB\nMemFree:        {GIB // 1024} kB\n"
                       f"MemAvailable:   {2 * GIB // 1024} kB\nCommitLimit:    {64 * GIB // 1024} kB\n"
                       f"Committed_AS:   {63 * GIB // 1024} kB\n")
    for pid, resident in (("1", GIB), ("42", 3 * GIB)):
        (tmp_path / "proc" / pid).mkdir(parents=True)
        (tmp_path / "proc" / pid / "statm").write_text(f"9999999 {resident // page} 0 0 0 0 0\n")
    (tmp_path / "proc" / "self").mkdir()  # not a pid: not counted twice
    (tmp_path / "cgroup").write_text("0::/\n")
    (tmp_path / "overcommit").write_text("0\n")
    for name, value in (("MEMINFO", meminfo), ("PROC", tmp_path / "proc"), ("PROC_SELF_CGROUP", tmp_path / "cgroup"),
                        ("CGROUP_ROOT", tmp_path / "no-cgroup-fs"), ("OVERCOMMIT", tmp_path / "overcommit")):
        monkeypatch.setattr(host_limit, name, str(value))
    return tmp_path


def test_on_a_vm_that_grows_its_memory_memavailable_does_not_bind_memtotal_less_every_resident_does(vm_host):
    left, source = host_memory_left(None)
    assert left == 124 * GIB
    assert source == (f"MemTotal in {vm_host / 'meminfo'} (128.00 GiB) less the resident memory of every process "
                      "(4.00 GiB)")


def test_under_strict_overcommit_the_commit_limit_binds(vm_host):
    (vm_host / "overcommit").write_text("2\n")
    left, source = host_memory_left(None)
    assert left == GIB and source.startswith(f"CommitLimit in {vm_host / 'meminfo'} (64.00 GiB) less Committed_AS "
                                             "(63.00 GiB) under strict overcommit")


def _tiny_machine(vm_host, total_bytes):
    (vm_host / "meminfo").write_text(f"MemTotal: {total_bytes // 1024} kB\nMemAvailable: {total_bytes // 1024} kB\n")
    for pid in ("1", "42"):
        (vm_host / "proc" / pid / "statm").write_text("1 0 0 0 0 0 0\n")


@pytest.mark.usefixtures("device_mode")
def test_a_refused_preflight_names_the_figure_it_used_and_an_explicit_budget_wins(vm_host):
    _tiny_machine(vm_host, 64 * 1024)  # a machine of 64 KiB: nothing fits
    with pytest.raises(HostMemoryError) as raised:
        SuperOffloadAdamW(mlp().parameters(), lr=1e-3, config=SIM_CONFIG)
    assert (f"more, the figure used: MemTotal in {vm_host / 'meminfo'} (0.00 GiB) less the resident memory of every "
            "process (0.00 GiB). Nothing has been allocated.") in str(raised.value)
    assert "`host_memory_budget`" in str(raised.value)  # among the fixes
    # the user's budget replaces what the machine says, both ways
    resident = host_limit.own_resident()
    with SuperOffloadAdamW(mlp().parameters(), lr=1e-3, config={**SIM_CONFIG, "host_memory_budget": resident + GIB}):
        pass
    # (below what this process holds already: closing the optimizer above may return freed heap to the
    # system, so a budget a few bytes over the resident memory measured before it can fit after it)
    with pytest.raises(HostMemoryError) as raised:
        SuperOffloadAdamW(mlp().parameters(), lr=1e-3, config={**SIM_CONFIG, "host_memory_budget": resident // 2})
    assert re.search(r"more, the figure used: `host_memory_budget` \(\d+\.\d\d GiB\) less this process's resident "
                     r"memory \(\d+\.\d\d GiB\)\. Nothing", str(raised.value)), str(raised.value)


def test_the_host_memory_budget_takes_bytes_or_a_size_with_a_unit_and_refuses_anything_else():
    assert SuperOffloadConfig(host_memory_budget="100GB").host_memory_budget == 100 * 10**9
    assert SuperOffloadConfig(host_memory_budget="96 GiB").host_memory_budget == 96 * GIB
    assert SuperOffloadConfig(host_memory_budget=12345).host_memory_budget == 12345
    assert SuperOffloadConfig().host_memory_budget is None
    for bad in ("lots", "-1GB", 0, True, "12 parsecs"):
        with pytest.raises(ConfigError, match=r"`host_memory_budget` is .*expected a positive number of bytes"):
            SuperOffloadConfig(host_memory_budget=bad)


def test_a_plan_over_the_host_budget_is_refused_with_its_table_before_anything_is_allocated(sim):
    model = mlp()
    sim.host_memory.budget_bytes = 300_000  # the state at rest (~260 KB) fits; with the re-plan's transient not
    with pytest.raises(HostMemoryError) as raised:
        SuperOffloadAdamW(model.parameters(), lr=1e-3, config=SIM_CONFIG)
    message = str(raised.value)
    for expected in ("master", "exp_avg_sq", "grad staging", "total pinned", "re-planning",
                     ": the simulated device's host budget",
                     "host budget", "`device_buckets`", "`bucket_size_mb`", "`host_memory_check: false`"):
        assert expected in message, (expected, message)
    assert sim.host_memory.held == 0  # refused before any buffer was allocated


def test_the_check_counts_the_replan_transient_that_the_move_really_holds(sim):
    """The estimate's transient is what BucketSet.replan holds on top of the state: the ledger's
    peak over the re-plan after step 1 is the state at rest plus at most that."""
    model = mlp(depth=6)
    opt = SuperOffloadAdamW(model.parameters(), lr=1e-3, config=SIM_CONFIG)
    try:
        ledger = parts(opt).buckets.ledger
        train(model, opt, 1)
        ledger.reset_peak()
        rows = parts(opt).footprint()
        at_rest = ledger.bytes()
        replan_to(opt, 2)
        # (+ the new device-resident buckets' state; the arenas pad each bucket to 64 elements)
        bound = at_rest + replan_transient(rows) + ledger.bytes("device") + 5 * 4 * 64 * len(opt.plan.buckets)
        assert ledger.peak_total <= bound, (ledger.peak_total, at_rest, replan_transient(rows))
    finally:
        opt.close()


def test_budget_overrun_raises_with_the_ledgers_table(sim):
    model = mlp()
    sim.host_memory.budget_bytes = 150_000
    with pytest.raises(SimHostMemoryError) as raised:
        SuperOffloadAdamW(model.parameters(), lr=1e-3, config={**SIM_CONFIG, "host_memory_check": False})
    message = str(raised.value)
    assert "host budget of 150000 bytes" in message and "on top of what the engine holds now" in message
    assert "master" in message and "total" in message, message


def test_the_shared_simulated_device_reads_its_budget_from_the_environment(monkeypatch):
    monkeypatch.setenv("SUPEROFFLOAD_SIM_HOST_BUDGET", "2e6")
    SimRuntime.reset_shared()
    try:
        assert SimRuntime.shared().host_memory.budget_bytes == 2_000_000
    finally:
        SimRuntime.reset_shared()
    monkeypatch.setenv("SUPEROFFLOAD_SIM_HOST_BUDGET", "lots")
    with pytest.raises(ValueError, match="SUPEROFFLOAD_SIM_HOST_BUDGET='lots'; expected a number of bytes"):
        SimRuntime.shared()
    SimRuntime.reset_shared()


# ---- the pinned allocator ----------------------------------------------------------------------


def test_pinned_blocks_round_up_to_a_power_of_two_and_stay_cached_until_emptied():
    memory = SimHostMemory()
    assert [pinned_block_bytes(n) for n in (1, 2, 3, 4096, 4097)] == [1, 2, 4, 4096, 8192]
    a = memory.allocate_pinned(5000)
    assert a == 8192 and memory.pinned_reserved == 8192
    memory.free_pinned(a)
    assert memory.pinned_reserved == 8192 and memory.cached_bytes() == 8192  # not returned
    b = memory.allocate_pinned(6000)  # same block size: served from the cache
    assert b == 8192 and memory.pinned_reserved == 8192 and memory.cached_bytes() == 0
    memory.free_pinned(b)
    c = memory.allocate_pinned(9000)  # another size: a new block next to the cached one
    assert memory.pinned_reserved == 8192 + 16384 == memory.pinned_high_water
    memory.free_pinned(c)
    assert memory.empty_cache() == 8192 + 16384 and memory.pinned_reserved == 0


@pytest.mark.parametrize("cast, precision", [("device", "fp32"), ("host", "fp32"), ("device", "compact")])
def test_pinned_high_water_mark_is_held_against_the_dry_run_footprint(sim, cast, precision, monkeypatch):
    """Across construction, the re-plan after step 1 and training, the page-locked memory held
    (in use + cached) never exceeds the footprint's pinned figure; after the re-plan nothing
    stays cached, and close() returns what is freed. (The link probes' page-locked blocks, one
    at construction and one before the re-plan, are measurements, not buffers: stubbed here,
    their return is tested below.)"""
    monkeypatch.setattr(Transfer, "measure_h2d_gbps", lambda self, megabytes=64, repeats=3: 25.0)
    model = mlp(depth=6)
    compact = {"state_precision": precision} if precision != "fp32" else {}
    opt = SuperOffloadAdamW(model.parameters(), lr=1e-3, config={**SIM_CONFIG, "cast": cast, **compact})
    try:
        initial = pinned_rows(opt)
        assert sim.host_memory.pinned_reserved == initial  # the arenas' power-of-two segments, exactly
        # (construction measured the link with a page-locked probe block, returned since: the
        # figure to hold is the buffers')
        sim.host_memory.reset_high_water()
        train(model, opt, 2)
        replan_to(opt, 2)  # fewer host buckets: smaller arenas
        learned = pinned_rows(opt)
        assert learned < initial
        sim.host_budget_left()  # (the simulated device handles frees at its next call)
        assert sim.host_memory.cached_bytes() == 0 and sim.host_memory.pinned_reserved == learned
        train(model, opt, 2)
        assert sim.host_memory.pinned_high_water <= max(initial, learned), (
            sim.host_memory.pinned_high_water, initial, learned)
        assert sim.host_memory.cached_bytes() == 0
        block = sim.host_empty(1000, torch.float32, pinned=True)
        del block  # freed: cached by the host allocator
        sim.host_budget_left()  # (the simulated device handles frees at its next call)
        assert sim.host_memory.cached_bytes() == pinned_block_bytes(4000)
    finally:
        opt.close()
    assert sim.host_memory.cached_bytes() == 0  # close() returned it


def test_the_link_probes_return_their_page_locked_blocks(sim):
    model = mlp()
    opt = SuperOffloadAdamW(model.parameters(), lr=1e-3, config={**SIM_CONFIG, "cast": "auto"})
    try:
        assert sim.host_memory.cached_bytes() == 0
        assert sim.host_memory.pinned_reserved == pinned_rows(opt)
        train(model, opt, 2)  # the re-plan after step 1 measures the link (engine/learn.py)
        assert parts(opt).learned is not None
        assert sim.host_memory.pinned_high_water >= pinned_block_bytes(4 * 2**20)  # it did
        assert sim.host_memory.cached_bytes() == 0
        assert sim.host_memory.pinned_reserved == pinned_rows(opt)
    finally:
        opt.close()


# ---- buffers a configuration never writes --------------------------------------------------------


def test_cast_host_with_one_micro_batch_has_no_fp32_gradient_arena():
    policy = BufferPolicy(device_dtype=torch.bfloat16, link_dtype=torch.bfloat16, lowp_dtype=torch.bfloat16,
                          pin=True, snapshot=False, micro_batches=1)
    assert "grad" not in policy.host_kinds() and "recv" in policy.host_kinds()
    accumulating = BufferPolicy(device_dtype=torch.bfloat16, link_dtype=torch.bfloat16, lowp_dtype=torch.bfloat16,
                                pin=True, snapshot=False, micro_batches=2)
    assert "grad" in accumulating.host_kinds()


@pytest.mark.parametrize("backwards", [1, 2], ids=["one-backward", "two-backwards"])
def test_cast_host_without_the_gradient_arena_trains_bitwise_as_with_it(sim, monkeypatch, backwards):
    """Two backwards before a step (one declared micro-batch) re-open the launched buckets: each
    gets its fp32 buffer then, and the step is the same as with the arena."""
    allocated = []
    grad_buffer = BucketBuffers.grad_buffer

    def counted(bufs):
        if bufs.grad is None:
            allocated.append(bufs.numel)
        return grad_buffer(bufs)

    def run(lazy: bool) -> tuple[dict, SuperOffloadAdamW]:
        if not lazy:
            monkeypatch.setattr(BufferPolicy, "grad_lazy", property(lambda self: self.grad_on_demand))
        else:
            monkeypatch.setattr(BucketBuffers, "grad_buffer", counted)
        model = mlp()
        opt = SuperOffloadAdamW(model.parameters(), lr=1e-3, config={**SIM_CONFIG, "cast": "host"})
        try:
            assert ("grad" in parts(opt).buckets.arenas) != lazy
            train(model, opt, 4, backwards=backwards)
            opt.synchronize()
            return {k: v.detach().clone() for k, v in model.state_dict().items()}, opt
        finally:
            opt.close()
            monkeypatch.undo()

    lazy, lazy_opt = run(True)
    eager, _ = run(False)
    for name in eager:
        assert torch.equal(lazy[name], eager[name]), name
    assert bool(allocated) == (backwards == 2), allocated


# ---- strict pinned mode --------------------------------------------------------------------------


def test_strict_pinned_mode_rejects_a_non_blocking_copy_with_a_pageable_host_side():
    sim = SimRuntime()
    side = sim.new_stream()
    device = sim.device_empty(8, torch.float32)
    sim.compute.synchronize()
    pageable, pinned = sim.host_empty(8, torch.float32), sim.host_empty(8, torch.float32, pinned=True)
    with sim.on_stream(side):
        sim.record_stream(device, side)
        sim.copy_(pinned, device)
        sim.copy_(pageable, device)  # not strict: a synchronous copy, allowed
        sim.strict_pinned = True
        sim.copy_(pinned, device)
        with pytest.raises(SimRaceError, match="strict pinned mode: the device->host copy on side stream 1 has "
                                               "a pageable host side, pageable host buffer"):
            sim.copy_(pageable, device)
    sim.close()


@pytest.mark.parametrize("cast", ["device", "host"])
def test_training_after_step_one_makes_no_pageable_non_blocking_copy(sim, cast, monkeypatch):
    """Strict pinned mode on after step 1: every later copy of the engine goes through it (counted)
    and none of them has a pageable host side (strict mode would raise SimRaceError)."""
    strict_copies = []
    issue_copy = sim.copy_

    def counted_copy(dst, src):
        if sim.strict_pinned:
            strict_copies.append((dst.numel(), src.numel()))
        return issue_copy(dst, src)

    monkeypatch.setattr(sim, "copy_", counted_copy)
    model = mlp(depth=6, tied=True)
    opt = SuperOffloadAdamW(model.parameters(), lr=1e-3, config={**SIM_CONFIG, "cast": cast})
    try:
        train(model, opt, 4, after_first=lambda: setattr(sim, "strict_pinned", True))
        opt.synchronize()
        assert len(strict_copies) > 0, "no copy was checked in strict pinned mode"
        assert not sim.errors, sim.errors
    finally:
        opt.close()
        sim.strict_pinned = False


def test_ledger_counts_the_time_spent_pinning(sim):
    ledger = Ledger()
    ledger.allocate(sim, "master", "pinned", 1024, torch.float32)
    assert ledger.pin_seconds > 0


def test_a_second_gradient_round_lands_in_a_buffer_allocated_before_backward(sim, monkeypatch):
    """An fp32 link with one micro-batch has no landing arena: a second backward before step()
    lands each re-opened bucket's round in the one spare of the largest bucket, allocated with
    the arenas, instead of page-locking a buffer on the autograd thread in mid-backward."""
    model = mlp(depth=6).float()
    opt = SuperOffloadAdamW(model.parameters(), lr=1e-3, config={**SIM_CONFIG, "device_dtype": "fp32"})
    try:
        assert parts(opt).buckets.spare_landing is not None
        in_backward, pinned_in_backward = [False], []
        host_empty = sim.host_empty
        monkeypatch.setattr(sim, "host_empty", lambda numel, dtype, pinned=False: (
            pinned_in_backward.append(numel) if pinned and in_backward[0] else None,
            host_empty(numel, dtype, pinned))[1])
        generator = torch.Generator().manual_seed(0)
        for step in range(3):
            for _ in range(2):
                loss = model(torch.randn(4, 128, generator=generator)).pow(2).mean()
                in_backward[0] = True
                loss.backward()
                in_backward[0] = False
            opt.step()
            opt.zero_grad()
        assert pinned_in_backward == []
    finally:
        opt.close()


def test_a_replan_that_does_not_fit_is_refused_before_it_moves_anything(sim):
    model = mlp(depth=6)
    opt = SuperOffloadAdamW(model.parameters(), lr=1e-3, config={**SIM_CONFIG, "cast": "host"})
    try:
        train(model, opt, 1)
        engine = parts(opt)
        plan = engine.layout.plan(0, ready_order=list(range(len(engine.params))))  # forward order
        assert plan != engine.plan
        transient = replan_transient(engine.footprint())
        assert transient > 0  # fp32 master, moments: each larger than the bf16 landing arena freed first
        sim.host_budget_left()
        sim.host_memory.budget_bytes = sim.host_memory.held + transient // 2
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        arenas = dict(engine.buckets.arenas)
        with pytest.raises(HostMemoryError, match="re-planning the buckets need .* less .* GB already held"):
            engine.replan(plan)
        assert engine.buckets.arenas == arenas
        sim.host_memory.budget_bytes = None
        train(model, opt, 1)  # still trains on the old plan
        assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    finally:
        opt.close()


def test_an_8b_shaped_plan_under_cast_host_needs_no_fp32_gradient_arena_and_half_a_kind_to_replan():
    """Llama-3.1-8B's shapes (on the meta device), cast "host" as on a PCIe machine, one
    micro-batch: the host holds master + moments (12 B/param, plain) and the low-precision copy and
    landing buffer (4 B/param, page-locked), no fp32 gradient arena; the re-plan transient is one
    fp32 kind less the landing arena it frees first (2 B/param)."""
    from superoffload_hf.config import SuperOffloadConfig
    from superoffload_hf.plan.memory import host_bytes
    from superoffload_hf.plan.layout import estimate

    hidden, inter, kv, vocab, layers = 4096, 14336, 1024, 128256, 32
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
                   (inter, hidden), (inter, hidden), (hidden, inter), (hidden,), (hidden,)]
    shapes += [(hidden,), (vocab, hidden)]
    params = [torch.empty(s, device="meta", dtype=torch.bfloat16, requires_grad=True) for s in shapes]
    n = sum(p.numel() for p in params)
    assert 8.0e9 < n < 8.1e9
    config = SuperOffloadConfig.coerce({"cast": "host", "device_buckets": 0})
    _, rows = estimate(params, [{"params": params, "lr": 1e-5, "betas": (0.9, 0.95), "eps": 1e-8,
                                 "weight_decay": 0.0}], config, True, 1)
    kinds = {r.what: r for r in rows}
    assert "grad staging" not in kinds
    plain = sum(r.nbytes for r in rows if r.place == "host")
    pinned = sum(r.nbytes for r in rows if r.place == "pinned")
    assert 12 * n <= plain <= 12 * n * 1.001, plain / n
    assert 4 * n <= pinned <= 4 * n * 1.05, pinned / n  # power-of-two segments: a little rounding
    assert 2 * n * 0.95 <= replan_transient(rows) <= 2 * n * 1.05, replan_transient(rows) / n
    assert host_bytes(rows, False) == plain + pinned
