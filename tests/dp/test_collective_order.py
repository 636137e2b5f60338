"""The recorder's comparison of the ranks' collectives (superoffload_hf.testing.collective_order),
on made-up records; tests/_dist.py applies it to every multi-rank test."""

from __future__ import annotations

from superoffload_hf.testing.collective_order import Event, compare


def ev(group: str, op: str = "all_reduce", shape: tuple = (1,), ranks: tuple = (0, 1), thread: str = "MainThread"):
    return Event(group, ranks, op, shape, thread)


def test_the_same_collectives_in_the_same_order_on_every_rank_pass():
    ranks = [[ev("0"), ev("2", "all_gather_single", (8,), thread="worker"), ev("0")]] * 2
    assert compare(ranks) is None


def test_two_communicators_interleaved_in_opposite_orders_are_reported_naming_both_and_the_ranks():
    rank0 = [ev("2", "all_gather_single", (8,)), ev("0")]
    rank1 = [ev("0"), ev("2", "all_gather_single", (8,))]
    problem = compare([rank0, rank1])
    assert problem is not None
    assert problem.startswith("groups 0 [0, 1] and 2 [0, 1]: their collectives interleave in different orders"), problem
    assert "ranks 0 and 1 first differ at position 0" in problem, problem
    assert "all_gather_single[8] on group 2 [0, 1]" in problem, problem


def test_one_communicator_s_collectives_differing_in_operation_or_shape_are_reported():
    assert "group 0 [0, 1]: the collectives differ" in compare([[ev("0", shape=(2,))], [ev("0", shape=(3,))]])
    assert "group 0 [0, 1]: the collectives differ" in compare([[ev("0", "broadcast")], [ev("0")]])
    assert "position 1 (of 2 and 1)" in compare([[ev("0"), ev("0")], [ev("0")]])


def test_only_the_ranks_holding_both_communicators_are_compared():
    """Ranks 0, 1 share group 3, ranks 2, 3 share group 4: group 4's collectives interleave with
    the world's differently from group 3's, and that is no disagreement."""
    world = (0, 1, 2, 3)
    first = [ev("0", ranks=world), ev("3", ranks=(0, 1))]
    second = [ev("4", ranks=(2, 3)), ev("0", ranks=world)]
    assert compare([first, first, second, second]) is None
    assert compare([first, first, second, list(reversed(second))]) is not None
