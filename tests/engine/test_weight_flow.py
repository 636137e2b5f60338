"""Weight-flow (engine/flow.py, config `weights`): units, the same numbers as stationary, training
within a device budget a quarter of the weights, the refusal of stationary there, and the
mutation tests of flow's synchronisations (device/transfer.py FLOW_SYNCS)."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from superoffload_hf import SuperOffloadAdamW
from superoffload_hf.config import ConfigError, SuperOffloadConfig
from superoffload_hf.device import SIM_ENV_VAR
from superoffload_hf.plan.flow import find_units, plan_flow
from superoffload_hf.testing.sim import SimRaceError, SimRuntime, on_device

from _models import (  # noqa: F401  (one_torch_thread is a fixture)
    GradPoison, assert_close_fast, engine_config, micro_batches, one_torch_thread, read_params, tiny_batch, tiny_llama)
from superoffload_hf.testing.engine_parts import parts

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(180)]

LR = 1e-2


# ---- units and config --------------------------------------------------------------------------


def test_units_are_the_decoder_blocks_then_each_other_module_owning_parameters_tied_ones_merged():
    model = tiny_llama(num_layers=3)
    assert [name for name, _ in find_units(model)] == [
        "model.layers.0", "model.layers.1", "model.layers.2", "model.embed_tokens", "model.norm", "lm_head"]
    tied = tiny_llama(num_layers=2, tie_word_embeddings=True)
    names = [name for name, _ in find_units(tied)]
    assert names == ["model.layers.0", "model.layers.1", "model.embed_tokens+lm_head", "model.norm"]
    params = list(tied.parameters())
    plan = plan_flow(tied, params)
    assert sorted(i for u in plan.units for i in u.params) == list(range(len(params)))  # each once
    assert plan.nbytes == sum(p.numel() * 4 for p in params)
    tied.model.norm.weight.requires_grad_(False)  # a frozen unit stays on the device
    plan = plan_flow(tied, [p for p in tied.parameters() if p.requires_grad])
    assert [u.name for u in plan.units] == names[:3] and plan.stationary[0].startswith("model.norm")


def test_the_weights_field_takes_its_three_values_and_refuses_what_flow_does_not_do():
    assert SuperOffloadConfig().weights == "stationary"
    assert SuperOffloadConfig(weights="auto").weights == "auto"
    with pytest.raises(ConfigError, match=r"`weights` is 'moving'.*'stationary', 'flow', 'auto'"):
        SuperOffloadConfig(weights="moving")
    assert SuperOffloadConfig(weights="flow", state_precision="compact", device_dtype="bf16").weights == "flow"
    with pytest.raises(ConfigError, match=r"`weights: flow` with `device_buckets: 1`.*`device_buckets: 0`"):
        SuperOffloadConfig(weights="flow", device_buckets=1)
    with pytest.raises(ConfigError, match=r"`device_dtype: fp16`"):
        SuperOffloadConfig(weights="flow", device_dtype="fp16")


def test_flow_without_the_model_is_refused_naming_the_argument():
    model = tiny_llama(num_layers=1)
    with pytest.raises(ValueError, match=r"Pass `model=model`"):
        SuperOffloadAdamW(model.parameters(), config=engine_config(device_buckets=0, weights="flow"))


# ---- the same numbers --------------------------------------------------------------------------


def _train(weights: str, steps: int, dtype: str = "fp32", state: str = "fp32", **model_kwargs) -> dict[str, torch.Tensor]:
    """Speculation and clipping on (step 2 clipped: rolled back and replayed); an inf gradient at step 1 (the speculative steps rolled back,
    the step skipped) and an evaluation forward between backward and step() at step 2 (under flow
    it fetches units whose buckets were stepped speculatively: rolled back first)."""
    model = tiny_llama(**model_kwargs)
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, model=model, max_grad_norm=1.7,  # the norms: 1.66-1.78
                            config=engine_config(device_buckets=0, weights=weights, device_dtype=dtype,
                                                 state_precision=state, speculation="on"))
    poison = GradPoison(model.model.embed_tokens.weight, {1: math.inf})  # last in backward: the rest speculated
    with opt:
        for step in range(steps):
            (batch,) = micro_batches(step)
            poison.step = step
            model(**batch).loss.backward()
            if step == 2:
                with torch.no_grad():
                    model(**batch)
            opt.step()
            assert opt.last_step_skipped == (step == 1), step
            opt.zero_grad()
        assert opt.counters.rollbacks > 0 and opt.counters.replays > 0, opt.counters.as_dict()
        return {name: p.detach().clone() for name, p in read_params(model).items()}


@pytest.mark.usefixtures("device_mode")
@pytest.mark.parametrize("dtype, state", [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "compact")])
def test_flow_trains_to_the_bitwise_same_weights_as_stationary(dtype, state):
    """bf16: the host's low-precision copy (cast host) flows; compact: the bf16 part of the
    master, which the snapshot restore of a rolled-back bucket puts back with the rest."""
    want = _train("stationary", 4, dtype, state, num_layers=2)
    got = _train("flow", 4, dtype, state, num_layers=2)
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{dtype}/{state}: {name} differs under weight-flow"


class _LoRALinear(torch.nn.Module):
    """A hand-made LoRA adapter (no peft here): the frozen base linear plus B @ A, B starting at zero."""

    def __init__(self, base: torch.nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = torch.nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.lora_b = torch.nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x):
        return self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()


def _adapted(variant: str) -> torch.nn.Module:
    model = tiny_llama(num_layers=2)
    if variant == "frozen":  # a frozen block, a block with a frozen norm: both stay on the device
        model.model.layers[0].requires_grad_(False)
        model.model.layers[1].input_layernorm.weight.requires_grad_(False)
    else:  # adapters in every block's attention, base weights frozen: the blocks stay, the rest flows
        torch.manual_seed(3)
        for layer in model.model.layers:
            layer.self_attn.q_proj = _LoRALinear(layer.self_attn.q_proj)
            layer.self_attn.v_proj = _LoRALinear(layer.self_attn.v_proj)
            for name, p in layer.named_parameters():
                p.requires_grad_("lora_" in name)
    return model


def _train_adapted(variant: str, weights: str) -> tuple[dict, str]:
    model = _adapted(variant)
    opt = SuperOffloadAdamW([p for p in model.parameters() if p.requires_grad], lr=LR, model=model, max_grad_norm=1.7,
                            config=engine_config(device_buckets=0, weights=weights, speculation="on"))
    with opt:
        for step in range(3):
            (batch,) = micro_batches(step)
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
        return {name: p.detach().clone() for name, p in read_params(model).items()}, opt.describe()


@pytest.mark.usefixtures("device_mode")
@pytest.mark.parametrize("variant, flowing", [("frozen", 3), ("lora", 3)])
def test_frozen_parameters_and_adapters_train_under_flow_to_the_bitwise_same_weights(variant, flowing):
    """A unit with a parameter the optimizer does not train stays on the device (its weights have no
    host copy the host Adam writes); the others flow."""
    want, _ = _train_adapted(variant, "stationary")
    got, summary = _train_adapted(variant, "flow")
    assert f"weights flow: {flowing} units, 2 stationary" in summary, summary
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{variant}: {name} differs under weight-flow"
    assert not torch.equal(want["model.embed_tokens.weight"], _adapted(variant).model.embed_tokens.weight)  # trained


# ---- a device budget of a quarter of the weights -----------------------------------------------

BUDGET_LAYERS, BUDGET_VOCAB = 16, 64  # many small blocks: two of them are 1/8 of the weights


@pytest.fixture
def quarter_budget_sim(monkeypatch):
    """The shared simulated device (a rank's device 1) with a memory of a quarter of the weights."""
    weight_bytes = sum(p.numel() * 4 for p in tiny_llama(BUDGET_LAYERS, vocab_size=BUDGET_VOCAB).parameters())
    SimRuntime.reset_shared(index=1, device_budget_bytes=weight_bytes // 4)
    monkeypatch.setenv(SIM_ENV_VAR, "1")
    with on_device(1):
        yield SimRuntime.shared(), weight_bytes
    errors = list(SimRuntime.shared().errors)
    SimRuntime.reset_shared()
    assert not errors, errors


def _budget_config(weights: str) -> dict:
    return engine_config(device_buckets=0, bucket_size_mb=0.01, weights=weights, speculation="on")


@pytest.mark.parametrize("weights", ["flow", "auto"])
def test_flow_trains_within_a_quarter_of_the_weights_and_matches_torch_adamw_every_step(weights, quarter_budget_sim):
    sim, weight_bytes = quarter_budget_sim
    model = tiny_llama(BUDGET_LAYERS, vocab_size=BUDGET_VOCAB)
    ref = tiny_llama(BUDGET_LAYERS, vocab_size=BUDGET_VOCAB)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=1e-2, foreach=False)
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, weight_decay=1e-2, model=model, config=_budget_config(weights))
    names = [name for name, _ in model.named_parameters()]
    with opt:
        # "auto" flows the fewest units that fit (plan/flow.py; tests/plan/test_flow_choice.py)
        units = 19 if weights == "flow" else sum(parts(opt).layout.flow_choice.flowing)
        assert f"weights flow: {units} units" in opt.describe() and 0 < units <= 19
        for step in range(3):
            batch = tiny_batch(vocab_size=BUDGET_VOCAB, seed=step)
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
            ref(**batch).loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            state = opt.state_dict()["state"]  # the fp32 masters
            # atol 1e-5 (a thousandth of a step): one element of layers.4.mlp.up_proj (its two gradients
            # nearly cancel in m / sqrt(v)) is 3.7e-6 off torch from step 1 under stationary on the CPU too
            for i, (name, p) in enumerate(zip(names, ref.parameters())):
                assert_close_fast(state[i]["master_param"], p.detach(), 1e-5, 1e-5,
                                  lambda m, name=name: f"step {step}: {name}: {m}")
        peak = opt.device_memory_peak()
        assert peak <= weight_bytes // 4 and parts(opt).flow.fetches >= 3 * 2 * units, (peak, weight_bytes)
        assert (opt.counters.weight_fetches, opt.counters.bytes_fetched) == (
            parts(opt).flow.fetches, parts(opt).flow.bytes_fetched)  # (the train summary's line)
        assert peak >= 2 * sum(p.numel() * 4 for p in model.model.layers[0].parameters())  # a block and the next
        masters = [state[i]["master_param"].clone() for i in range(len(names))]
    for p, master in zip(model.parameters(), masters):  # closed: too big for the device, left on the host
        assert torch.equal(p.detach(), master)


def _compact_states(weights: str, steps: int) -> list[dict]:
    """Every parameter's compact state bytes after every step: step 0 clipped (the buckets stepped
    speculatively before the norm passed 2.0 rolled back and replayed), step 1 skipped (an inf
    gradient in the embedding, the last unit of backward: every other bucket rolled back)."""
    model = tiny_llama(BUDGET_LAYERS, vocab_size=BUDGET_VOCAB)
    config = {**_budget_config(weights), "device_dtype": "bf16", "state_precision": "compact"}
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, weight_decay=1e-2, model=model, max_grad_norm=2.0,
                            config=config)
    poison = GradPoison(model.model.embed_tokens.weight, {1: math.inf})  # last in backward: the rest speculated
    states = []
    with opt:
        for step in range(steps):
            poison.step = step
            model(**tiny_batch(vocab_size=BUDGET_VOCAB, seed=step)).loss.backward()
            opt.step()
            assert opt.last_step_skipped == (step == 1), step
            opt.zero_grad()
            states.append({i: {k: v.clone() for k, v in entry.items() if isinstance(v, torch.Tensor)}
                           for i, entry in opt.state_dict()["state"].items()})
        assert opt.counters.rollbacks > 0, opt.counters.as_dict()
        peak = opt.device_memory_peak()
    return states, peak


def test_flow_with_compact_state_within_a_quarter_of_the_weights_equals_stationary_on_the_cpu_bitwise(
        quarter_budget_sim):
    """What flows is the bf16 part of the compact master: the same bytes as stationary's, every step."""
    _, fp32_weight_bytes = quarter_budget_sim
    budget = fp32_weight_bytes // 2 // 4  # a quarter of the bf16 weights
    SimRuntime.reset_shared(index=1, device_budget_bytes=budget)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(SIM_ENV_VAR)
        want, _ = _compact_states("stationary", 3)
    got, peak = _compact_states("flow", 3)
    assert 0 < peak <= budget, (peak, budget)
    for step, (w, g) in enumerate(zip(want, got)):
        assert w.keys() == g.keys()
        for i in w:
            for kind, value in w[i].items():
                assert value.dtype == g[i][kind].dtype and torch.equal(g[i][kind], value), (step, i, kind)


def test_stationary_that_does_not_fit_is_refused_before_training_naming_weights_flow(quarter_budget_sim):
    sim, weight_bytes = quarter_budget_sim
    model = tiny_llama(BUDGET_LAYERS, vocab_size=BUDGET_VOCAB)
    with pytest.raises(torch.OutOfMemoryError, match=r"`weights: stationary` keeps \d+ bytes.*Set `weights: flow`"):
        SuperOffloadAdamW(model.parameters(), lr=LR, model=model, config=_budget_config("stationary"))
    assert sim.max_memory_allocated() == 0  # refused before anything reached the device


# ---- mutation tests of flow's synchronisations ------------------------------------------------


def _run_flow(omitted=()) -> dict[str, torch.Tensor]:
    model = tiny_llama(num_layers=2)
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, model=model, max_grad_norm=1.0,
                            config=engine_config(device_buckets=0, weights="flow", speculation="on"))
    parts(opt).transfer.omitted = frozenset(omitted)
    with opt:
        for step in range(3):
            (batch,) = micro_batches(step)
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
        return {name: p.detach().clone() for name, p in read_params(model).items()}


@pytest.fixture
def sim(monkeypatch):
    SimRuntime.reset_shared(index=1)
    monkeypatch.setenv(SIM_ENV_VAR, "1")
    with on_device(1):
        yield SimRuntime.shared()
    SimRuntime.reset_shared()


@pytest.mark.sim
@pytest.mark.parametrize("sync", ["device_waits_fetch", "fetch_waits_release"])
def test_removing_a_flow_synchronisation_is_caught_by_the_simulator(sync, sim):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(SIM_ENV_VAR)
        expected = _run_flow()
    try:
        got = _run_flow(omitted={sync})
    except (SimRaceError, RuntimeError) as error:
        assert isinstance(error, SimRaceError) or isinstance(error.__cause__, SimRaceError) or sim.errors, error
        return
    assert sim.errors or any(not torch.equal(got[n], expected[n]) for n in expected), (
        f"without {sync!r} the flow run still matched the CPU run bitwise and the simulator raised nothing")


@pytest.mark.sim
def test_the_full_flow_seam_on_the_simulated_device_matches_the_cpu_device_bitwise(sim):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(SIM_ENV_VAR)
        expected = _run_flow()
    got = _run_flow()
    assert not sim.errors, sim.errors
    assert all(torch.equal(got[n], expected[n]) for n in expected)


# ---- checkpoints ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("device_mode")
def test_a_flow_run_saved_and_resumed_continues_bitwise_like_the_uninterrupted_one(tmp_path):
    """load_state_dict writes the host masters; the units still on the device are released and
    fetched again from the loaded state at their next use."""
    def make():
        model = tiny_llama(num_layers=2)
        opt = SuperOffloadAdamW(model.parameters(), lr=LR, model=model, max_grad_norm=1.0,
                                config=engine_config(device_buckets=0, weights="flow", speculation="on"))
        return model, opt

    def steps(model, opt, which):
        for step in which:
            (batch,) = micro_batches(step)
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()

    model, opt = make()
    with opt:
        steps(model, opt, range(4))
        want = {name: p.detach().clone() for name, p in read_params(model).items()}
    model, opt = make()
    with opt:
        steps(model, opt, range(2))
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    model, opt = make()
    with opt:
        model(**micro_batches(99)[0])  # a forward first: units fetched and released with the fresh weights
        saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        steps(model, opt, range(2, 4))
        got = read_params(model)
        for name, value in want.items():
            assert torch.equal(got[name].detach(), value), f"{name} differs after the resume"


@pytest.mark.usefixtures("device_mode")
def test_after_close_the_parameters_hold_the_trained_weights_again():
    model = tiny_llama(num_layers=2)
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, model=model,
                            config=engine_config(device_buckets=0, weights="flow"))
    for step in range(2):
        (batch,) = micro_batches(step)
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    masters = [v["master_param"].clone() for _, v in sorted(opt.state_dict()["state"].items())]
    assert any(p.untyped_storage().nbytes() == 0 for p in model.parameters())  # released between uses
    opt.close()
    for p, master in zip(model.parameters(), masters):
        assert torch.equal(p.detach(), master)


@pytest.mark.sim
def test_auto_keeps_the_weights_stationary_where_they_fit(sim):
    model = tiny_llama(num_layers=1)
    with SuperOffloadAdamW(model.parameters(), model=model,
                           config=engine_config(device_buckets=0, weights="auto")) as opt:
        assert parts(opt).flow is None and "weights flow" not in opt.describe()


def test_the_timeline_shows_each_units_fetches_on_the_host_to_device_track(tmp_path):
    import json

    model = tiny_llama(num_layers=2)
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, model=model, config=engine_config(
        device_buckets=0, weights="flow", timeline_dir=str(tmp_path / "tl"), timeline_steps=[2]))
    with opt:
        for step in range(3):  # (step 3 ends step 2's window: close()'s fetches are not in it)
            (batch,) = micro_batches(step)
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
    events = json.loads((tmp_path / "tl" / "trace.json").read_text())["traceEvents"]
    tid_of = {e["args"]["name"]: e["tid"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    fetches = [e["name"] for e in events if e.get("ph") == "X" and e["tid"] == tid_of["host-to-device"]]
    # step 2: each unit fetched for its forward and again for its backward
    for unit in ("model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"):
        assert fetches.count(f"fetch {unit}") == 2, (unit, " | ".join(fetches))


# ---- saving a model larger than the device (issue 28 item 1) -------------------------------------
#
# The issue's configuration: a 12-block Llama (vocab 512, hidden 128, intermediate 344, 4 heads,
# 2 KV heads, untied), fp32, the simulated device's memory a quarter of its weights
# (SUPEROFFLOAD_SIM_DEVICE_MEMORY), buckets of 0.25 MB, clipping at 1.0. model.state_dict() holds
# host copies of the flowing weights, gathered unit by unit (nothing fetched onto the device), and
# load_state_dict writes them back into the host copies the same way.


def _issue_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=12,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, attn_implementation="eager")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config)


@pytest.fixture
def issue_budget_sim(monkeypatch):
    """The shared simulated device (device 1) with SUPEROFFLOAD_SIM_DEVICE_MEMORY a quarter of the weights."""
    from superoffload_hf.testing.device_memory import DEVICE_MEMORY_ENV_VAR

    weight_bytes = sum(p.numel() * 4 for p in _issue_llama().parameters())
    monkeypatch.setenv(DEVICE_MEMORY_ENV_VAR, str(weight_bytes // 4))
    monkeypatch.setenv(SIM_ENV_VAR, "1")
    SimRuntime.reset_shared(index=1)
    with on_device(1):
        assert SimRuntime.shared().device_memory.total == weight_bytes // 4
        yield SimRuntime.shared(), weight_bytes
    errors = list(SimRuntime.shared().errors)
    SimRuntime.reset_shared()
    assert not errors, errors


def _issue_optimizer(model, weights: str):
    return SuperOffloadAdamW(model.parameters(), lr=LR, model=model, max_grad_norm=1.0,
                             config=engine_config(device_buckets=0, bucket_size_mb=0.25, weights=weights))


def _issue_steps(model, opt, which) -> None:
    for step in which:
        model(**tiny_batch(vocab_size=512, seed=step)).loss.backward()
        opt.step()
        opt.zero_grad()


@functools.lru_cache(maxsize=1)
def _issue_uninterrupted() -> dict[str, torch.Tensor]:
    """The 4 steps without a save, stationary on the CPU device."""
    model = _issue_llama()
    with _issue_optimizer(model, "stationary") as opt:
        _issue_steps(model, opt, range(4))
        return {name: value.clone() for name, value in model.state_dict().items()}


@pytest.mark.parametrize("weights", ["flow", "auto"])
def test_a_model_larger_than_the_device_saves_its_state_dict_and_resumes_bitwise(weights, issue_budget_sim, tmp_path):
    """Train, save (model.state_dict(), save_pretrained), reload into a fresh model and optimizer,
    continue: bitwise the uninterrupted run; the saved weights are bitwise the fp32 masters the
    host Adam trains; the device never holds more than its budget."""
    sim, weight_bytes = issue_budget_sim
    with pytest.MonkeyPatch.context() as mp:  # (flow trains bitwise like stationary: the tests above)
        mp.delenv(SIM_ENV_VAR)
        want = _issue_uninterrupted()
    model = _issue_llama()
    with _issue_optimizer(model, weights) as opt:
        flowing = [name for name, p in model.named_parameters() if parts(opt).flow.flows(p)]
        assert flowing, opt.describe()
        _issue_steps(model, opt, range(2))
        sim.reset_peak_memory_stats()
        allocated, fetches = sim.memory_allocated(), opt.counters.weight_fetches
        saved = model.state_dict()
        # nothing fetched onto the device: the host copies are read where they are
        assert opt.counters.weight_fetches == fetches and sim.max_memory_allocated() == allocated
        masters = opt.state_dict()["state"]
        params = dict(model.named_parameters())
        for i, (name, p) in enumerate(params.items()):
            assert torch.equal(saved[name], masters[i]["master_param"]), name
            if name in flowing:  # a host copy; the parameter stays released
                assert saved[name].untyped_storage().nbytes() == p.numel() * 4 and p.untyped_storage().nbytes() == 0
        torch.save({"model": saved, "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
        model.save_pretrained(tmp_path / "hf")
        assert sim.max_memory_allocated() <= weight_bytes // 4
    from transformers import LlamaForCausalLM

    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for name, value in saved.items():
        assert torch.equal(reloaded[name], value), f"save_pretrained: {name}"
    model = _issue_llama()
    with _issue_optimizer(model, weights) as opt:
        ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
        model.load_state_dict(ckpt["model"])
        for name, value in model.state_dict().items():  # written into the host copies, read back
            assert torch.equal(value, ckpt["model"][name]), f"after load: {name}"
        opt.load_state_dict(ckpt["opt"])
        _issue_steps(model, opt, range(2, 4))
        got = model.state_dict()
        assert sim.max_memory_allocated() <= weight_bytes // 4
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{name} differs after the resume"


def test_loading_only_the_model_under_flow_lands_in_the_weights_training_uses():
    """model.load_state_dict() without the optimizer's state (weights only, the optimizer fresh):
    what the next forward computes with and the next step starts from, as a model that had those
    weights when its optimizer was built (the fp32 master is the host copy that flows)."""
    donor = tiny_llama(num_layers=2, seed=7).state_dict()
    want = tiny_llama(num_layers=2)
    want.load_state_dict(donor)
    model = tiny_llama(num_layers=2)
    with SuperOffloadAdamW(model.parameters(), lr=LR, model=model,
                           config=engine_config(device_buckets=0, weights="flow")) as opt, \
            SuperOffloadAdamW(want.parameters(), lr=LR, model=want, config=engine_config(device_buckets=0)) as ref_opt:
        with torch.no_grad():
            model(**micro_batches(99)[0])  # (units fetched and released again before the load)
        model.load_state_dict(donor)
        _steps_of(model, opt, range(3))
        _steps_of(want, ref_opt, range(3))
        got, expected = model.state_dict(), want.state_dict()
        for name, value in expected.items():
            assert torch.equal(got[name], value), name


@pytest.mark.usefixtures("device_mode")
@pytest.mark.parametrize("state", ["fp32", "compact"])
def test_a_bf16_load_under_flow_changes_the_master_only_where_the_value_changes(state):
    """bf16 weights flow from the host's bf16 copy (fp32 state: the fp32 master behind it; compact:
    the master's error bits): a load writes the copy, and the master only where the loaded value
    differs, so loading the weights a step already holds keeps every master bit."""
    model = tiny_llama(num_layers=2)
    name = "model.layers.0.mlp.up_proj.weight"
    with SuperOffloadAdamW(model.parameters(), lr=LR, model=model, config=engine_config(
            device_buckets=0, weights="flow", device_dtype="bf16", state_precision=state)) as opt:
        _steps_of(model, opt, range(2))
        index = [n for n, _ in model.named_parameters()].index(name)
        before = {i: {k: v.clone() for k, v in entry.items() if isinstance(v, torch.Tensor)}
                  for i, entry in opt.state_dict()["state"].items()}
        saved = model.state_dict()
        value = saved[name].clone()
        assert value.dtype == torch.bfloat16
        value[::2] = (value[::2].float() + 1).bfloat16()
        model.load_state_dict({**saved, name: value})
        assert torch.equal(model.state_dict()[name], value)
        after = opt.state_dict()["state"]
        changed = (value != saved[name]).reshape(-1)
        assert 0 < int(changed.sum()) < changed.numel()
        for i, entry in before.items():
            for kind, old in entry.items():
                new = after[i][kind]
                if i != index or kind not in ("master_param", "master_bf16", "master_err"):
                    assert torch.equal(new, old), (i, kind)  # the same values loaded: every bit kept
                    continue
                new, old = new.reshape(-1), old.reshape(-1)
                assert torch.equal(new[~changed], old[~changed]), kind
                if kind == "master_param":
                    assert torch.equal(new[changed], value.reshape(-1)[changed].float())
                elif kind == "master_bf16":
                    assert torch.equal(new, value.reshape(-1))
                else:
                    assert not new[changed].any()


def _steps_of(model, opt, which) -> None:
    for step in which:
        (batch,) = micro_batches(step)
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()


# ---- reading and writing a released parameter (issue 28 item 2) ----------------------------------
#
# After step() a flowing parameter's device storage is released (0 bytes behind a full-size
# tensor). Reading it must give the right values or raise an error naming how to read them; a
# write must land in the weights training uses or raise. Run in a child process: before the fix
# the read was a segmentation fault, which would take the test run with it.

_READS = {
    "detach().float()": lambda p: p.detach().float(),
    "sum()": lambda p: p.sum(),
    "clone()": lambda p: p.clone(),
    "data.clone()": lambda p: p.data.clone(),
    "cpu().numpy()": lambda p: p.detach().cpu().numpy().copy(),
    "torch.equal": lambda p: torch.equal(p, torch.zeros_like(p)),
    "torch.stack([p])": lambda p: torch.stack([p])[0],
    "_foreach_add([p])": lambda p: torch._foreach_add([p], 0.0)[0],  # (an EMA's foreach ops)
    "safetensors save": lambda p: __import__("safetensors.torch").torch.load(
        __import__("safetensors.torch").torch.save({"w": p.detach()}))["w"],
}


def _read_and_write_released_parameters(rank, world, weights):
    import torch

    from superoffload_hf import SuperOffloadAdamW
    from _models import engine_config, micro_batches, tiny_llama

    model = tiny_llama(num_layers=2)
    opt = SuperOffloadAdamW(model.parameters(), lr=1e-2, model=model,
                            config=engine_config(device_buckets=0, weights=weights))
    names = [name for name, _ in model.named_parameters()]
    out = {"reads": {}, "writes": {}}

    def step(k):
        (batch,) = micro_batches(k)
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss)

    with opt:
        step(0)
        p = model.model.layers[0].mlp.up_proj.weight
        index = names.index("model.layers.0.mlp.up_proj.weight")
        out["released"] = p.untyped_storage().nbytes() == 0
        master = opt.state_dict()["state"][index]["master_param"].clone()
        out["metadata"] = (tuple(p.shape), str(p.dtype), p.numel(), p.requires_grad, p.grad is None)
        model.to("cpu").float().train()  # no element read: no-ops, as on stationary weights
        out["num_parameters"] = model.num_parameters()
        for what, read in _READS.items():
            try:  # (the read, and the use of what it returned)
                value = read(p)
                if isinstance(value, torch.Tensor):
                    right = torch.equal(value.to(master.dtype), master if value.dim() else master.sum())
                elif isinstance(value, bool):
                    right = value == torch.equal(master, torch.zeros_like(master))
                else:
                    right = bool((torch.from_numpy(value) == master).all())
            except RuntimeError as error:
                out["reads"][what] = ("raised", str(error))
            else:
                out["reads"][what] = ("value", right)
        out["repr"] = repr(p)[:200]
        writes = {
            "copy_ under no_grad": lambda p, v: p.copy_(v),
            "data.copy_": lambda p, v: p.data.copy_(v),
            "detach().mul_": lambda p, v: p.detach().mul_(0.5),
        }
        for k, (what, write) in enumerate(writes.items()):
            value = torch.full_like(master, 0.25 * (k + 1))
            before = opt.state_dict()["state"][index]["master_param"].clone()
            try:
                with torch.no_grad():
                    write(p, value)
            except RuntimeError as error:
                out["writes"][what] = ("raised", str(error),
                                       torch.equal(opt.state_dict()["state"][index]["master_param"], before))
            else:
                landed = opt.state_dict()["state"][index]["master_param"]
                expected = value if what != "detach().mul_" else before * 0.5
                out["writes"][what] = ("landed", torch.equal(landed, expected), step(1 + k))
    return out


@pytest.mark.parametrize("sim", [False, True], ids=["cpu", "sim"])
def test_reading_or_writing_a_released_parameter_gives_the_values_or_raises_naming_how(sim):
    from _dist import run_ranks

    env = {SIM_ENV_VAR: "1"} if sim else {SIM_ENV_VAR: ""}
    (flow,) = run_ranks(_read_and_write_released_parameters, 1, "flow", env=env, deadline_s=120)
    (stationary,) = run_ranks(_read_and_write_released_parameters, 1, "stationary", env=env, deadline_s=120)
    assert flow["released"] and flow["metadata"] == stationary["metadata"], (flow, stationary)
    assert flow["num_parameters"] == stationary["num_parameters"]
    assert "weight-flow" in flow["repr"], flow["repr"]
    for what, result in flow["reads"].items():
        if result[0] == "raised":
            assert "model.state_dict()" in result[1] and "weights: flow" in result[1], (what, result[1])
        else:
            assert result[1], f"{what} read wrong values"
    for what, result in flow["writes"].items():
        if result[0] == "raised":
            assert "model.load_state_dict" in result[1] and result[2], (what, result)
        else:
            assert result[1], f"{what} did not land in the master"
            # the next step trained from the written weights: the same loss as stationary's
            assert stationary["writes"][what][0] == "landed" and result[2] == stationary["writes"][what][2], what


# ---- reentrant gradient checkpointing (issue 28 item 3) -------------------------------------------


class _CheckpointedBlocks(torch.nn.Module):
    """Blocks called through `torch.utils.checkpoint.checkpoint(block, h)`: the module's hooks run
    inside the checkpoint (as in transformers before 5.24 and in plain PyTorch models), so the
    recomputation in backward runs them again. (transformers 5.24 on checkpoints `forward`,
    leaving the hooks outside.)"""

    def __init__(self, reentrant: bool, width: int = 32, depth: int = 3, vocab: int = 128):
        super().__init__()
        self.reentrant = reentrant
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(vocab, width)
            self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
                torch.nn.LayerNorm(width), torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                torch.nn.Linear(2 * width, width)) for _ in range(depth))
            self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids, labels):
        from torch.utils.checkpoint import checkpoint

        h = self.embed(input_ids)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=self.reentrant)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def _train_checkpointed(weights: str, reentrant: bool, kind: str) -> dict[str, torch.Tensor]:
    if kind == "torch":
        model = _CheckpointedBlocks(reentrant)
        loss_of = lambda batch: model(**batch)  # noqa: E731
    else:
        model = tiny_llama(num_layers=3)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        loss_of = lambda batch: model(**batch).loss  # noqa: E731
    model.train()
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, model=model, max_grad_norm=1.0,
                            config=engine_config(device_buckets=0, weights=weights, speculation="on"))
    with opt:
        for step in range(3):
            (batch,) = micro_batches(step)
            loss_of(batch).backward()
            opt.step()
            opt.zero_grad()
        if weights == "flow":
            assert f"weights flow: {5 if kind == 'torch' else 6} units" in opt.describe()
        return {name: value.clone() for name, value in model.state_dict().items()}


@pytest.mark.usefixtures("device_mode")
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("kind", ["torch", "hf"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_flow_with_gradient_checkpointing_of_either_kind_trains_bitwise_like_stationary(reentrant, kind):
    """Reentrant checkpointing runs the block's forward under no_grad, then recomputes it inside
    backward with a backward of its own: the unit stays on the device until every gradient of it
    has left (it went after the first)."""
    want = _train_checkpointed("stationary", reentrant, kind)
    got = _train_checkpointed("flow", reentrant, kind)
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{name} differs under weight-flow"


@pytest.mark.sim
def test_close_records_the_compute_stream_on_each_storage_it_fetches_on_the_flow_stream(sim):
    model = tiny_llama(num_layers=2)
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, model=model,
                            config=engine_config(device_buckets=0, weights="flow"))
    (batch,) = micro_batches(0)
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad()
    runtime = parts(opt).runtime
    away = [p for p in model.parameters() if p.untyped_storage().nbytes() == 0]
    assert away  # released between uses: close() fetches them on the flow stream
    recorded, record = [], runtime.record_stream
    runtime.record_stream = lambda tensor, stream: (recorded.append((tensor.untyped_storage().data_ptr(), stream)),
                                                    record(tensor, stream))[-1]
    opt.close()
    compute = runtime.current_stream()
    for p in away:
        assert (p.untyped_storage().data_ptr(), compute) in recorded, p.shape


@pytest.mark.usefixtures("device_mode")
def test_a_compiled_model_under_flow_is_refused_at_its_first_forward_naming_the_config_and_the_fix():
    model = tiny_llama(num_layers=1)
    with SuperOffloadAdamW(model.parameters(), lr=LR, model=model,
                           config=engine_config(device_buckets=0, weights="flow")) as opt:
        (batch,) = micro_batches(0)
        torch._dynamo.reset()
        with pytest.raises(RuntimeError, match=r"torch.compile traced the forward of unit model.embed_tokens under "
                                               r"`weights: flow`.*set `weights: stationary`"):
            torch.compile(model, backend="eager")(**batch)
        torch._dynamo.reset()
        model(**batch).loss.backward()  # the uncompiled model still trains
        opt.step()
        assert opt.counters.steps == 1
