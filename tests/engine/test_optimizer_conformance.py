"""SuperOffloadAdamW against the torch.optim.Optimizer contract, over the AdamW inputs torch ships.

The inputs are torch's own (`torch.testing._internal.common_optimizers`: AdamW's
`optim_inputs_func` and `optim_error_inputs_func` on the CPU); the behaviours checked are the
generic ones torch checks of every optimizer, written here for this optimizer: the same updates
as torch.optim.AdamW (state and parameters, element by element), state_dict round trips and
their hooks, deterministic state dicts, live param_groups for LR schedulers, zero_grad and
gradient-less steps, copy.deepcopy, step hooks, `optimizer.state` for tools, torch's
construction errors. Inputs that do not apply are skipped with the reason. The documented
differences (docs/config.md "The torch.optim contract") are tested as such: complex parameters
are refused, parameters are cast to the device dtype.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch.testing._internal.common_optimizers import optim_db

from superoffload_hf import SuperOffloadAdamW

from _models import one_torch_thread  # noqa: F401

pytestmark = [pytest.mark.usefixtures("one_torch_thread", "device_mode"), pytest.mark.timeout(60)]

ADAMW = next(info for info in optim_db if info.optim_cls is torch.optim.AdamW)
INPUTS = ADAMW.optim_inputs_func(device="cpu")
UNSUPPORTED = ("maximize", "amsgrad")  # refused with a clear error (test_unsupported_options_are_refused)
SUPPORTED = [i for i in INPUTS if not any(i.kwargs.get(name) for name in UNSUPPORTED)]
# several buckets, one of them device-resident: every placement of the state is exercised
CONFIG = {"device_dtype": "fp32", "bucket_size_mb": 0.0002, "device_buckets": 1, "host_threads": 1}
RTOL, ATOL = 1e-5, 1e-6  # the host kernel rounds with fma where torch does not: a few ulp a step
STEPS = 3


def ids(inputs) -> list[str]:
    return [i.desc.replace(" ", "_") for i in inputs]


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    """A two-layer MLP's weights (8 -> 16 -> 4), as plain parameters (copy.deepcopy of the
    optimizer copies them)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(16, 8), (16,), (4, 16), (4,)]
    return [torch.nn.Parameter(torch.randn(*s, generator=g) * 0.3) for s in shapes]


def clone(params) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def loss_of(params, step: int) -> torch.Tensor:
    w1, b1, w2, b2 = params
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(100 + step)).to(w1.dtype)
    return torch.tanh(x @ w1.T + b1).matmul(w2.T).add(b2).pow(2).mean()


def train(opt, params, steps, first: int = 0, scheduler=None) -> None:
    for step in range(first, first + steps):
        loss_of(params, step).backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


def ours(params, optim_input, **extra) -> SuperOffloadAdamW:
    return SuperOffloadAdamW(params, **optim_input.kwargs, config=CONFIG, **extra)


def torch_adamw(params, optim_input) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, **optim_input.kwargs, foreach=False)


def assert_matches(actual_params, actual_state, expected_params, expected_state) -> None:
    for i, (a, e) in enumerate(zip(actual_params, expected_params)):
        torch.testing.assert_close(a.detach(), e.detach(), rtol=RTOL, atol=ATOL, msg=f"param {i}")
        assert set(actual_state[a]) == {"step", "exp_avg", "exp_avg_sq"}
        assert int(actual_state[a]["step"]) == int(expected_state[e]["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            got = actual_state[a][key]
            assert got.dtype == torch.float32 and got.device.type == "cpu", (key, got.dtype, got.device)
            torch.testing.assert_close(got, expected_state[e][key], rtol=RTOL, atol=ATOL, msg=f"param {i} {key}")


def assert_nested_equal(actual, expected, where="state_dict") -> None:
    assert type(actual) is type(expected), where
    if isinstance(actual, dict):
        assert list(actual) == list(expected), where
        for key in actual:
            assert_nested_equal(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(actual, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_nested_equal(a, e, f"{where}[{i}]")
    elif isinstance(actual, torch.Tensor):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), where
    else:
        assert actual == expected, where


def saved_and_loaded(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# ---- the same math as torch.optim.AdamW --------------------------------------------------------

@pytest.mark.parametrize("optim_input", SUPPORTED, ids=ids(SUPPORTED))
def test_state_and_parameters_match_torch_adamw(optim_input):
    params, reference = make_params(), make_params()
    opt, torch_opt = ours(params, optim_input), torch_adamw(reference, optim_input)
    with opt:
        train(opt, params, STEPS)
        train(torch_opt, reference, STEPS)
        assert_matches(params, opt.state, reference, torch_opt.state)


@pytest.mark.parametrize("optim_input", SUPPORTED, ids=ids(SUPPORTED))
def test_per_group_hyperparameters_match_torch_adamw(optim_input):
    def groups(params):
        return [{"params": params[:2], "lr": 3e-3, "weight_decay": 0.2}, {"params": params[2:]}]

    params, reference = make_params(), make_params()
    opt = SuperOffloadAdamW(groups(params), **optim_input.kwargs, config=CONFIG)
    torch_opt = torch.optim.AdamW(groups(reference), **optim_input.kwargs, foreach=False)
    with opt:
        train(opt, params, STEPS)
        train(torch_opt, reference, STEPS)
        assert_matches(params, opt.state, reference, torch_opt.state)


@pytest.mark.parametrize("optim_input", SUPPORTED, ids=ids(SUPPORTED))
def test_param_groups_are_live_for_lr_schedulers(optim_input):
    params, reference = make_params(), make_params()
    opt, torch_opt = ours(params, optim_input), torch_adamw(reference, optim_input)
    with opt:
        train(opt, params, 4, scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
        train(torch_opt, reference, 4, scheduler=torch.optim.lr_scheduler.StepLR(torch_opt, step_size=1, gamma=0.5))
        assert opt.param_groups[0]["lr"] == torch_opt.param_groups[0]["lr"]
        assert_matches(params, opt.state, reference, torch_opt.state)


# ---- state dicts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("optim_input", SUPPORTED, ids=ids(SUPPORTED))
def test_a_saved_and_loaded_state_dict_continues_like_the_uninterrupted_run(optim_input):
    params = make_params()
    resumed_params = clone(params)
    opt = ours(params, optim_input)
    with opt:
        train(opt, params, 2)
        for p, q in zip(resumed_params, params):
            q_now = q.detach().clone()
            p.data.copy_(q_now)
        saved = saved_and_loaded(opt.state_dict())
        with ours(resumed_params, optim_input) as resumed:
            resumed.load_state_dict(saved)
            train(opt, params, 2, first=2)
            train(resumed, resumed_params, 2, first=2)
            for a, e in zip(resumed_params, params):
                assert torch.equal(a.detach(), e.detach())
            assert_nested_equal(resumed.state_dict(), opt.state_dict())


@pytest.mark.parametrize("optim_input", SUPPORTED, ids=ids(SUPPORTED))
def test_state_dicts_of_the_same_training_are_equal(optim_input):
    runs = []
    for _ in range(2):
        params = make_params()
        with ours(params, optim_input) as opt:
            train(opt, params, STEPS)
            runs.append(copy.deepcopy(opt.state_dict()))
            assert_nested_equal(opt.state_dict(), runs[-1])  # twice in a row: the same
    assert_nested_equal(runs[0], runs[1])


@pytest.mark.parametrize("optim_input", SUPPORTED, ids=ids(SUPPORTED))
def test_a_torch_adamw_state_dict_loads_and_continues_like_torch(optim_input):
    params, reference = make_params(), make_params()
    torch_opt = torch_adamw(reference, optim_input)
    train(torch_opt, reference, 2)
    for p, r in zip(params, reference):
        p.data.copy_(r.detach())
    with ours(params, optim_input) as opt:
        opt.load_state_dict(saved_and_loaded(torch_opt.state_dict()))
        train(opt, params, 2, first=2)
        train(torch_opt, reference, 2, first=2)
        assert_matches(params, opt.state, reference, torch_opt.state)


def test_state_dict_hooks_run_as_in_torch():
    params = make_params()
    with ours(params, SUPPORTED[0]) as opt:
        train(opt, params, 1)
        calls = []
        opt.register_state_dict_pre_hook(lambda o: calls.append(("pre", o)))
        opt.register_state_dict_pre_hook(lambda o: calls.append(("pre first", o)), prepend=True)

        def post(o, sd):
            calls.append(("post", o))
            return {**sd, "extra": 1}

        handle = opt.register_state_dict_post_hook(post)
        sd = opt.state_dict()
        assert [name for name, _ in calls] == ["pre first", "pre", "post"]
        assert all(o is opt for _, o in calls)
        assert sd["extra"] == 1
        handle.remove()
        assert "extra" not in opt.state_dict()


def test_load_state_dict_hooks_run_as_in_torch():
    params = make_params()
    with ours(params, SUPPORTED[0]) as opt:
        train(opt, params, 1)
        saved = copy.deepcopy(opt.state_dict())
        seen = {}

        def pre(o, sd):
            seen["pre"] = (o, sd is saved)
            sd = dict(sd)
            sd["param_groups"] = [{**g, "lr": 0.5} for g in sd["param_groups"]]
            return sd

        def post(o):
            seen["post lr"] = o.param_groups[0]["lr"]

        opt.register_load_state_dict_pre_hook(pre)
        opt.register_load_state_dict_post_hook(post)
        opt.load_state_dict(saved)
        assert seen["pre"] == (opt, False)  # the pre-hook got a shallow copy
        assert seen["post lr"] == 0.5 and opt.param_groups[0]["lr"] == 0.5


# ---- steps, gradients, hooks ----------------------------------------------------------------------

@pytest.mark.parametrize("rollback", ["snapshot", "inverse"])
@pytest.mark.parametrize("optim_input", SUPPORTED, ids=ids(SUPPORTED))
def test_zero_grad_releases_gradients_and_a_step_without_any_changes_nothing(optim_input, rollback):
    """torch: nothing changes. Here a bucket stepped speculatively during that backward (the
    simulated device) is undone by the configured `rollback`: "snapshot" bit-exactly,
    "inverse" (the default) within a few ulp (docs/config.md)."""
    params = make_params()
    with SuperOffloadAdamW(params, **optim_input.kwargs, config={**CONFIG, "rollback": rollback}) as opt:
        train(opt, params, 2)
        before = copy.deepcopy(opt.state_dict())
        weights = [p.detach().clone() for p in params]
        loss_of(params, 9).backward()
        opt.zero_grad()
        assert all(p.grad is None for p in params)
        opt.step()  # no gradient: no update, no step counted
        after = copy.deepcopy(opt.state_dict())
        assert after["superoffload"]["counters"]["steps"] == before["superoffload"]["counters"]["steps"]
        for sd in (before, after):  # the counters count the work done: a speculative step undone too
            del sd["superoffload"]["counters"]
        if rollback == "snapshot":
            assert_nested_equal(after, before)
            for p, w in zip(params, weights):
                assert torch.equal(p.detach(), w)
            return
        for index, entry in before["state"].items():
            assert after["state"][index]["step"] == entry["step"]
            for key in ("exp_avg", "exp_avg_sq", "master_param"):
                torch.testing.assert_close(after["state"][index][key], entry[key], rtol=RTOL, atol=ATOL)
        for p, w in zip(params, weights):
            torch.testing.assert_close(p.detach(), w, rtol=RTOL, atol=ATOL)


def test_step_hooks_run_once_a_step():
    params = make_params()
    with ours(params, SUPPORTED[0]) as opt:
        calls = []
        opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o)))
        opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o)))
        train(opt, params, 2)
        assert [name for name, _ in calls] == ["pre", "post"] * 2 and all(o is opt for _, o in calls)


def test_the_optimizer_prints_its_groups():
    with ours(make_params(), SUPPORTED[0]) as opt:
        text = repr(opt)
    assert "SuperOffloadAdamW" in text and "Parameter Group 0" in text and "lr: 0.001" in text


# ---- copy.deepcopy -----------------------------------------------------------------------------------

@pytest.mark.parametrize("optim_input", SUPPORTED, ids=ids(SUPPORTED))
def test_a_deep_copy_is_an_independent_working_optimizer(optim_input):
    params = make_params()
    opt = ours(params, optim_input)
    with opt:
        train(opt, params, 2)
        twin = copy.deepcopy(opt)
        with twin:
            twin_params = [p for g in twin.param_groups for p in g["params"]]
            assert all(a is not b for a, b in zip(twin_params, params))
            assert_nested_equal(twin.state_dict(), opt.state_dict())
            assert (twin.max_grad_norm, twin.config, twin.counters) == (opt.max_grad_norm, opt.config, opt.counters)
            before = copy.deepcopy(opt.state_dict())
            train(twin, twin_params, 2, first=2)
            assert_nested_equal(opt.state_dict(), before)  # the original did not move
            train(opt, params, 2, first=2)
            assert_nested_equal(twin.state_dict(), opt.state_dict())


def test_a_model_and_its_optimizer_copied_together_share_the_copied_parameters():
    model = torch.nn.Linear(8, 4)
    opt = SuperOffloadAdamW(model.parameters(), config=CONFIG)
    with opt:
        model_copy, opt_copy = copy.deepcopy((model, opt))
        with opt_copy:
            assert [p for g in opt_copy.param_groups for p in g["params"]] == list(model_copy.parameters())


# ---- optimizer.state for tools ---------------------------------------------------------------------

def test_optimizer_state_maps_each_stepped_parameter_to_read_only_copies():
    params, reference = make_params(), make_params()
    opt, torch_opt = SuperOffloadAdamW(params, config=CONFIG), torch.optim.AdamW(reference, foreach=False)
    with opt:
        assert len(opt.state) == 0 and not opt.state and dict(opt.state[params[0]]) == {}
        train(opt, params, STEPS)
        train(torch_opt, reference, STEPS)
        assert list(opt.state) == params and all(p in opt.state for p in params)
        assert torch.zeros(()) not in opt.state and len(opt.state) == len(params)
        assert_matches(params, opt.state, reference, torch_opt.state)
        entry = opt.state[params[0]]
        with pytest.raises(TypeError):
            entry["exp_avg"] = torch.zeros(1)  # read-only
        entry["exp_avg"].zero_()  # a copy: the optimizer's state is untouched
        torch.testing.assert_close(opt.state[params[0]]["exp_avg"], torch_opt.state[reference[0]]["exp_avg"],
                                   rtol=RTOL, atol=ATOL)


def test_optimizer_state_under_compact_state_holds_the_decoded_moments():
    """Compact state (bf16 device weights): the fp32 decoding of the stored bytes, against the
    same training with fp32 state (compact moments: 8/7 bits a value, one scale per 32)."""
    runs = {}
    for precision in ("compact", "fp32"):
        params = make_params()
        opt = SuperOffloadAdamW(params, config={**CONFIG, "device_dtype": "bf16", "state_precision": precision,
                                                "device_buckets": 0})
        with opt:
            train(opt, params, STEPS)
            runs[precision] = [opt.state[p] for p in params]
            assert dict(opt.state_dict()["state"][0]).keys() >= ({"master_bf16"} if precision == "compact"
                                                                 else {"exp_avg"})
    for i, (compact, fp32) in enumerate(zip(runs["compact"], runs["fp32"])):
        assert compact["step"] == fp32["step"] == STEPS
        for key in ("exp_avg", "exp_avg_sq"):
            assert compact[key].dtype == torch.float32 and compact[key].shape == fp32[key].shape
            scale = fp32[key].abs().max()
            torch.testing.assert_close(compact[key], fp32[key], rtol=0.05, atol=0.02 * float(scale),
                                       msg=f"param {i} {key}")


class Mlp(torch.nn.Module):
    def __init__(self, params):
        super().__init__()
        self.w1, self.b1, self.w2, self.b2 = params


def test_torch_distributed_checkpoint_reads_and_restores_the_state():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model, twin = Mlp(make_params()), Mlp(make_params(seed=1))
    with ours(list(model.parameters()), SUPPORTED[0]) as opt, ours(list(twin.parameters()), SUPPORTED[0]) as resumed:
        assert get_optimizer_state_dict(model, opt)["state"] == {}
        train(opt, list(model.parameters()), 2)
        saved = copy.deepcopy(get_optimizer_state_dict(model, opt))
        assert set(saved["state"]) == {"w1", "b1", "w2", "b2"}
        with torch.no_grad():
            for p, q in zip(twin.parameters(), model.parameters()):
                p.copy_(q)
        set_optimizer_state_dict(twin, resumed, saved)
        train(opt, list(model.parameters()), 2, first=2)
        train(resumed, list(twin.parameters()), 2, first=2)
        for a, e in zip(twin.parameters(), model.parameters()):
            assert torch.equal(a.detach(), e.detach())
        ours_now, theirs = resumed.state_dict(), opt.state_dict()  # (DCP keeps "state" and "param_groups" only)
        assert_nested_equal(ours_now["state"], theirs["state"])
        assert_nested_equal(ours_now["param_groups"], theirs["param_groups"])


# ---- construction: torch's errors, the unsupported options, the documented differences ----------

ERRORS = [e for e in ADAMW.optim_error_inputs_func(device="cpu", dtype=torch.float32)]


def error_id(error) -> str:
    return (error.optimizer_error_input.desc or str(error.error_regex))[:40].replace(" ", "_")


@pytest.mark.parametrize("error", ERRORS, ids=[error_id(e) for e in ERRORS])
def test_construction_errors_are_torch_errors(error):
    given = error.optimizer_error_input
    if given.kwargs.get("foreach"):
        pytest.skip("foreach selects one of torch's implementations; the host kernel is the only one here")
    params = given.params if given.params is not None else make_params()
    if error.error_type is UserWarning:
        with pytest.warns(UserWarning, match=error.error_regex):
            SuperOffloadAdamW(params, **given.kwargs, config=CONFIG).close()
        return
    with pytest.raises(error.error_type) as info:
        SuperOffloadAdamW(params, **given.kwargs, config=CONFIG)
    if "Invalid" not in error.error_regex:  # torch's wording, where ours names the argument instead
        assert info.match(error.error_regex)


def test_a_parameter_repeated_in_a_group_warns_and_is_stepped_once():
    params, reference = make_params(), make_params()
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = SuperOffloadAdamW([params[0], *params], config=CONFIG)
    torch_opt = torch.optim.AdamW(reference, foreach=False)
    with opt:
        assert opt.param_groups[0]["params"] == params
        train(opt, params, 2)
        train(torch_opt, reference, 2)
        assert_matches(params, opt.state, reference, torch_opt.state)


@pytest.mark.parametrize("optim_input", [i for i in INPUTS if i not in SUPPORTED],
                         ids=ids([i for i in INPUTS if i not in SUPPORTED]))
def test_unsupported_options_are_refused_naming_them(optim_input):
    name = next(n for n in UNSUPPORTED if optim_input.kwargs.get(n))
    with pytest.raises(ValueError, match=f"`{name}` is True"):
        ours(make_params(), optim_input)
    with pytest.raises(ValueError, match=f"`{name}` is True"):
        SuperOffloadAdamW([{"params": make_params(), name: True}], config=CONFIG)
    with ours(make_params(), SUPPORTED[0]) as opt:  # a torch state dict asking for it
        saved = torch_adamw(make_params(), optim_input).state_dict()
        with pytest.raises(ValueError, match=f"`{name}` True"):
            opt.load_state_dict(saved)


def test_documented_difference_complex_parameters_are_refused():
    with pytest.raises(TypeError, match="complex64"):
        SuperOffloadAdamW([torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))], config=CONFIG)


def test_documented_difference_parameters_are_cast_to_the_device_dtype():
    params = make_params()
    with SuperOffloadAdamW(params, config={**CONFIG, "device_dtype": "bf16"}) as opt:
        assert all(p.dtype == torch.bfloat16 for p in params)
        train(opt, params, 1)
        assert all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in params)


# ---- data parallelism: a rank's optimizer.state is its shard ------------------------------------

def _rank_reads_its_shard(rank, world):
    params, reference = make_params(), make_params()  # the same data on every rank: the average is it
    opt = SuperOffloadAdamW(params, config={**CONFIG, "device_buckets": 0})
    torch_opt = torch.optim.AdamW(reference, foreach=False)
    with opt:
        train(opt, params, STEPS)
        train(torch_opt, reference, STEPS)
        pieces = opt.state_dict()["pieces"]
        ranges = {}
        for index, (p, r) in enumerate(zip(params, reference)):
            if index not in pieces:
                assert p not in opt.state
                continue
            start, end = pieces[index]["start"], pieces[index]["end"]
            entry = opt.state[p]
            assert int(entry["step"]) == STEPS
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(entry[key], torch_opt.state[r][key].reshape(-1)[start:end],
                                           rtol=RTOL, atol=ATOL, msg=f"rank {rank} param {index} {key}")
            ranges[index] = (start, end)
        return ranges


def test_under_data_parallelism_each_rank_reads_its_shard_of_the_state():
    from _dist import run_ranks

    per_rank = run_ranks(_rank_reads_its_shard, 2)
    for index, p in enumerate(make_params()):
        covered = sorted(r[index] for r in per_rank if index in r)
        assert covered[0][0] == 0 and covered[-1][1] == p.numel(), (index, covered)
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), (index, covered)
