"""Activation offload (superoffload_hf/parallel/activation_offload.py): the same numbers as without
it, bitwise, on the CPU device and on the simulated device (stock AdamW and the engine, weights
stationary and flowing); a simulated device peak that no longer grows with the number of blocks;
the mutation tests of its synchronisations; "auto"; the earlier transformers' checkpoint order."""

from __future__ import annotations

import functools

import pytest
import torch

from superoffload_hf import SuperOffloadAdamW
from superoffload_hf.device import SIM_ENV_VAR
from superoffload_hf.device.cpu import CpuRuntime
from superoffload_hf.parallel.activation_offload import (
    AUTO_SHARE, SYNCS, ActivationOffload, apply_activation_offload, decide_auto, in_backward, offload_for_config)
from superoffload_hf.testing.sim import SimRaceError, SimRuntime, on_device

from _models import engine_config, micro_batches, read_params, tiny_llama  # noqa: F401

pytestmark = [pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning"),
              pytest.mark.filterwarnings("ignore:`gradient_checkpointing_kwargs` is deprecated:FutureWarning"),
              pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning"),
              pytest.mark.timeout(180)]

STEPS, LR = 3, 1e-2
INPUT_BYTES = 2 * 16 * 32 * 4  # one block's input: batch 2, sequence 16, hidden 32, fp32


def _checkpointed(num_layers: int = 4, reentrant: bool = False):
    model = tiny_llama(num_layers=num_layers)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    return model


def _train(model, opt, steps: int = STEPS, call=None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """`call`: what the batches go through (a compiled model), `model` by default."""
    losses = []
    for step in range(steps):
        (batch,) = micro_batches(step)
        loss = (model if call is None else call)(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses, {name: p.detach().clone() for name, p in read_params(model).items()}


def _stock(offload_runtime=None, num_layers: int = 4, omitted=(), steps: int = STEPS, reentrant: bool = False,
           backend=None):
    """Stock AdamW; with `offload_runtime`, the block inputs offloaded over it; with `backend`, the
    model called through torch.compile with that backend."""
    model = _checkpointed(num_layers, reentrant)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    if offload_runtime is None:
        return _train(model, opt, steps)
    with apply_activation_offload(model, offload_runtime, omitted=omitted) as offload:
        call = torch.compile(model, backend=backend) if backend is not None else None
        got = _train(model, opt, steps, call)
        assert offload.bytes_offloaded == offload.bytes_fetched == steps * (num_layers - 1) * INPUT_BYTES
    return got


def _engine(offload: bool, weights: str = "stationary"):
    model = _checkpointed()
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, model=model, max_grad_norm=1.0,
                            config=engine_config(device_buckets=0, weights=weights, speculation="on"))
    with opt:
        if not offload:
            return _train(model, opt)
        with apply_activation_offload(model) as hooks:  # the runtime of the model's device
            got = _train(model, opt)
            assert hooks.bytes_fetched == STEPS * 3 * INPUT_BYTES
        return got


def _assert_same(got, want, what: str) -> None:
    (got_losses, got_params), (want_losses, want_params) = got, want
    for step, (g, w) in enumerate(zip(got_losses, want_losses)):
        assert torch.equal(g, w), f"{what}: the loss of step {step} differs: {g} vs {w}"
    for name, value in want_params.items():
        assert torch.equal(got_params[name], value), f"{what}: {name} differs"


@pytest.fixture
def sim(monkeypatch):
    """The shared simulated device as a rank's device 1, current in the test's thread."""
    SimRuntime.reset_shared(index=1)
    monkeypatch.setenv(SIM_ENV_VAR, "1")
    with on_device(1):
        yield SimRuntime.shared()
    SimRuntime.reset_shared()


@pytest.fixture(scope="module")
def stock_expected():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(SIM_ENV_VAR, raising=False)
        return _stock()


# ---- the same numbers ----------------------------------------------------------------------------


def test_offload_on_the_cpu_device_trains_bitwise_like_no_offload_with_stock_adamw(stock_expected):
    _assert_same(_stock(CpuRuntime()), stock_expected, "CPU, stock AdamW")


def test_offload_on_the_cpu_device_trains_bitwise_like_no_offload_with_the_engine(monkeypatch):
    monkeypatch.delenv(SIM_ENV_VAR, raising=False)
    _assert_same(_engine(True), _engine(False), "CPU, the engine")


@pytest.mark.sim
@pytest.mark.parametrize("reentrant", [False, True])
def test_offload_on_the_simulated_device_trains_bitwise_like_the_cpu_without_offload(reentrant, sim, stock_expected):
    """(Reentrant checkpointing saves the block's input through the same hooks.)"""
    got = _stock(sim, reentrant=reentrant)
    assert not sim.errors, sim.errors
    _assert_same(got, stock_expected, f"simulated device, stock AdamW, reentrant {reentrant}")


@pytest.mark.sim
@pytest.mark.parametrize("weights", ["stationary", "flow"])
def test_offload_with_the_engine_on_the_simulated_device_matches_the_cpu_bitwise(weights, sim):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(SIM_ENV_VAR)
        want = _engine(False, weights)
    got = _engine(True, weights)
    assert not sim.errors, sim.errors
    _assert_same(got, want, f"simulated device, the engine, weights {weights}")


@pytest.mark.slow  # (Dynamo's tracing: seconds a case; each backend on one device)
@pytest.mark.parametrize("device, backend", [("cpu", "eager"), pytest.param("sim", "aot_eager", marks=pytest.mark.sim)])
def test_a_compiled_model_with_offload_trains_bitwise_like_the_uncompiled_one_without(device, backend, request,
                                                                                      monkeypatch):
    """torch.compile with the eager backend (Dynamo's graphs) and aot_eager (AOTAutograd's too, which
    choose what the backward saves): every block input but the last still goes to the host and comes
    back (_stock counts them), and the numbers do not change."""
    from torch._dynamo.utils import counters

    if device == "sim":
        runtime = request.getfixturevalue("sim")
    else:
        monkeypatch.delenv(SIM_ENV_VAR, raising=False)
        runtime = CpuRuntime()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(SIM_ENV_VAR, raising=False)
        want = _stock(num_layers=2, steps=2)
    torch._dynamo.reset()
    counters.clear()
    try:
        got = _stock(runtime, num_layers=2, steps=2, backend=backend)
        assert counters["stats"]["unique_graphs"] > 0  # Dynamo compiled graphs: the model did not just run eagerly
    finally:
        torch._dynamo.reset()
    assert not getattr(runtime, "errors", []), runtime.errors
    _assert_same(got, want, f"{device}, torch.compile backend {backend}")


@pytest.mark.sim
def test_the_offload_never_blocks_the_host(sim):
    model = _checkpointed()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with apply_activation_offload(model, sim):
        _train(model, opt, steps=1)
        before = sim.blocking_waits()
        _train(model, opt, steps=2)  # (no parameter is adopted: backward runs on this thread)
        assert sim.blocking_waits() == before


# ---- device memory -------------------------------------------------------------------------------


def _sim_peak(num_layers: int, offload: bool) -> int:
    """The simulated device's peak over two steps, every block input booked as device memory (the
    simulator does not see activations otherwise) from its block's forward on."""
    sim = SimRuntime()
    model = _checkpointed(num_layers)
    for block in model.model.layers:
        block.register_forward_pre_hook(
            lambda module, args: sim.adopt_activation(args[0]) if torch.is_grad_enabled() and not in_backward() else None)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    if offload:
        apply_activation_offload(model, sim)
    _train(model, opt, steps=2)
    assert not sim.errors, sim.errors
    return sim.max_memory_allocated()


@pytest.mark.sim
def test_with_offload_the_simulated_device_peak_does_not_grow_with_the_number_of_blocks():
    without = {n: _sim_peak(n, offload=False) for n in (2, 8)}
    with_offload = {n: _sim_peak(n, offload=True) for n in (2, 8)}
    assert without[8] - without[2] == 6 * INPUT_BYTES, without  # every block keeps its input
    assert with_offload[8] - with_offload[2] <= INPUT_BYTES, with_offload
    assert with_offload[8] <= 3 * INPUT_BYTES, with_offload  # the current, the last block's, one prefetched


def test_the_pinned_pool_is_reused_across_steps():
    model = _checkpointed()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with apply_activation_offload(model, CpuRuntime()) as offload:
        _train(model, opt, steps=1)
        allocated, pinned = offload.pool.allocations, offload.pinned_bytes
        _train(model, opt, steps=3)
        assert allocated == 3 and pinned == 3 * INPUT_BYTES  # the 3 blocks before the last
        assert (offload.pool.allocations, offload.pinned_bytes) == (allocated, pinned)
        assert "activation offload on (on): 4 blocks, prefetch depth 1, 0.012 MB pinned" in offload.describe()


def _steps_at(model, opt, seqs) -> None:
    for step, seq in enumerate(seqs):
        (batch,) = micro_batches(step, seq=seq)
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()


ROUNDED_SEQ = 12  # a block input of 2 x 12 x 32 x 4 = 3072 bytes: the host allocator takes 4096


@pytest.mark.sim
def test_the_pinned_pool_counts_the_blocks_the_host_allocator_rounds_to_a_power_of_two(sim):
    """The pool's figure is the simulated host allocator's: every offloaded input's block
    rounded up to a power of two (3072 -> 4096 bytes), not the bytes requested."""
    model = _checkpointed()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    before = sim.host_memory.pinned_reserved
    with apply_activation_offload(model, sim) as offload:
        _steps_at(model, opt, [ROUNDED_SEQ] * 2)
        assert sim.host_memory.pinned_reserved - before == 3 * 4096
        assert offload.pinned_bytes == 3 * 4096 and offload.pool.allocations == 3
    assert not sim.errors, sim.errors


@pytest.mark.sim
def test_the_pinned_pool_is_sized_before_training_and_refuses_an_input_past_its_bound(sim):
    model = _checkpointed()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    before = sim.host_memory.pinned_reserved
    with apply_activation_offload(model, sim) as offload:
        assert offload.reserve(2 * ROUNDED_SEQ * 32 * 4) == 3 * 4096
        assert sim.host_memory.pinned_reserved - before == 3 * 4096  # page-locked before the first forward
        _steps_at(model, opt, [ROUNDED_SEQ, 8, ROUNDED_SEQ, 16])  # 16: 4096 bytes, as rounded
        assert offload.pool.allocations == 3 and sim.host_memory.pinned_reserved - before == 3 * 4096
        with pytest.raises(MemoryError, match=r"a block input of 5120 bytes needs a page-locked buffer of 8192 "
                                              r"bytes; with the 3 of one forward the pool would hold 24576 bytes, "
                                              r"over the 12288 bytes reserved before training"):
            _steps_at(model, opt, [20])
        assert offload.pinned_bytes == 3 * 4096 and offload.pool.allocations == 3  # the reservation intact
    assert not sim.errors, sim.errors


@pytest.mark.sim
def test_without_a_reservation_the_pool_holds_one_forward_at_the_longest_sequence_so_far(sim):
    """Before: every longer sequence added a new buffer per block and kept the smaller ones."""
    model = _checkpointed()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    before = sim.host_memory.pinned_reserved
    with apply_activation_offload(model, sim) as offload:
        _steps_at(model, opt, [8, ROUNDED_SEQ, 20, ROUNDED_SEQ, 8])
        assert offload.pinned_bytes == 3 * 8192
        assert sim.host_memory.pinned_reserved - before == 3 * 8192  # the smaller blocks went back to the system
    assert not sim.errors, sim.errors


@pytest.mark.sim
def test_a_reservation_the_host_memory_cannot_hold_is_refused_before_training_with_the_figures(monkeypatch):
    SimRuntime.reset_shared(host_budget_bytes=0)
    monkeypatch.setenv(SIM_ENV_VAR, "1")
    try:
        sim = SimRuntime.shared()
        model = _checkpointed()
        offload = apply_activation_offload(model, sim)
        with pytest.raises(MemoryError, match=r"activation offload: 3 block inputs of 3072 bytes take 12288 bytes "
                                              r"of page-locked host memory \(4096 a block.*leaves 0"):
            offload.reserve(3072)
        assert offload.pool.allocations == 0
        offload.remove()
    finally:
        SimRuntime.reset_shared()


def _tiny_host(tmp_path, monkeypatch, total_bytes: int) -> None:
    """This machine's figure (engine/host_limit.py) faked: MemTotal `total_bytes`, nothing resident, no
    cgroup limit, heuristic overcommit (as tests/plan/test_host_memory_check.py's vm_host)."""
    from superoffload_hf.engine import host_limit

    (tmp_path / "meminfo").write_text(f"MemTotal: {total_bytes // 1024} kB\nMemAvailable: {total_bytes // 1024} kB\n")
    (tmp_path / "proc").mkdir(exist_ok=True)
    (tmp_path / "cgroup").write_text("0::/\n")
    (tmp_path / "overcommit").write_text("0\n")
    for name, value in (("MEMINFO", "meminfo"), ("PROC", "proc"), ("PROC_SELF_CGROUP", "cgroup"),
                        ("CGROUP_ROOT", "no-cgroup-fs"), ("OVERCOMMIT", "overcommit")):
        monkeypatch.setattr(host_limit, name, str(tmp_path / value))


@pytest.mark.sim
def test_a_host_memory_budget_binds_the_reservation_both_ways_and_the_refusal_names_it(sim, tmp_path, monkeypatch):
    """Before: reserve() checked the machine's figure only, whatever `host_memory_budget` said."""
    from superoffload_hf.engine.host_limit import own_resident

    _tiny_host(tmp_path, monkeypatch, 1 << 40)  # the machine says 1 TiB
    resident, model = own_resident(), _checkpointed()  # (the hooks hold the model's blocks weakly)
    offload, _ = offload_for_config(model, "on", True, sim, host_budget=resident // 2)
    with pytest.raises(MemoryError, match=r"activation offload: 3 block inputs of 3072 bytes take 12288 bytes .*; "
                                          r"`host_memory_budget` \(\d+\.\d\d GiB\) less this process's resident memory "
                                          r"\(\d+\.\d\d GiB\) leaves 0\. .*or raise `host_memory_budget`\."):
        offload.reserve(3072)
    assert offload.pool.allocations == 0
    offload.remove()
    _tiny_host(tmp_path, monkeypatch, 8192)
    offload, line = offload_for_config(model, "on", True, sim, block_input_bytes=3072,
                                       host_budget=resident + 2**30)  # the machine says 8 KiB: the budget wins
    assert offload.pinned_bytes == offload.pool.limit_bytes == 3 * 4096, line
    offload.remove()
    assert not sim.errors, sim.errors


@pytest.mark.sim
def test_the_trainer_sizes_the_pinned_pool_against_the_configs_host_memory_budget(tmp_path, sim, monkeypatch):
    """Before: the Trainer's reservation was refused by the machine's figure under a budget that fits."""
    from superoffload_hf.engine.host_limit import own_resident

    _tiny_host(tmp_path, monkeypatch, 16 * 1024)  # the machine says 16 KiB: the pool's 24 KiB would not fit
    budget = own_resident() + 2**30
    on, _, _ = _trainer_run(tmp_path, "on", steps=1, host_memory_budget=budget)
    hooks = on.superoffload.activation_offload
    assert hooks.host_budget == budget
    assert hooks.pool.limit_bytes == hooks.pinned_bytes == 3 * 4 * 16 * 32 * 4
    assert not sim.errors, sim.errors


# ---- mutation tests ------------------------------------------------------------------------------


@pytest.mark.sim
@pytest.mark.parametrize("sync", [s for s in SYNCS if s != "prefetch_waits_compute"])
def test_removing_an_offload_synchronisation_is_caught_by_the_simulator(sync, sim, stock_expected):
    """(`prefetch_waits_compute` guards memory reuse, which the simulator does not model.)"""
    try:
        got = _stock(sim, omitted={sync})
    except SimRaceError:
        return
    if sim.errors:
        return
    losses, params = got
    differs = [n for n in params if not torch.equal(params[n], stock_expected[1][n])]
    assert differs, f"without {sync!r} the run still matched the CPU bitwise and the simulator raised nothing"


# ---- auto, refusals ------------------------------------------------------------------------------


def test_auto_offloads_only_past_its_share_of_the_free_memory_and_never_where_the_host_is_the_device():
    assert decide_auto(int(AUTO_SHARE * 1000) + 1, 1000, host_is_device=False).on
    assert not decide_auto(int(AUTO_SHARE * 1000), 1000, host_is_device=False).on
    off = decide_auto(10**12, 1000, host_is_device=True)
    assert not off.on and "the device is the host" in off.describe()


@pytest.mark.sim
@pytest.mark.parametrize("budget, on", [(8 * INPUT_BYTES, True), (10**9, False)])
def test_auto_decides_at_the_first_training_forward_from_the_simulated_free_memory(budget, on):
    sim = SimRuntime(device_budget_bytes=budget)
    model = _checkpointed()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with apply_activation_offload(model, sim, mode="auto") as offload:
        assert offload.decision is None
        _train(model, opt, steps=1)
        assert offload.decision.on is on, offload.decision
        assert offload.bytes_offloaded == (3 * INPUT_BYTES if on else 0)


def test_a_model_without_checkpointable_blocks_and_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"Sequential has no transformers GradientCheckpointingLayer"):
        ActivationOffload(torch.nn.Sequential(torch.nn.Linear(2, 2)), CpuRuntime())
    model = _checkpointed(1)
    with pytest.raises(ValueError, match=r"`mode` is 'always'"):
        ActivationOffload(model, CpuRuntime(), mode="always")
    with pytest.raises(ValueError, match=r"`depth` is 0"):
        ActivationOffload(model, CpuRuntime(), depth=0)
    with pytest.raises(ValueError, match=r"Unknown synchronisation\(s\) \['fence'\]"):
        ActivationOffload(model, CpuRuntime(), omitted={"fence"})


# ---- transformers that checkpoint __call__ (the pre-hook runs after the input was saved) ----------


class _OldOrderModel(torch.nn.Module):
    """A Llama whose blocks are checkpointed around `__call__`, as transformers before the
    forward-wrapping GradientCheckpointingLayer did: the checkpoint saves a block's input before
    its forward pre-hooks run (and runs them again in the recomputation)."""

    def __init__(self):
        super().__init__()
        self.llama = tiny_llama(num_layers=4)
        self.llama.train()
        self.llama.config.use_cache = False  # (the recomputation would write the cache again)
        for block in self.llama.model.layers:
            block.gradient_checkpointing = True  # what our pre-hook checks ...
            block._gradient_checkpointing_func = lambda fn, *args: fn(*args)  # ... without a second checkpoint
            block.__class__ = type("OldOrderLayer", (type(block),), {"__call__": _checkpointed_call})
        self.training = True

    def forward(self, **batch):
        return self.llama(**batch)


def _checkpointed_call(self, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint

    call = functools.partial(torch.nn.Module.__call__, self, **kwargs)
    return checkpoint(call, *args, use_reentrant=False)


@pytest.mark.sim
def test_the_earlier_checkpoint_order_offloads_the_same_inputs_with_the_same_numbers(stock_expected):
    sim = SimRuntime()
    model = _OldOrderModel()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    with apply_activation_offload(model, sim) as offload:
        losses, params = _train(model, opt)
        assert offload._saves_before_pre_hook is True and offload.bytes_fetched == STEPS * 3 * INPUT_BYTES
    assert not sim.errors, sim.errors
    _assert_same((losses, {n.removeprefix("llama."): v for n, v in params.items()}), stock_expected, "earlier order")


# ---- config and the Trainer ----------------------------------------------------------------------


def test_the_config_field_takes_auto_on_off_and_names_the_choices():
    from superoffload_hf.config import ConfigError, SuperOffloadConfig

    assert SuperOffloadConfig().activation_offload == "auto"
    assert SuperOffloadConfig(activation_offload="on").activation_offload == "on"
    with pytest.raises(ConfigError, match=r"`activation_offload` is 'yes'; valid choices are \['auto', 'on', 'off'\]"):
        SuperOffloadConfig(activation_offload="yes")


def _trainer_run(tmp_path, choice: str, gradient_checkpointing: bool = True, steps: int = 3, **superoffload):
    from superoffload_hf.integrations.trainer import Trainer, TrainingArguments

    batches = [{k: v[0] for k, v in micro_batches(i, batch=1)[0].items()} for i in range(4 * steps)]
    args = TrainingArguments(
        output_dir=str(tmp_path / choice), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
        data_seed=0, gradient_checkpointing=gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, superoffload=True,
        superoffload_config={"host_kernel": "reference", "activation_offload": choice, **superoffload})
    trainer = Trainer(model=tiny_llama(num_layers=4), args=args, train_dataset=batches)
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    return trainer, losses, {n: p.detach().clone() for n, p in read_params(trainer.model).items()}


@pytest.mark.sim
def test_the_trainer_applies_activation_offload_on_and_trains_the_same_weights(tmp_path, sim):
    on, on_losses, on_params = _trainer_run(tmp_path, "on")
    hooks = on.superoffload.activation_offload
    assert hooks is not None and hooks.bytes_fetched > 0 and hooks.pinned_bytes == 3 * 4 * 16 * 32 * 4
    assert hooks.pool.limit_bytes == hooks.pinned_bytes  # sized from the train dataset before training
    off, off_losses, off_params = _trainer_run(tmp_path, "off")
    assert off.superoffload.activation_offload is None
    assert not sim.errors, sim.errors
    assert on_losses == off_losses
    for name, value in off_params.items():
        assert torch.equal(on_params[name], value), name


def test_the_trainer_on_the_cpu_device_states_that_on_is_a_no_op(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(SIM_ENV_VAR, raising=False)
    with caplog.at_level("INFO", logger="superoffload_hf.integrations.trainer"):
        trainer, _, _ = _trainer_run(tmp_path, "on", steps=1)
    assert trainer.superoffload.activation_offload is None
    assert "activation offload on: not applied, the device is the host" in caplog.text


@pytest.mark.sim
def test_on_without_gradient_checkpointing_is_refused_naming_the_fix(tmp_path, sim):
    with pytest.raises(ValueError, match=r"`activation_offload` is \"on\" but gradient checkpointing is off.*"
                                         r"`gradient_checkpointing=True`"):
        _trainer_run(tmp_path, "on", gradient_checkpointing=False, steps=1)


def test_the_dry_run_line_states_the_inputs_the_pinned_bytes_and_the_decision():
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from superoffload_hf.parallel.activation_offload import dry_run_line

    llama8b = LlamaConfig(num_hidden_layers=32, hidden_size=4096)  # (only the shape is read)
    recipe = SimpleNamespace(training={"per_device_train_batch_size": 1, "gradient_checkpointing": True},
                             data=SimpleNamespace(seq_len=512 * 1024))
    line = dry_run_line(recipe, llama8b, "auto", 2, device_is_host=False)
    assert line == ("  activation offload auto; checkpointed block inputs 137.439 GB on the device (32 x 4.295 GB at "
                    "524288 tokens a micro-batch), offloaded 133.144 GB, 133.144 GB pinned host (each block rounded up "
                    "to a power of two by the host allocator) - auto: on if the device has less "
                    "than 549.756 GB free at the first training forward (they would take over 25% of it)")
    recipe.data.seq_len = 300 * 1024  # 2.517 GB a block: 4.295 GB page-locked
    assert ("offloaded 78.014 GB, 133.144 GB pinned host" in dry_run_line(recipe, llama8b, "on", 2, device_is_host=False))
    assert dry_run_line(recipe, llama8b, "on", 2, device_is_host=True).endswith(" - not applied, the device is the host")
    from superoffload_hf.parallel.activation_offload import dry_run_pinned_bytes

    assert dry_run_pinned_bytes(recipe, llama8b, "on", 2, False) == 31 * 2**32  # what the host check adds
    assert dry_run_pinned_bytes(recipe, llama8b, "auto", 2, False, free_device_bytes=141 * 10**9) == 31 * 2**32
    assert dry_run_pinned_bytes(recipe, llama8b, "auto", 2, False, free_device_bytes=10**12) == 0  # auto: off
    assert dry_run_pinned_bytes(recipe, llama8b, "on", 2, True) == dry_run_pinned_bytes(recipe, llama8b, "off", 2, False) == 0
    recipe.training["gradient_checkpointing"] = False
    assert dry_run_pinned_bytes(recipe, llama8b, "on", 2, False) == 0
    assert dry_run_line(recipe, llama8b, "on", 2, device_is_host=False).endswith(
        " - refused: it needs `training.gradient_checkpointing: true`")


def test_the_dry_runs_host_check_counts_the_offloads_pinned_pool():
    from superoffload_hf.train.footprint import host_check_line

    without, with_pool = host_check_line([], False), host_check_line([], False, 3 * 10**9)
    assert without.startswith("  host memory checked before allocating 0.000 GB "), without
    assert with_pool.startswith("  host memory checked before allocating 3.000 GB with the re-plan after step 1 "
                                "(0.000 GB of it the re-plan's transient, 3.000 GB activation offload's pinned pool)")


# ---- the simulator's booked activations (SimRuntime.adopt_activation) -----------------------------


def _booked_copy(sim, wait_compute: bool):
    activation = torch.ones(256)
    sim.adopt_activation(activation)
    host = sim.host_empty(256, torch.float32, pinned=True)
    side = sim.new_stream()
    ready = sim.new_event()
    ready.record(sim.compute)
    with sim.on_stream(side):
        if wait_compute:
            side.wait_event(ready)
        sim.copy_(host, activation)
        copied = sim.new_event()
        copied.record(side)
    return activation, host, copied


def test_a_booked_activation_counts_as_device_memory_until_its_object_goes():
    sim = SimRuntime()
    activation = torch.ones(256)
    sim.adopt_activation(activation)
    sim.adopt_activation(activation)  # (once)
    assert sim.memory_allocated() == 1024
    del activation
    assert sim.memory_allocated() == 0 and sim.max_memory_allocated() == 1024


def test_a_booked_activation_freed_after_the_compute_stream_waited_for_its_copy_needs_no_record_stream():
    sim = SimRuntime()
    activation, host, copied = _booked_copy(sim, wait_compute=True)
    sim.compute.wait_event(copied)
    del activation
    assert sim.memory_allocated() == 0 and torch.equal(host, torch.ones(256)) and not sim.errors


def test_a_booked_activation_freed_while_its_copy_has_not_run_is_reported():
    sim = SimRuntime()
    activation, host, copied = _booked_copy(sim, wait_compute=True)
    del activation
    with pytest.raises(SimRaceError, match=r"activation \(device\) \(256,\) float32 freed while side stream 1 still"):
        sim.memory_allocated()


def test_a_side_stream_reading_a_booked_activation_before_waiting_for_the_compute_stream_is_reported():
    sim = SimRuntime()
    with pytest.raises(SimRaceError, match=r"reads device tensor \(256,\) float32 written on the compute stream"):
        _booked_copy(sim, wait_compute=False)


def test_a_dropped_model_frees_its_offload_hooks_without_the_cyclic_collector():
    import gc
    import weakref

    model = _checkpointed(2)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    hooks = weakref.ref(apply_activation_offload(model, CpuRuntime()))
    _train(model, opt, steps=1)
    gc.disable()
    try:
        del model, opt
        assert hooks() is None, gc.get_referrers(hooks())
    finally:
        gc.enable()


@pytest.mark.sim
def test_a_retained_graph_backward_twice_fetches_the_inputs_again_with_the_same_gradients():
    def grads(runtime):
        model = _checkpointed()
        hooks = apply_activation_offload(model, runtime) if runtime is not None else None
        loss = model(**micro_batches(0)[0]).loss
        loss.backward(retain_graph=True)
        loss.backward()
        if hooks is not None:
            assert hooks.bytes_fetched == 2 * 3 * INPUT_BYTES
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    sim = SimRuntime()
    want, got = grads(None), grads(sim)
    assert not sim.errors, sim.errors
    for name, value in want.items():
        assert torch.equal(got[name], value), name
