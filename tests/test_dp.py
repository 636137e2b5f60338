"""Data parallelism on gloo: 2 and 4 local processes train a tiny Llama with SuperOffloadAdamW;
every rank checks its parameters after every step against stock AdamW + clip_grad_norm_ + skip
applied to the rank-averaged gradient (tests/_dp_train.py), and the ranks' parameters are
compared bitwise here."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest

from _dist import run_ranks
from _dp_train import train

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
    from superoffload_hf.engine.dp import GradientAfterLaunchError
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


FOUR_RANKS = {
    "nonfinite_on_rank3_clip_mild": dict(speculation="on", clip="mild", steps=5, poison_rank=3, poison_steps=(2,)),
    "sharded_within_pairs_replicated_across": dict(speculation="on", clip="mild", steps=4, shard_group_size=2),
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

    from superoffload_hf.engine.shard_checkpoint import export_consolidated

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
