"""Ulysses sequence parallelism (superoffload_hf/parallel): the all-to-all against a gather
reference (values and gradients), the batch shard (labels shifted before the split), and tiny
Llamas with 8 query / 2 key-value heads trained over SP=2, SP=4 and SP=2 x DP=2 on gloo, equal to
one process on the same global batch, clipping on (tests/_sp_train.py)."""

from __future__ import annotations

import pytest
import torch

from _dist import run_ranks
from superoffload_hf.config import ConfigError, SuperOffloadConfig, check_sequence_parallel_size
from superoffload_hf.parallel.sequence_shard import IGNORE_INDEX, shard_sequence, shift_labels
from superoffload_hf.parallel.ulysses import kv_heads_for

import _sp_train


# ---- training equals one process ----------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_sp_train.scenarios, 2, [dict(sp_size=2, attn="sdpa", seq=31, padded=True)], deadline_s=200)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sp2_dp2"))


@pytest.fixture(scope="module")
def four_ranks(saved):
    """One spawn: SP=4; SP=2 x DP=2 (eager); SP=2 x DP=2 saved after 2 steps, then resumed from
    those files as SP=4 (DP 1: both replicas' batches as one; fresh model and optimizer)."""
    runs = [dict(sp_size=4, attn="sdpa", seq=30, padded=True), dict(sp_size=2, attn="eager", seq=30, padded=True),
            dict(sp_size=2, steps=2, save_dir=saved),
            dict(sp_size=4, replicas=2, start_step=2, steps=2, load_dir=saved)]
    return run_ranks(_sp_train.scenarios, 4, runs, deadline_s=200)


def _check_groups(per_rank: list, run: int, sp_size: int) -> None:
    """Each rank compared itself with one process (_sp_train.train asserts loss, norm and every
    parameter per step); here: the ranks of one SP group report one loss, replicas differ."""
    results = [r[run] for r in per_rank]
    assert [r["dp_rank"] for r in results] == [rank // sp_size for rank in range(len(results))]
    for r in results:
        assert r["losses"] == results[r["dp_rank"] * sp_size]["losses"]
        assert r["digest"] == results[0]["digest"]  # the same parameters everywhere
        assert len(r["losses"]) == r["steps"]
    if len(results) > sp_size:
        assert results[0]["losses"] != results[sp_size]["losses"]  # two replicas, two batches


def test_sp2_with_an_odd_length_and_right_padding_equals_one_process(two_ranks):
    _check_groups(two_ranks, 0, 2)


def test_sp4_replicates_the_two_kv_heads_and_equals_one_process(four_ranks):
    _check_groups(four_ranks, 0, 4)


def test_sp2_by_dp2_with_eager_attention_equals_one_process_on_both_replicas_batches(four_ranks):
    _check_groups(four_ranks, 1, 2)


def test_a_checkpoint_of_sp2_by_dp2_resumes_on_sp4_with_the_numbers_of_one_uninterrupted_process(four_ranks):
    # each rank compared its resumed steps 2, 3 with the stock reference continued from the same files
    # (itself equal to the SP=2 x DP=2 run's steps 0, 1 within 1e-5)
    _check_groups(four_ranks, 2, 2)
    _check_groups(four_ranks, 3, 4)


def test_a_checkpoint_of_sp2_by_dp2_resumes_on_one_process_with_the_same_numbers(four_ranks, saved):
    (one,) = run_ranks(_sp_train.scenarios, 1, [dict(sp_size=1, replicas=2, start_step=2, steps=2, load_dir=saved)],
                       deadline_s=200)
    resumed_on_four = four_ranks[0][3]
    assert one[0]["losses"] == pytest.approx(resumed_on_four["losses"], rel=1e-5)
    assert one[0]["norms"] == pytest.approx(resumed_on_four["norms"], rel=1e-5)


# ---- the all-to-all --------------------------------------------------------------------------------


def _full(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _all_to_all_checks(rank: int, world: int) -> bool:
    import torch.distributed as dist

    from superoffload_hf.parallel.ulysses import heads_to_seq, seq_to_heads

    group = dist.new_group(list(range(world)))
    b, h, s, d = 2, 2 * world, 3 * world, 5
    heads, seq = slice(rank * h // world, (rank + 1) * h // world), slice(rank * s // world, (rank + 1) * s // world)
    x_full, w_full = _full((b, h, s, d), 1), _full((b, h, s, d), 2)
    x = x_full[:, :, seq].clone().requires_grad_(True)
    out = seq_to_heads(x, group)
    torch.testing.assert_close(out, x_full[:, heads], rtol=0, atol=0)
    # the sum over ranks of (out * w) is (x_full * w_full).sum(): its gradient is w_full, by sequence part
    (out * w_full[:, heads]).sum().backward()
    torch.testing.assert_close(x.grad, w_full[:, :, seq], rtol=0, atol=0)
    # back: (B, S, H/N, D) head-sharded -> (B, S/N, H, D)
    y_full = _full((b, s, h, d), 3)
    y = y_full[:, :, heads].clone().requires_grad_(True)
    back = heads_to_seq(y, group)
    torch.testing.assert_close(back, y_full[:, seq], rtol=0, atol=0)
    v_full = _full((b, s, h, d), 4)
    (back * v_full[:, seq]).sum().backward()
    torch.testing.assert_close(y.grad, v_full[:, :, heads], rtol=0, atol=0)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_the_all_to_all_and_its_gradient_equal_slices_of_the_gathered_tensor(world):
    assert run_ranks(_all_to_all_checks, world, deadline_s=120) == [True] * world


def test_head_counts_that_do_not_split_over_the_ranks_are_refused_with_the_fix():
    assert kv_heads_for(2, 8, 2) == 2 and kv_heads_for(2, 8, 4) == 4 and kv_heads_for(8, 8, 4) == 8
    with pytest.raises(ValueError, match="8 attention heads.*multiple of `sequence_parallel_size` 3"):
        kv_heads_for(2, 8, 3)
    with pytest.raises(ValueError, match="4 ranks with 6 key/value heads"):
        kv_heads_for(6, 12, 4)


# ---- the batch shard -----------------------------------------------------------------------------


def _pairs(shards: list[dict]) -> list[tuple[int, int, int]]:
    """(row, input token, target) for every non-ignored target, in sequence order."""
    ids = torch.cat([s["input_ids"] for s in shards], dim=1)
    targets = torch.cat([s["shift_labels"] for s in shards], dim=1)
    return [(r, int(ids[r, t]), int(targets[r, t])) for r in range(ids.shape[0]) for t in range(ids.shape[1])
            if int(targets[r, t]) != IGNORE_INDEX]


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_labels_shifted_before_the_split_keep_every_target_at_the_shard_edges(size):
    ids = torch.arange(24).reshape(2, 12) + 100
    shards = [shard_sequence({"input_ids": ids}, r, size) for r in range(size)]
    expected = [(r, int(ids[r, t]), int(ids[r, t + 1])) for r in range(2) for t in range(11)]
    assert _pairs(shards) == expected  # 22 targets: none lost where a shard ends
    for r, s in enumerate(shards):
        assert s["input_ids"].shape == (2, 12 // size)
        torch.testing.assert_close(s["position_ids"], torch.arange(r * 12 // size, (r + 1) * 12 // size).expand(2, -1))
    if size > 1:  # shard 0's last token's target is shard 1's first token
        assert int(shards[0]["shift_labels"][0, -1]) == int(shards[1]["input_ids"][0, 0])


def test_a_length_not_divisible_by_the_ranks_is_padded_with_ignored_targets():
    ids = torch.arange(7).unsqueeze(0) + 10
    shards = [shard_sequence({"input_ids": ids, "labels": ids}, r, 4, pad_token_id=0) for r in range(4)]
    assert torch.cat([s["input_ids"] for s in shards], 1).tolist() == [[10, 11, 12, 13, 14, 15, 16, 0]]
    assert torch.cat([s["position_ids"] for s in shards], 1).tolist() == [list(range(8))]
    assert torch.cat([s["shift_labels"] for s in shards], 1).tolist() == [[11, 12, 13, 14, 15, 16, -100, -100]]


def test_right_padding_ignores_the_pads_targets_and_pre_shifted_labels_are_taken_as_they_are():
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    whole = shard_sequence({"input_ids": ids, "attention_mask": mask}, 0, 1)
    assert whole["shift_labels"].tolist() == [[2, 3, 4, -100], [6, 0, -100, -100]]
    given = torch.tensor([[7, 8, 9, -100]])
    assert shard_sequence({"input_ids": ids[:1], "shift_labels": given}, 1, 2)["shift_labels"].tolist() == [[9, -100]]
    assert shift_labels(torch.tensor([[1, 2, 3]])).tolist() == [[2, 3, -100]]


@pytest.mark.parametrize("batch, message", [
    ({"input_ids": torch.ones(1, 4, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 0, 1]])},
     "row 0 goes from 1 to 0 at token 2: packed sequences"),
    ({"input_ids": torch.ones(1, 4, dtype=torch.long), "attention_mask": torch.tensor([[0, 1, 1, 1]])},
     "left or inner padding.*padding_side='right'"),
    ({"input_ids": torch.ones(1, 4, dtype=torch.long), "token_type_ids": torch.zeros(1, 4)},
     r"\['token_type_ids'\] are not understood"),
    ({"input_ids": torch.ones(1, 4, dtype=torch.long), "labels": torch.ones(1, 4, dtype=torch.long),
      "shift_labels": torch.ones(1, 4, dtype=torch.long)}, "both `labels` and `shift_labels`"),
    ({"input_ids": torch.ones(1, 4, dtype=torch.long), "labels": torch.ones(1, 3, dtype=torch.long)},
     r"`labels` has shape \(1, 3\)"),
])
def test_batches_the_shard_cannot_split_correctly_are_refused_saying_why(batch, message):
    with pytest.raises(ValueError, match=message):
        shard_sequence(batch, 0, 2)


def _padded_batch(left: bool = False, step: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.arange(16).reshape(2, 8) + 10 * step
    mask = torch.ones(2, 8, dtype=torch.long)
    if left:
        mask[1, :3] = 0  # row 1 padded on the left
    else:
        mask[1, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask, "position_ids": torch.arange(8).expand(2, 8)}


def test_the_batch_checks_read_nothing_on_the_host_after_the_first_batch_and_report_a_bad_one_a_call_late():
    """On a GPU `bool(...)`, `.nonzero()` and `.tolist()` of device data each synchronise the
    device (before: 2 `__bool__` reads a batch with position_ids and a mask, more when one is bad):
    the simulated device counts them; after the first batch there are none."""
    from superoffload_hf.parallel.sequence_shard import BatchChecks
    from superoffload_hf.testing.sim import SimRuntime

    sim = SimRuntime()
    try:
        checks = BatchChecks(sim)
        shard_sequence(_padded_batch(), 0, 2, check=checks)  # the first batch: read at once
        with sim.count_host_reads() as reads:
            shards = [shard_sequence(_padded_batch(step=step), 1, 2, check=checks) for step in range(1, 4)]
            shard_sequence(_padded_batch(left=True), 0, 2, check=checks)  # bad: not read yet
        assert reads == {}, reads
        assert shards[0]["shift_labels"].tolist() == [[15, 16, 17, -100], [23, -100, -100, -100]]  # the pads ignored
        with pytest.raises(ValueError, match=r"the batch before this one \(checked a call late, not to "
                                             r"synchronise the device\): `attention_mask` row 1 has a real token "
                                             r"after a pad"):
            shard_sequence(_padded_batch(), 0, 2, check=checks)
        checks = BatchChecks(sim)
        with pytest.raises(ValueError, match=r"shard_batch: `attention_mask` row 1 has a real token after a pad"):
            shard_sequence(_padded_batch(left=True), 0, 2, check=checks)  # the first: at once
        packed = {"input_ids": torch.ones(1, 4, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 0, 1]])}
        shard_sequence(packed, 0, 2, check=checks)
        with pytest.raises(ValueError, match=r"before this one.*`position_ids` row 0 goes from 1 to 0 at token 2"):
            checks.settle(wait=True)
    finally:
        sim.close()


# ---- configuration -------------------------------------------------------------------------------


def test_sequence_parallel_size_is_a_positive_int_that_divides_the_world():
    assert SuperOffloadConfig().sequence_parallel_size == 1
    assert SuperOffloadConfig(sequence_parallel_size=4).sequence_parallel_size == 4
    for bad in (0, -2, 2.0, True, "2"):
        with pytest.raises(ConfigError, match="`sequence_parallel_size` is"):
            SuperOffloadConfig(sequence_parallel_size=bad)
    check_sequence_parallel_size(2, 4)
    with pytest.raises(ConfigError, match="is 3 but the world has 4 processes.*multiple of 3.*divisor of 4"):
        check_sequence_parallel_size(3, 4)


def test_sequence_parallel_groups_without_torch_distributed_say_what_to_call():
    from superoffload_hf.parallel import sequence_parallel_groups

    with pytest.raises(ValueError, match="init_process_group"):
        sequence_parallel_groups(1)
    with pytest.raises(ConfigError, match="is 2 but the world has 1 processes"):
        sequence_parallel_groups(2)


def test_the_optimizer_refuses_a_sequence_parallel_size_its_world_cannot_hold():
    from superoffload_hf import SuperOffloadAdamW

    params = [torch.nn.Parameter(torch.zeros(4))]
    with pytest.raises(ConfigError, match="`sequence_parallel_size` is 2 but the world has 1 processes"):
        SuperOffloadAdamW(params, lr=1e-3, config={"sequence_parallel_size": 2, "device_dtype": "fp32"})


@pytest.fixture
def one_rank_world(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield dist.new_group([0])
    finally:
        dist.destroy_process_group()


def test_one_rank_gives_the_models_own_loss_and_gradients_and_refuses_unsharded_calls(one_rank_world):
    from superoffload_hf.parallel import SequenceParallel

    batch = _sp_train.replica_batch(0, 0, 12, padded=True)
    ref = _sp_train.sp_llama("sdpa")
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    model = _sp_train.sp_llama("sdpa")
    sp = SequenceParallel(model, one_rank_world)
    assert model.config._attn_implementation == "ulysses_sdpa"
    loss = sp(**sp.shard_batch(batch))
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
    shard = sp.shard_batch(batch)
    with pytest.raises(ValueError, match="`attention_mask` was passed.*shard_batch"):
        sp(**shard, attention_mask=batch["attention_mask"])
    with pytest.raises(ValueError, match="`labels` was passed"):
        sp(**shard, labels=batch["labels"])


def test_the_sampler_gives_the_ranks_of_one_sp_group_the_same_samples_and_replicas_different_ones():
    from superoffload_hf.parallel import SequenceParallelGroups

    dataset = list(range(16))
    drawn = {}
    for rank in range(4):  # DP 2 x SP 2
        groups = SequenceParallelGroups(size=2, rank=rank % 2, dp_size=2, dp_rank=rank // 2, group=None)
        drawn[rank] = list(groups.sampler(dataset, seed=3))
    assert drawn[0] == drawn[1] and drawn[2] == drawn[3]
    assert sorted(drawn[0] + drawn[2]) == dataset  # the two replicas split the data


def test_attention_the_wrapper_cannot_split_correctly_is_refused_saying_why(one_rank_world):
    from superoffload_hf.parallel.ulysses import UlyssesAttention, register

    with pytest.raises(ValueError, match="'no_such' is not registered.*'sdpa'"):
        register(one_rank_world, "no_such")
    with pytest.raises(ValueError, match="the model's is 'ulysses_sdpa'"):
        register(one_rank_world, "ulysses_sdpa")
    attention = UlyssesAttention(one_rank_world, "sdpa")
    q = k = v = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"attention mask of shape \(1, 1, 4, 4\).*shard_batch"):
        attention(None, q, k, v, torch.zeros(1, 1, 4, 4))
    with pytest.raises(ValueError, match="packed sequences"):
        attention(None, q, k, v, None, cu_seq_lens_q=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="sliding-window attention"):
        attention(None, q, k, v, None, sliding_window=2)


def test_the_trainer_refuses_evaluation_under_sequence_parallelism(tmp_path):
    from _models import tiny_llama

    from superoffload_hf.integrations.trainer import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, max_steps=1, report_to=[], eval_strategy="steps",
                             eval_steps=1, superoffload_config={"sequence_parallel_size": 2})
    with pytest.raises(ValueError, match="`sequence_parallel_size` is 2 with `eval_strategy` 'steps'"):
        Trainer(model=tiny_llama(num_layers=1), args=args, eval_dataset=[{"input_ids": torch.zeros(4, dtype=torch.long)}])


def test_training_arguments_sequence_parallel_size_reaches_the_plugin_over_the_config(tmp_path):
    from superoffload_hf.integrations.trainer import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], sequence_parallel_size=4,
                             superoffload_config={"speculation": "on", "sequence_parallel_size": 2})
    assert args.superoffload and args.superoffload_plugin().explicit_fields() == {"speculation": "on",
                                                                                  "sequence_parallel_size": 4}
    with pytest.raises(ValueError, match="sequence_parallel_size"):
        TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], sequence_parallel_size=0)


def test_the_forward_waits_for_the_optimizers_queued_gathers_before_its_first_all_to_all(one_rank_world,
                                                                                         monkeypatch):
    from superoffload_hf.parallel import SequenceParallel, ulysses

    events = []
    exchange = ulysses._all_to_all
    monkeypatch.setattr(ulysses, "_all_to_all", lambda *a: (events.append("all-to-all"), exchange(*a))[1])

    class Optimizer:  # records the call SuperOffloadAdamW.before_collective answers
        def before_collective(self):
            events.append("before_collective")

    sp = SequenceParallel(_sp_train.sp_llama("sdpa", layers=1), one_rank_world, optimizer=Optimizer())
    sp(**sp.shard_batch(_sp_train.replica_batch(0, 0, 8, padded=False)))
    assert events[0] == "before_collective" and events.count("before_collective") == 1
    assert events[1:] == ["all-to-all"] * 4  # q, k, v in and the output back
