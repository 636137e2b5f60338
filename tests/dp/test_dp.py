"""Data parallelism on gloo: 2 and 4 local processes train a tiny Llama with SuperOffloadAdamW;
every rank checks its parameters after every step against stock AdamW + clip_grad_norm_ + skip
applied to the rank-averaged gradient (tests/_dp_train.py), and the ranks' parameters are
compared bitwise here."""

from __future__ import annotations

import functools
import re
import tempfile
from pathlib import Path

import pytest

from _dist import run_ranks
from _dp_train import collective_order, default_group_collective_each_step, launch_order_learned, train

pytestmark = pytest.mark.timeout(240)


def _scenarios(rank, world, scenarios):
    return [train(rank, world, **kw) for kw in scenarios]


TWO_RANKS = {
    "spec_on_clip_never": dict(speculation="on", clip="never"),
    "spec_on_clip_always": dict(speculation="on", clip="always"),
    "spec_on_clip_mild": dict(speculation="on", clip="mild"),
    "spec_off_clip_mild": dict(speculation="off", clip="mild"),
    "nonfinite_on_rank1_spec_on": dict(speculation="on", clip="never", poison_rank=1, poison_steps=(1, 3)),
    "nonfinite_on_rank0_spec_off": dict(speculation="off", clip="mild", poison_rank=0, poison_steps=(2,)),
    "accumulation_2": dict(speculation="on", clip="mild", accumulation=2, steps=4),
    "snapshot_rollback_fp32_host_buckets_only": dict(speculation="on", clip="mild",
                                                     config={"rollback": "snapshot", "device_buckets": 0}),
}


def _second_backward_without_step(rank, world):
    """One backward too many (gradient_accumulation_steps 1): the buckets have left the rank."""
    from superoffload_hf import SuperOffloadAdamW
    from superoffload_hf.engine.dp.route import GradientAfterLaunchError
    from _dp_train import engine_config, micro_batches, tiny_llama

    model = tiny_llama()
    with SuperOffloadAdamW(model.parameters(), config=engine_config(device_buckets=0)) as opt:
        batch = micro_batches(0)[0]
        model(**batch).loss.backward()
        try:
            model(**batch).loss.backward()
        except GradientAfterLaunchError as error:
            opt.zero_grad()
            return str(error)
    return None


def _two_rank_suite(rank, world, scenarios):
    return _scenarios(rank, world, scenarios) + [_second_backward_without_step(rank, world)]


@functools.lru_cache(maxsize=None)
def two_rank_results():
    results = run_ranks(_two_rank_suite, 2, list(TWO_RANKS.values()), deadline_s=200)
    out = {name: [r[i] for r in results] for i, name in enumerate(TWO_RANKS)}
    out["second_backward"] = [r[-1] for r in results]
    return out


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_two_ranks_match_stock_adamw_on_the_averaged_gradient_and_agree_bitwise(name):
    per_rank = two_rank_results()[name]  # each rank has asserted equivalence after every step
    assert per_rank[0]["digests"] == per_rank[1]["digests"], f"{name}: ranks hold different parameters"
    if name.startswith("nonfinite"):
        assert any(per_rank[0]["skipped"]) and per_rank[0]["skipped"] == per_rank[1]["skipped"]
    if name == "spec_on_clip_mild":
        counters = per_rank[0]["counters"]
        assert counters["speculative_steps"] > 0 and counters["rollbacks"] > 0, counters
    assert "data parallel rank" in per_rank[0]["summary"]


def test_a_gradient_after_the_bucket_left_the_rank_is_an_error_that_says_what_to_set():
    for message in two_rank_results()["second_backward"]:
        assert message is not None and "gradient_accumulation_steps" in message


# ---- skip, clip and rollback in every speculation mode ------------------------------------------
#
# Rank 1's gradient of layers.1.1.weight is inf at step 3: the step is skipped on both ranks. Rank 1
# sends that bucket as all inf, so neither rank speculates it or anything after it (the embedding:
# on the host here, with rows that see their first gradient at step 3); both step the buckets
# launched before it speculatively and roll them back (tests/dp/test_dp_skip.py: a configuration
# where a rank that stepped the embedding and rolled it back was 5.7e-4 off). Steps 4 and 5
# must continue as torch does from the untouched state: a rollback that left a rounding residue in
# exp_avg where the step started from zero moments (exp_avg_sq restored to exactly 0) made the next
# update divide it by eps, 4e-6 away from the reference. train() compares every parameter after
# every step; clip "mild" rolls back and replays every other step, "none" and "never" commit them.
# On the CPU device "auto" never speculates (nothing to overlap); on the simulated device it does.
SKIP_CLIP_ROLLBACK = {
    f"spec_{mode}_clip_{clip}": dict(speculation=mode, clip=clip, steps=6, poison_rank=1, poison_steps=(3,),
                                     poison_value=float("inf"), config={"device_buckets": 0})
    for mode in ("off", "on", "auto") for clip in ("none", "never", "mild")}
SIM_AUTO = {f"sim_{name}": kw for name, kw in SKIP_CLIP_ROLLBACK.items() if "_auto_" in name}


def _scenarios_each_checked(rank, world, scenarios):
    """As _scenarios, a failed comparison reported per scenario (one run of the processes for all)."""
    out = []
    for kw in scenarios:
        try:
            out.append(train(rank, world, **kw))
        except AssertionError as error:
            out.append({"failed": str(error)})
    return out


@functools.lru_cache(maxsize=None)
def skip_clip_rollback_results(sim: bool):
    scenarios = SIM_AUTO if sim else SKIP_CLIP_ROLLBACK
    results = run_ranks(_scenarios_each_checked, 2, list(scenarios.values()), deadline_s=200,
                        env={"SUPEROFFLOAD_SIM_DEVICE": "1"} if sim else None)
    return {name: [r[i] for r in results] for i, name in enumerate(scenarios)}


@pytest.mark.parametrize("name", list(SKIP_CLIP_ROLLBACK) + list(SIM_AUTO))
def test_a_step_skipped_for_one_rank_nonfinite_gradient_leaves_the_next_steps_exact(name):
    sim = name.startswith("sim_")
    per_rank = skip_clip_rollback_results(sim)[name]  # each rank compared every parameter after every step
    for rank, result in enumerate(per_rank):
        assert "failed" not in result, f"{name}, rank {rank}: {result.get('failed')}"
    assert per_rank[0]["digests"] == per_rank[1]["digests"], f"{name}: ranks hold different parameters"
    assert per_rank[0]["skipped"] == [False, False, False, True, False, False], per_rank[0]["skipped"]
    counters = per_rank[0]["counters"]
    if "_on_" in name or sim:  # speculated, and the skipped step's speculative steps were rolled back
        assert counters["speculative_steps"] > 0 and counters["rollbacks"] > 0, counters
    if "_off_" in name or ("_auto_" in name and not sim):
        assert counters["speculative_steps"] == 0, counters


# ---- parameters with a gradient on some ranks only -------------------------------------------------
#
# The plan's host buckets (tiny_llama, 0.02 MB): 0 head + layers.3.3.bias, 1 layers.3 + layers.2.3.bias,
# 2 layers.2 + layers.1.3.bias, 3 layers.1 + layers.0.3.bias, 4 layers.0 (1-3 of one size: collectives
# paired across buckets would exchange wrong tensors without an error); embed is device-resident.
SKIPS = {(1, 1): (1,),  # buckets 2 and 3 incomplete on rank 1: bucket 4 complete behind them
         (0, 2): (2,), (1, 2): (0,),  # each rank misses what the other has
         (0, 3): (1, 2), (1, 3): (1, 2),  # layers 1, 2 on no rank (bucket 2 wholly): not stepped
         (0, 4): (1, 2), (1, 4): (1, 2, 3),  # bucket 2 again on no rank; layer 3 on rank 0 only
         (1, 5): (2,)}  # bucket 2 back on rank 0 only
MICRO_SKIPS = {(1, 1, 0): (1,), (1, 1, 1): (2,),  # a layer missing from one micro-batch of two
               (0, 2, 1): (1,), (1, 2): (1,),
               (0, 3, 0): (2,), (1, 3, 0): (2,)}  # on no rank in micro-batch 0, on both in 1
# eps 1e-5: with layers left out, a few embedding elements' averaged gradients nearly cancel
# (|g| ~ 1e-8); at eps 1e-8 Adam steps them in its eps-dominated regime, where the fp32 rounding of
# the average (1e-10, the engine and torch sum in different orders) moves the update by 2e-6,
# more than the comparison allows. A wrong pairing or a stale gradient still moves it by ~lr.
UNEVEN = {
    "layers_skipped_spec_on": dict(speculation="on", clip="mild", skip=SKIPS, eps=1e-5),
    "layers_skipped_spec_off": dict(speculation="off", clip="never", skip=SKIPS, eps=1e-5),
    "layers_skipped_per_micro_batch_accumulation_2": dict(speculation="on", clip="mild", accumulation=2,
                                                          steps=4, skip=MICRO_SKIPS, eps=1e-5),
    # rank 1 runs no backward at step 1, rank 0 none at step 3, neither at step 4 (an empty step)
    "a_rank_without_any_gradient": dict(speculation="on", clip="mild", idle=((1, 1), (0, 3), (0, 4), (1, 4)),
                                        eps=1e-5),
}


@functools.lru_cache(maxsize=None)
def uneven_results():
    results = run_ranks(_scenarios, 2, list(UNEVEN.values()), deadline_s=200)
    return {name: [r[i] for r in results] for i, name in enumerate(UNEVEN)}


@pytest.mark.parametrize("name", list(UNEVEN))
def test_gradients_on_some_ranks_only_match_stock_adamw_with_absent_as_zero(name):
    """Every rank launches its buckets in the plan's order, a complete bucket held behind an
    incomplete one; each rank has compared its parameters with the stock reference after every
    step, and the master and moments of parameters without a gradient anywhere bitwise."""
    per_rank = uneven_results()[name]
    assert per_rank[0]["digests"] == per_rank[1]["digests"], f"{name}: ranks hold different parameters"
    assert len(per_rank[0]["digests"]) == UNEVEN[name].get("steps", 6)
    if UNEVEN[name]["speculation"] == "on":  # buckets still launched (and stepped) during backward
        assert per_rank[0]["counters"]["speculative_steps"] > 0, per_rank[0]["counters"]


def test_buckets_held_behind_one_without_gradients_are_logged_once_naming_the_parameters():
    """Parameters 7-12 are layers[1] (rank 1 skips it at step 1: buckets 2, 3 incomplete, bucket
    4 held), 13-18 layers[2] (rank 0 at step 2: buckets 1, 2 incomplete, 3 and 4 held)."""
    per_rank = uneven_results()["layers_skipped_spec_on"]
    (rank0,), (rank1,) = per_rank[0]["held_log"], per_rank[1]["held_log"]
    assert "buckets [3, 4] were complete" in rank0 and "parameters [13, 14, 15, 16, 17, 18]" in rank0, rank0
    assert "buckets [4] were complete" in rank1 and "parameters [7, 8, 9, 10, 11, 12]" in rank1, rank1


def test_the_launch_order_is_learned_at_the_first_step_so_no_bucket_waits_after_it():
    """Parameters handed to the optimizer in a shuffled order: the plan's guessed launch order is
    wrong, so at step 1 some complete bucket waits behind an incomplete one; from step 2 every
    rank launches in the order rank 0's buckets completed at step 1, each bucket the moment it
    completes, all of them during backward."""
    per_rank = run_ranks(launch_order_learned, 2)
    for rank, result in enumerate(per_rank):
        first, *later = result["log"]
        assert not all(first), f"rank {rank}: the shuffled order should have made a bucket wait at step 1"
        for step, launches in enumerate(later, start=2):
            assert launches == [True] * result["host_buckets"], (rank, step, result["log"])
    assert per_rank[0]["digest"] == per_rank[1]["digest"]



def test_communicators_are_created_eagerly_and_the_threads_collectives_keep_one_order_on_every_rank():
    """Every group this rank uses gets one warm-up collective inside the constructor, on the training
    thread, in creation order (NCCL creates a communicator at its first collective: the gather
    group's would otherwise be created by the worker thread, mid-training). During training, each
    collective is issued holding the ordering lock, and the sequence of collectives across the
    training and worker threads is the same on both ranks although rank 1's worker issues its
    all-gathers late (the simulated device runs the host worker on its own thread)."""
    per_rank = run_ranks(collective_order, 2, deadline_s=200, env={"SUPEROFFLOAD_SIM_DEVICE": "1"})
    for rank, result in enumerate(per_rank):
        assert result["roles"] == ["grad", "gather", "control"], result["roles"]  # no replicas: world is grad
        warm_ups = [(op, role) for op, role, thread, _ in result["construction"] if role != "other"]
        # the weights' broadcast (over the world group, here the grad group) follows the warm-ups
        assert warm_ups[:3] == [("all_reduce", "grad"), ("all_reduce", "gather"), ("all_reduce", "control")], warm_ups
        assert {thread for _, _, thread, _ in result["construction"]} == {"MainThread"}
        training = result["training"]
        assert {role for _, role, _, _ in training} == {"grad", "gather", "control"}, training
        assert all(locked for *_, locked in training), [t for t in training if not t[3]]
        assert any(thread != "MainThread" for _, role, thread, _ in training if role == "gather")
    sequences = [[(op, role) for op, role, _, _ in r["training"]] for r in per_rank]
    assert sequences[0] == sequences[1], "the ranks issued their collectives in different orders"

def test_a_default_group_collective_each_step_keeps_one_order_with_the_worker_s_all_gathers_on_every_rank():
    """Issue 29 item 10: the Trainer's token count (accelerator.gather on the default group) at
    every step, code the engine does not own. Rank 1's worker issues its all-gathers late and rank
    0 reaches the default-group collective late: every rank still issues step t's all-gathers
    before step t+1's default-group collective (run_ranks compares the ranks' collectives, per
    communicator and across communicators), and the ranks end with the same weights."""
    per_rank = run_ranks(default_group_collective_each_step, 2, deadline_s=120, env={"SUPEROFFLOAD_SIM_DEVICE": "1"})
    assert per_rank[0] == per_rank[1]


FOUR_RANKS = {
    "nonfinite_on_rank3_clip_mild": dict(speculation="on", clip="mild", steps=5, poison_rank=3, poison_steps=(2,)),
    "sharded_within_pairs_replicated_across": dict(speculation="on", clip="mild", steps=4, shard_group_size=2),
    # presence over the world, reduce-scatters within the pairs; layer 2 on no rank at step 3
    "layers_skipped_sharded_within_pairs": dict(
        speculation="on", clip="mild", steps=5, shard_group_size=2, eps=1e-5,
        skip={(1, 1): (1,), (2, 1): (2,), (0, 2): (0,), (3, 2): (1, 2), **{(r, 3): (2,) for r in range(4)}}),
}


@functools.lru_cache(maxsize=None)
def four_rank_results():
    saved = tempfile.mkdtemp(prefix="dp_pairs_")
    scenarios = [dict(kw, save_dir=saved) if name.startswith("sharded") else kw for name, kw in FOUR_RANKS.items()]
    results = run_ranks(_scenarios, 4, scenarios, deadline_s=200)
    out = {name: [r[i] for r in results] for i, name in enumerate(FOUR_RANKS)}
    out["saved"] = Path(saved)
    return out


def test_four_ranks_with_clipping_and_a_nonfinite_gradient_on_one_rank():
    per_rank = four_rank_results()["nonfinite_on_rank3_clip_mild"]
    assert all(r["digests"] == per_rank[0]["digests"] for r in per_rank)
    assert per_rank[0]["skipped"] == [False, False, True, False, False]


def test_four_ranks_in_pairs_with_gradients_on_some_ranks_only():
    """Ranks 0 and 2 (1 and 3) each step the same shard: bitwise equal only if the one that held a
    bucket until step() takes the speculative path the other took during backward (a speculative
    step rolled back and replayed under clipping differs from one step in the last bits)."""
    per_rank = four_rank_results()["layers_skipped_sharded_within_pairs"]
    assert all(r["digests"] == per_rank[0]["digests"] for r in per_rank)


def test_four_ranks_sharding_within_pairs_and_replicating_across_them():
    per_rank = four_rank_results()["sharded_within_pairs_replicated_across"]
    assert all(r["digests"] == per_rank[0]["digests"] for r in per_rank)
    assert "x 2 replicas" in per_rank[0]["summary"]
    saved = four_rank_results()["saved"]  # one set of shards, written by the first pair
    assert sorted(p.name for p in saved.glob("optimizer.shard-*")) == [
        "optimizer.shard-00000-of-00002.pt", "optimizer.shard-00001-of-00002.pt"]


def test_simulated_device_with_two_ranks():
    results = run_ranks(_scenarios, 2, [dict(speculation="on", clip="mild", steps=4)], deadline_s=200,
                        env={"SUPEROFFLOAD_SIM_DEVICE": "1"})
    assert results[0][0]["digests"] == results[1][0]["digests"]
    assert "sim" in results[0][0]["summary"]


# ---- checkpoints independent of the world size --------------------------------------------------


FIRST = dict(speculation="on", clip="mild", steps=3)  # steps 0-2, then saved
SECOND = dict(speculation="on", clip="mild", steps=3, start_step=3)  # steps 3-5 after resuming


def _run(world: int, **kw) -> list:
    """train() on `world` ranks (in this process, without a process group, for one); checks that
    the ranks agree bitwise."""
    if world == 1:
        results = [train(0, 1, **kw)]
    else:
        results = [r[0] for r in run_ranks(_scenarios, world, [kw], deadline_s=200)]
    assert all(r["digests"] == results[0]["digests"] for r in results)
    return results


@pytest.fixture(scope="module")
def saved_by_two_ranks(tmp_path_factory):
    """Two ranks train steps 0-2 and save (each its shard, rank 0 the index)."""
    path = tmp_path_factory.mktemp("saved_by_two")
    _run(2, **FIRST, save_dir=str(path))
    return path


def test_each_rank_writes_only_its_shard_and_the_export_has_everything(saved_by_two_ranks, tmp_path):
    import torch

    from superoffload_hf.engine.dp.checkpoint import export_consolidated

    assert sorted(p.name for p in saved_by_two_ranks.glob("optimizer*")) == [
        "optimizer.pt", "optimizer.shard-00000-of-00002.pt", "optimizer.shard-00001-of-00002.pt"]
    shards = [torch.load(f, weights_only=True) for f in sorted(saved_by_two_ranks.glob("optimizer.shard-*"))]
    sizes = [sum(p["end"] - p["start"] for p in s["pieces"].values()) for s in shards]
    full = export_consolidated(str(saved_by_two_ranks), str(tmp_path / "optimizer_full.pt"))
    total = sum(v["exp_avg"].numel() for v in full["state"].values())
    assert sum(sizes) == total and max(sizes) <= total // 2 + 64  # about half each, no overlap
    assert all("master_param" in v for v in full["state"].values())


def test_export_optimizer_command(saved_by_two_ranks, tmp_path, capsys):
    from superoffload_hf import cli

    assert cli.main(["export-optimizer", str(saved_by_two_ranks), str(tmp_path / "full.pt")]) == 0
    assert "parameters' fp32 master" in capsys.readouterr().out
    assert cli.main(["export-optimizer", str(tmp_path / "nowhere"), str(tmp_path / "x.pt")]) == 2


def _assert_continued(results: list) -> None:
    """train() compared every parameter, the norm and the skip decision with the saved stock run
    at every resumed step; here: each rank did take steps 3-5, and the step count came from the
    checkpoint (a fresh optimizer would start counting at 0 and its first Adam step would differ)."""
    for r in results:
        assert len(r["digests"]) == 3 and r["skipped"] == [False, False, False]
        assert r["counters"]["steps"] == 6, r["counters"]


def test_resume_two_ranks_on_one(saved_by_two_ranks):
    _assert_continued(_run(1, **SECOND, load_dir=str(saved_by_two_ranks)))


def test_resume_two_ranks_on_four_under_another_bucket_size(saved_by_two_ranks):
    _assert_continued(_run(4, **SECOND, load_dir=str(saved_by_two_ranks), config={"bucket_size_mb": 0.011}))


def test_resume_one_rank_on_two_under_another_bucket_size(tmp_path):
    _run(1, **FIRST, save_dir=str(tmp_path))
    _assert_continued(_run(2, **SECOND, load_dir=str(tmp_path), config={"bucket_size_mb": 0.011}))


# ---- compact host state ---------------------------------------------------------------------------
#
# A bf16 TinyLM with compact state on 2 ranks against one process accumulating both ranks'
# micro-batches (the same global batch): clipped at every step (speculated, rolled back and
# replayed), a NaN gradient on rank 1 at step 2 (skipped). The gradients are the same bits (each
# rank's backward once, the fp32 mean of two vs the fp32 sum of two halves), shards start at group
# boundaries, and the compact step is elementwise per group: parameters and state bytes are equal
# bitwise. (The clip coefficient comes from a float64 norm summed in another order; it could differ
# in its last bit, which would move a weight by at most one unit of its error term: not seen here.)
# One launch of the ranks runs every compact scenario, in order: the saving ones before the loading.
COMPACT = dict(max_grad_norm=0.9, poison=(1, 2))  # the norms are 0.97-1.0: every step clipped


def _compact_scenarios(rank, world, dirs):
    from _dp_train import train_compact

    return [train_compact(rank, world, steps=6, **COMPACT),
            train_compact(rank, world, steps=3, save_dir=dirs["compact2"], **COMPACT),
            train_compact(rank, world, steps=3, start_step=3, load_dir=dirs["compact2"], **COMPACT),
            train_compact(rank, world, steps=3, start_step=3, load_dir=dirs["compact1"], **COMPACT),
            train_compact(rank, world, steps=3, save_dir=dirs["fp32_2"], state_precision="fp32", **COMPACT),
            train_compact(rank, world, steps=1, start_step=3, load_dir=dirs["fp32_2"], **COMPACT),
            train_compact(rank, world, steps=1, start_step=3, load_dir=dirs["compact2"], state_precision="fp32",
                          **COMPACT)]


@functools.lru_cache(maxsize=None)
def compact_results():
    from _dp_train import train_compact

    dirs = {name: tempfile.mkdtemp(prefix=f"dp_{name}_") for name in ("compact1", "compact2", "fp32_2")}
    one = {"full": train_compact(0, 1, steps=6, **COMPACT),
           "saved": train_compact(0, 1, steps=3, save_dir=dirs["compact1"], **COMPACT)}
    names = ("full", "saved", "resumed_2_on_2", "resumed_1_on_2", "fp32_saved", "fp32_on_compact", "compact_on_fp32")
    results = run_ranks(_compact_scenarios, 2, dirs, deadline_s=200)
    two = {name: [r[i] for r in results] for i, name in enumerate(names)}
    one["resumed_2_on_1"] = train_compact(0, 1, steps=3, start_step=3, load_dir=dirs["compact2"], **COMPACT)
    return one, two


def _assert_same_state(got: dict, expected: dict, where: str) -> None:
    import torch

    assert got.keys() == expected.keys(), where
    for index, entry in expected.items():
        assert got[index].keys() == entry.keys(), (where, index)
        for key, tensor in entry.items():
            assert tensor.dtype == got[index][key].dtype and torch.equal(got[index][key], tensor), (where, index, key)


def test_compact_state_on_two_ranks_equals_one_process_on_the_same_global_batch_bitwise():
    one, two = compact_results()
    full = two["full"]
    assert full[0]["digests"] == full[1]["digests"] == one["full"]["digests"]
    assert full[0]["skipped"] == one["full"]["skipped"] == [False, False, True, False, False, False]
    _assert_same_state(full[0]["state"], one["full"]["state"], "consolidated shards vs one process")
    assert all("master_bf16" in entry for entry in full[0]["state"].values())  # compact bytes saved
    counters = full[0]["counters"]
    assert counters["speculative_steps"] > 0 and counters["rollbacks"] > 0, counters
    assert "data parallel rank" in full[0]["summary"]
    per_param = float(re.search(r"state compact ([\d.]+) B/param", full[0]["summary"])[1])
    assert 5.125 <= per_param < 5.5, full[0]["summary"]  # of this rank's shard (group padding included)


@pytest.mark.parametrize("resumed", ["resumed_2_on_2", "resumed_1_on_2", "resumed_2_on_1"])
def test_compact_shard_checkpoints_resume_bit_identically_on_any_world_size(resumed):
    one, two = compact_results()
    got = one[resumed] if resumed.endswith("on_1") else two[resumed][0]
    assert got["digests"] == one["full"]["digests"][3:], resumed
    assert got["skipped"] == [False, False, False]
    _assert_same_state(got["state"], one["full"]["state"], resumed)
    assert not got["notices"], got["notices"]  # one precision: nothing converted


def test_compact_shard_checkpoints_convert_from_and_to_fp32_state_on_load():
    """What a rank loaded equals the saved state converted by the format's reference (the kernels
    match it bitwise), element by element; one notice per load says it converted."""
    from superoffload_hf.engine.state.precision import convert
    from superoffload_hf.host import compact as reference

    _, two = compact_results()
    fp32 = {i: {"master": e["master_param"], "exp_avg": e["exp_avg"], "exp_avg_sq": e["exp_avg_sq"]}
            for i, e in two["fp32_saved"][0]["state"].items()}
    expected = {i: convert(values, "compact", reference) for i, values in fp32.items()}
    _assert_same_state(two["fp32_on_compact"][0]["loaded"], expected, "fp32 shards loaded as compact")
    saved = two["saved"][0]["state"]
    decoded = {i: {("master_param" if k == "master" else k): v for k, v in convert(e, "fp32", reference).items()}
               for i, e in saved.items()}
    _assert_same_state(two["compact_on_fp32"][0]["loaded"], decoded, "compact shards loaded as fp32")
    for name, (saved_as, loaded_as) in (("fp32_on_compact", ("fp32", "compact")), ("compact_on_fp32", ("compact", "fp32"))):
        for rank in (0, 1):
            (notice,) = two[name][rank]["notices"]
            assert f"from {saved_as} to {loaded_as}" in notice, notice


# ---- weight-flow under data parallelism ------------------------------------------------------------
#
# Each rank fetches a unit's buckets whole before its forward and again before its backward: an
# all-gather of the ranks' shards of the host copy (engine/flow.py, dp.gather_for_flow). Against
# stationary on the same ranks, every parameter after every step, bitwise: clipping on (every other
# step rolled back and replayed), an inf gradient on rank 1 at step 2 (the speculated shards rolled
# back, the step skipped). With `rollback: inverse` a mere rollback leaves the master within its
# stated bound of the weights before the step: stationary's device keeps those weights (no
# copy-back), flow fetches the master, so that case is checked against torch (train() does, every
# step) and not bitwise. Compact state (snapshot rollback, exact) flows its bf16 part. The fp32
# pair again with 2 micro-batches per step (each unit fetched for 2 forwards and 2 backwards per
# step; the reduce-scatters only after the second), and with the head tied to the embedding (one
# unit, used at both ends of the forward, its gradient complete only after the embedding's backward).
FLOW = dict(speculation="on", clip="mild", steps=4, poison_rank=1, poison_steps=(2,), poison_value=float("inf"))
FLOW_VARIANTS = {"fp32": {}, "fp32_accumulation": {"accumulation": 2}, "fp32_tied": {"tied": True}}


def _flow_scenarios(rank, world, save_dir):
    from _dp_train import train_compact

    def fp32(weights, rollback="snapshot", **kw):
        return train(rank, world, config={"device_buckets": 0, "weights": weights, "rollback": rollback},
                     **{**FLOW, **kw})

    out = {"fp32_stationary": fp32("stationary"), "fp32_flow": fp32("flow"),
           "compact_stationary": train_compact(rank, world, steps=4, **COMPACT),
           "compact_flow": train_compact(rank, world, steps=4, weights="flow", **COMPACT)}
    if save_dir is None:  # (the simulated device: the seam, not the variants)
        return out
    for variant, kw in FLOW_VARIANTS.items():
        if kw:
            out.update({f"{variant}_{weights}": fp32(weights, **kw) for weights in ("stationary", "flow")})
    return {**out, "forward_between": _flow_forward_between_backward_and_step(),
            "rank0_state_dict": _flow_state_dict_on_rank_0_after_fetch_weights(rank),
            "fp32_flow_inverse_rollback": fp32("flow", "inverse"),
            "fp32_flow_saved": fp32("flow", steps=2, save_dir=save_dir),
            "fp32_flow_resumed": fp32("flow", steps=2, start_step=2, load_dir=save_dir)}


def _flow_forward_between_backward_and_step():
    """An evaluation forward after backward, before step(): its first unit's bucket was stepped
    speculatively on this rank (no clipping: every bucket speculates). Refused on every rank alike."""
    import torch

    from superoffload_hf import SuperOffloadAdamW
    from _dp_train import engine_config, micro_batches, tiny_llama

    model = tiny_llama()
    with SuperOffloadAdamW(model.parameters(), model=model,
                           config=engine_config(device_buckets=0, weights="flow", speculation="on")) as opt:
        batch = micro_batches(0)[0]
        model(**batch).loss.backward()
        try:
            with torch.no_grad():
                model(**batch)
        except RuntimeError as error:
            return str(error)
        finally:
            opt.zero_grad()  # the speculative steps undone; the units fetched again at close()
    return None


def _flow_state_dict_on_rank_0_after_fetch_weights(rank):
    """Saving from rank 0 alone: fetch_weights() on every rank (the gathers), then rank 0's
    model.state_dict() fetches nothing (no collective that the other rank would not join)."""
    from superoffload_hf import SuperOffloadAdamW
    from _dp_train import engine_config, micro_batches, params_digest, tiny_llama

    model = tiny_llama()
    with SuperOffloadAdamW(model.parameters(), model=model,
                           config=engine_config(device_buckets=0, weights="flow")) as opt:
        model(**micro_batches(rank)[0]).loss.backward()
        opt.step()
        opt.fetch_weights()
        fetched = opt.counters.weight_fetches
        digest = params_digest(model) if rank == 0 else None  # (reads model.state_dict())
        return {"digest": digest, "fetches_in_state_dict": opt.counters.weight_fetches - fetched}


@functools.lru_cache(maxsize=None)
def flow_results(sim: bool) -> list[dict]:
    return run_ranks(_flow_scenarios, 2, None if sim else tempfile.mkdtemp(prefix="dp_flow_"), deadline_s=200,
                     env={"SUPEROFFLOAD_SIM_DEVICE": "1"} if sim else None)


@pytest.mark.parametrize("state, sim", [
    *[(state, sim) for sim in (False, True) for state in ("fp32", "compact")],
    *[(variant, False) for variant in FLOW_VARIANTS if variant != "fp32"],  # (the CPU only: see _flow_scenarios)
], ids=lambda value: ("sim" if value else "cpu") if isinstance(value, bool) else value)
def test_weight_flow_on_two_ranks_equals_stationary_every_parameter_every_step_bitwise(state, sim):
    units = 5 if state == "fp32_tied" else 6  # (tied: the embedding and the head are one unit)
    micro_batches_per_step = FLOW_VARIANTS.get(state, {}).get("accumulation", 1)
    for rank, result in enumerate(flow_results(sim)):
        want, got = result[f"{state}_stationary"], result[f"{state}_flow"]
        assert got["digests"] == want["digests"], f"rank {rank} {state}: flow differs from stationary"
        assert got["skipped"] == want["skipped"] and any(got["skipped"]), got["skipped"]
        assert got["counters"]["rollbacks"] > 0 and got["counters"]["replays"] > 0, got["counters"]
        assert f"weights flow: {units} units" in got["summary"] and "data parallel rank" in got["summary"]
        # each unit fetched for every forward and every backward (at least: a state_dict fetches too)
        assert got["counters"]["weight_fetches"] >= 2 * units * micro_batches_per_step * len(got["digests"])
        if state == "compact":
            _assert_same_state(got["state"], want["state"], f"rank {rank}: compact state under flow")
    assert flow_results(sim)[0][f"{state}_flow"]["digests"] == flow_results(sim)[1][f"{state}_flow"]["digests"]


def test_weight_flow_on_two_ranks_with_inverse_rollback_matches_torch_and_the_ranks_agree():
    per_rank = [r["fp32_flow_inverse_rollback"] for r in flow_results(False)]  # each checked against torch
    assert per_rank[0]["digests"] == per_rank[1]["digests"] and any(per_rank[0]["skipped"])


def test_a_weight_flow_run_on_two_ranks_saved_and_resumed_continues_bit_identically():
    for result in flow_results(False):
        assert result["fp32_flow_saved"]["digests"] + result["fp32_flow_resumed"]["digests"] == \
            result["fp32_flow"]["digests"]


def test_a_forward_between_backward_and_step_that_would_read_a_speculated_shard_is_refused_naming_the_fixes():
    for result in flow_results(False):
        message = result["forward_between"]
        assert message is not None and "stepped speculatively" in message and "`speculation: off`" in message, message


def test_saving_from_rank_0_alone_after_fetch_weights_on_every_rank_fetches_nothing_there():
    zero, one = (r["rank0_state_dict"] for r in flow_results(False))
    assert zero["digest"] is not None and zero["fetches_in_state_dict"] == 0 == one["fetches_in_state_dict"]


# ---- the model's state dict under data parallel weight-flow (issue 28 item 1) ----------------------
#
# `model.state_dict()` on every rank together gathers each unit (a collective) and every rank gets
# the whole dict as host tensors; after `fetch_weights()` on every rank, rank 0's state_dict()
# needs no other rank (were it a collective, rank 0 would wait for rank 1 until the deadline) and
# rank 1's refuses, naming rank 0. Loaded on every rank into a fresh model and optimizer, it
# continues bit-identically with the run it was saved from.
def _flow_state_dict_under_data_parallelism(rank, world):
    import torch
    import torch.distributed

    from superoffload_hf import SuperOffloadAdamW
    from _dp_train import engine_config, micro_batches, tiny_llama

    def make(weights):
        model = tiny_llama()
        return model, SuperOffloadAdamW(model.parameters(), lr=1e-2, model=model,
                                        config=engine_config(device_buckets=0, weights=weights))

    def step(model, opt, k):
        model(**micro_batches(10 * k + rank)[0]).loss.backward()
        opt.step()
        opt.zero_grad()

    def same(a, b):
        return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)

    out = {}
    model, opt = make("stationary")
    with opt:
        step(model, opt, 0)
        want = {name: value.clone() for name, value in model.state_dict().items()}
    model, opt = make("flow")
    with opt:
        step(model, opt, 0)
        together = model.state_dict()  # every rank
        out["together"] = same(together, want)
        out["released"] = all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
        opt.fetch_weights()
        if rank == 0:
            out["rank0_alone"] = same(model.state_dict(), want)
        else:
            try:
                model.state_dict()
                out["other_rank"] = None
            except RuntimeError as error:
                out["other_rank"] = str(error)
        saved_opt = [None] * world
        torch.distributed.all_gather_object(saved_opt, opt.state_dict())  # every rank's shard
        step(model, opt, 1)
        continued = model.state_dict()
    model, opt = make("flow")
    with opt:
        model.load_state_dict(together)  # every rank: each writes its shard of the host copies
        out["loaded"] = same(model.state_dict(), together)
        opt.load_state_dict(saved_opt)
        step(model, opt, 1)
        out["resumed"] = same(model.state_dict(), continued)
    return out


@pytest.mark.parametrize("sim", [False, True], ids=["cpu", "sim"])
def test_the_model_state_dict_under_data_parallel_flow_is_whole_on_every_rank_or_on_rank_0_after_fetch_weights(sim):
    results = run_ranks(_flow_state_dict_under_data_parallelism, 2, deadline_s=150,
                        env={"SUPEROFFLOAD_SIM_DEVICE": "1"} if sim else None)
    for rank, result in enumerate(results):
        assert result["together"] and result["released"], (rank, result)
        assert result["loaded"] and result["resumed"], (rank, result)
    assert results[0]["rank0_alone"], results[0]
    message = results[1]["other_rank"]
    assert message is not None and "rank 0" in message and "every rank together" in message, message


# ---- "auto" under data parallelism: one decision for every rank -----------------------------------
#
# The simulated device of rank 1 holds the weights but not the engine's device buffers as well,
# rank 0's everything: "auto" flows on both ranks (each deciding alone, rank 0 would keep them
# stationary and the ranks' collectives would part), and "stationary" is refused on both (rank 0's
# message says another rank's device is short).
def _auto_under_data_parallelism(rank, world):
    import torch

    from superoffload_hf import SuperOffloadAdamW
    from superoffload_hf.testing.sim import SimRuntime
    from _dp_train import engine_config, micro_batches, tiny_llama

    model = tiny_llama()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # rank 1: room for the weights (close() gathers them all back onto the device), not for the
    # engine's device buffers as well
    SimRuntime.reset_shared(**({"device_budget_bytes": weight_bytes * 9 // 8} if rank == 1 else {}))
    out = {}
    for weights in ("auto", "stationary"):
        try:
            with SuperOffloadAdamW(model.parameters(), model=model,
                                   config=engine_config(device_buckets=0, weights=weights)) as opt:
                model(**micro_batches(rank)[0]).loss.backward()
                opt.step()
                out[weights] = opt.describe()
        except torch.OutOfMemoryError as error:
            out[weights] = f"refused: {error}"
    SimRuntime.reset_shared()
    return out


def test_auto_under_data_parallelism_flows_on_every_rank_when_one_rank_s_device_is_too_small():
    zero, one = run_ranks(_auto_under_data_parallelism, 2, deadline_s=90, env={"SUPEROFFLOAD_SIM_DEVICE": "1"})
    for result in (zero, one):
        assert "weights flow: 6 units" in result["auto"], result["auto"]
        assert result["stationary"].startswith("refused: `weights: stationary`"), result["stationary"]
    assert "another rank's has not" in zero["stationary"] and "another rank's" not in one["stationary"]


# ---- close() under data-parallel flow on a device smaller than the weights ------------------------
#
# The model never fit: close() brings its weights back as host tensors, a unit at a time through
# the device (only a gather has a unit's whole weights), decided on every rank alike (rank 1's
# device could hold them all: it restores to the host too, or its gathers would wait for rank 0's).
# Gathering every unit onto the device, as close() did, exceeds rank 0's budget.
def _flow_closed_on_a_small_device(rank, world):
    import torch

    from superoffload_hf import SuperOffloadAdamW
    from superoffload_hf.testing.sim import SimRuntime
    from _dp_train import engine_config, micro_batches, params_digest, tiny_llama

    weight_bytes = sum(p.numel() * p.element_size() for p in tiny_llama().parameters())
    out = {}
    for budget in (None, weight_bytes * 3 // 4 if rank == 0 else None):
        SimRuntime.reset_shared(**({"device_budget_bytes": budget} if budget else {}))
        model = tiny_llama()
        with SuperOffloadAdamW(model.parameters(), model=model, config=engine_config(device_buckets=0, weights="flow")) as opt:
            for step in range(2):
                model(**micro_batches(step * world + rank)[0]).loss.backward()
                opt.step()
                opt.zero_grad()
        sim = SimRuntime.shared()
        out[budget] = {"digest": params_digest(model), "peak": sim.max_memory_allocated(),
                       "on_the_device": sim.memory_allocated(), "errors": list(sim.errors)}
        SimRuntime.reset_shared()
    return {"weight_bytes": weight_bytes, "roomy": out[None],
            "small": out[weight_bytes * 3 // 4] if rank == 0 else out[None]}


def test_close_under_flow_on_two_ranks_with_a_device_smaller_than_the_weights_restores_to_the_host():
    zero, one = run_ranks(_flow_closed_on_a_small_device, 2, deadline_s=120, env={"SUPEROFFLOAD_SIM_DEVICE": "1"})
    for result in (zero, one):
        assert not result["roomy"]["errors"] and not result["small"]["errors"], result
        assert result["small"]["digest"] == result["roomy"]["digest"] == zero["roomy"]["digest"]
    assert zero["roomy"]["on_the_device"] >= zero["weight_bytes"]  # fits: back on the device, as before
    small = zero["small"]
    assert small["peak"] <= zero["weight_bytes"] * 3 // 4 and small["on_the_device"] == 0, small
    assert one["small"]["on_the_device"] == 0, one["small"]  # its device had room: the host, as rank 0
