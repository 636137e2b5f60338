"""BucketPlan: pure data, no tensors."""

from __future__ import annotations

import pytest

from superoffload_hf.plan.buckets import BucketPlan, auto_bucket_numel

# A toy "model": 4 layers of (matrix 8x8, vector 8), registered in forward order.
SHAPES = [(8, 8), (8,)] * 4
ALL = [list(range(len(SHAPES)))]
DECAY_GROUPS = [[0, 2, 4, 6], [1, 3, 5, 7]]


def build(shapes=SHAPES, groups=ALL, bucket_numel=72, **kw) -> BucketPlan:
    return BucketPlan.build(shapes, groups, bucket_numel=bucket_numel, **kw)


def test_buckets_come_in_reverse_of_forward_order_by_default():
    plan = build()
    assert plan.ready_order() == list(range(len(SHAPES) - 1, -1, -1))
    assert [b.param_indices for b in plan.buckets] == [(7, 6), (5, 4), (3, 2), (1, 0)]


def test_slots_are_contiguous_and_offsets_match_sizes():
    plan = build(bucket_numel=200)
    for bucket in plan.buckets:
        offset = 0
        for slot in bucket.slots:
            assert slot.offset == offset and slot.numel == (64 if len(slot.shape) == 2 else 8)
            offset += slot.numel
        assert bucket.numel == offset


def test_every_parameter_is_in_exactly_one_bucket():
    plan = build(groups=DECAY_GROUPS, bucket_numel=100)
    indices = [i for b in plan.buckets for i in b.param_indices]
    assert sorted(indices) == list(range(len(SHAPES)))
    assert plan.locate()[5][1].index == 5


def test_a_bucket_never_exceeds_its_size_unless_one_parameter_does():
    plan = build(bucket_numel=70)
    assert all(b.numel <= 70 for b in plan.buckets)
    big = build(shapes=[(100,), (3,)], groups=[[0, 1]], bucket_numel=10)
    assert [b.numel for b in big.buckets] == [3, 100]


def test_param_groups_are_never_mixed_in_a_bucket():
    plan = build(groups=DECAY_GROUPS, bucket_numel=130)
    group_of = {i: g for g, members in enumerate(DECAY_GROUPS) for i in members}
    for bucket in plan.buckets:
        assert {group_of[i] for i in bucket.param_indices} == {bucket.group}


def test_interleaved_groups_do_not_fragment_the_plan():
    # Decay / no-decay alternate in forward order; each group packs into its own buckets.
    plan = build(groups=DECAY_GROUPS, bucket_numel=130)
    assert [b.param_indices for b in plan.buckets] == [(6, 4), (7, 5, 3, 1), (2, 0)]


def test_buckets_are_ordered_by_when_their_last_gradient_arrives():
    plan = build(groups=DECAY_GROUPS, bucket_numel=130)
    order = list(range(len(SHAPES) - 1, -1, -1))
    completion = [max(order.index(i) for i in b.param_indices) for b in plan.buckets]
    assert completion == sorted(completion)


def test_ready_order_given_is_followed():
    plan = build(ready_order=[0, 1, 2, 3, 4, 5, 6, 7])
    assert [b.param_indices for b in plan.buckets] == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_ready_order_may_omit_parameters_which_then_follow_in_reverse():
    plan = build(ready_order=[7, 0], bucket_numel=1000)
    assert plan.ready_order() == [7, 0, 6, 5, 4, 3, 2, 1]


def test_deferred_parameters_get_trailing_non_speculative_buckets():
    plan = build(deferred=[6, 0], bucket_numel=200)
    assert [b.speculative for b in plan.buckets] == [True, False]
    assert plan.buckets[-1].param_indices == (6, 0)
    assert 6 not in plan.buckets[0].param_indices


def test_the_last_buckets_are_device_resident():
    plan = build(device_buckets=2)
    assert [b.device_resident for b in plan.buckets] == [False, False, True, True]
    assert plan.num_device_buckets == 2
    assert build(device_buckets=99).num_device_buckets == 4
    assert build(device_buckets=0).num_device_buckets == 0


def test_building_twice_gives_equal_plans():
    kw = dict(groups=DECAY_GROUPS, bucket_numel=90, device_buckets=1, deferred=[3])
    assert build(**kw) == build(**kw)
    assert str(build(**kw)) == str(build(**kw))
    assert build(**kw) != build(**{**kw, "device_buckets": 2})


def test_the_plan_prints_one_row_per_bucket_with_placement_and_group():
    plan = build(groups=DECAY_GROUPS, bucket_numel=130, device_buckets=1,
                 group_labels=["lr=0.001 weight_decay=0.1", "lr=0.001 weight_decay=0"])
    text = str(plan)
    lines = text.splitlines()
    assert lines[0].startswith("BucketPlan: 3 buckets, 8 params, 288 elements")
    rows = [line.split() for line in lines[2:5]]
    assert [r[1] for r in rows] == ["host", "host", "device"]
    assert [r[3] for r in rows] == ["0", "1", "0"]
    assert rows[1][-1] == "7,5,3,1" and rows[0][-1] == "6,4"
    assert str(build(bucket_numel=1000, ready_order=[0, 1, 7, 6])).endswith("0-1,7-2")
    assert "group 1: lr=0.001 weight_decay=0" in text


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "32"])
def test_bad_bucket_sizes_raise(bad):
    with pytest.raises(ValueError, match="bucket_numel"):
        build(bucket_numel=bad)


def test_bad_device_bucket_counts_raise():
    with pytest.raises(ValueError, match="device_buckets"):
        build(device_buckets=-1)


def test_groups_must_partition_the_parameters():
    with pytest.raises(ValueError, match="no param group"):
        build(groups=[[0, 1, 2]])
    with pytest.raises(ValueError, match="two groups"):
        build(groups=[list(range(8)), [3]])


def test_bad_ready_orders_raise():
    with pytest.raises(ValueError, match="ready_order"):
        build(ready_order=[1, 1])
    with pytest.raises(ValueError, match="ready_order"):
        build(ready_order=[8])


def test_auto_bucket_size_is_32_mb_but_gives_small_models_four_buckets_on_an_accelerator():
    assert auto_bucket_numel("auto", 10**9) == 32 * 2**20 // 4
    assert auto_bucket_numel("auto", 1000) == 250
    assert auto_bucket_numel("auto", 1) == 1
    assert auto_bucket_numel(1.0, 10**9) == 2**18
    with pytest.raises(ValueError, match="bucket_size_mb"):
        auto_bucket_numel(0, 100)
    # the CPU device (layout.py MachineFacts.inline_host): no shrinking, buckets overlap nothing there
    assert auto_bucket_numel("auto", 1000, min_buckets=1) == 1000
    assert auto_bucket_numel("auto", 10**9, min_buckets=1) == 32 * 2**20 // 4
    assert auto_bucket_numel(1.0, 10**9, min_buckets=1) == 2**18


@pytest.mark.parametrize("device_mode", ["cpu", pytest.param("sim", marks=pytest.mark.sim)], indirect=True)
def test_auto_buckets_on_the_cpu_device_are_one_per_group_for_a_small_model(device_mode):
    """Host jobs run inline on the CPU device: one bucket per param group (each bucket costs
    Python time per step there and overlaps nothing). The simulated device stands for an
    accelerator: a small model still gets at least four buckets."""
    from superoffload_hf import SuperOffloadAdamW

    from _models import decay_groups, tiny_llama

    model = tiny_llama(2)
    with SuperOffloadAdamW(decay_groups(model, 1e-3, 0.01), config={"device_dtype": "fp32"}) as opt:
        groups = {b.group for b in opt.plan.buckets}
        if device_mode == "cpu":
            assert len(opt.plan.buckets) == len(groups) == 2, str(opt.plan)
        else:
            assert len(opt.plan.buckets) >= 4, str(opt.plan)


def test_the_guessed_order_interleaves_param_groups_as_the_model_does():
    """The Trainer's groups (decay: matrices; no-decay: norms, biases) each list parameters in
    model order. With one parameter per bucket the plan's order is the guessed ready order: each
    group reversed, the groups interleaved in proportion (not one group after the other, which
    would make a data-parallel launch order wait for the no-decay bucket at the end)."""
    shapes = [(4, 4)] * 6 + [(16,)] * 3
    plan = BucketPlan.build(shapes, [[0, 1, 2, 3, 4, 5], [6, 7, 8]], bucket_numel=16)
    assert plan.ready_order() == [8, 5, 4, 7, 3, 2, 6, 1, 0]
    one_group = BucketPlan.build(shapes, [list(range(9))], bucket_numel=16)
    assert one_group.ready_order() == list(range(8, -1, -1))


def test_aligned_slots_start_at_multiples_of_the_group_and_gaps_are_the_padding():
    shapes = [(33,), (1,), (32,), (5, 7)]
    plan = build(shapes=shapes, groups=[[0, 1, 2, 3]], bucket_numel=1000, align=32)
    (bucket,) = plan.buckets
    assert [(s.index, s.offset, s.numel) for s in bucket.slots] == [(3, 0, 35), (2, 64, 32), (1, 96, 1), (0, 128, 33)]
    assert bucket.numel == 161 and plan.param_numel == 101 and plan.total_numel == 161
    assert bucket.gaps == ((35, 64), (97, 128))
    assert build(shapes=shapes, groups=[[0, 1, 2, 3]], bucket_numel=1000).buckets[0].gaps == ()
    assert "slots aligned to 32 elements" in str(plan)


def test_aligned_packing_counts_the_padding_towards_the_bucket_size():
    # unaligned, 33 + 1 + 31 = 65 fit in 65; aligned, the padding makes the third one spill
    shapes = [(31,), (1,), (33,)]
    assert len(build(shapes=shapes, groups=[[0, 1, 2]], bucket_numel=65).buckets) == 1
    plan = build(shapes=shapes, groups=[[0, 1, 2]], bucket_numel=65, align=32)
    assert [b.param_indices for b in plan.buckets] == [(2, 1), (0,)]
    assert all(b.numel <= 65 for b in plan.buckets)


def test_runs_never_span_the_padding_between_slots():
    from superoffload_hf.engine.state.stepper import plan_runs

    plan = build(shapes=[(32,), (3,), (32,)], groups=[[0, 1, 2]], bucket_numel=1000, align=32)
    (bucket,) = plan.buckets  # slots: 2 at 0, 1 at 32 (3 elements), 0 at 64
    runs = plan_runs(bucket, [True] * 3, [0, 0, 0])
    assert [(r.offset, r.numel, r.slots) for r in runs] == [(0, 35, (0, 1)), (64, 32, (2,))]
    assert all(r.offset % 32 == 0 for r in runs)
