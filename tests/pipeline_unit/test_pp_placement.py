"""Stage placement helpers."""

import pytest

from hyper_parallel.core.pipeline_parallel.ir.placement import looped_placement, stages_of_rank, v_placement


def test_looped_placement():
    assert looped_placement(3, 2) == {0: 0, 1: 1, 2: 2, 3: 0, 4: 1, 5: 2}
    assert looped_placement(1, 1) == {0: 0}


def test_v_placement():
    assert v_placement(3) == {0: 0, 1: 1, 2: 2, 3: 2, 4: 1, 5: 0}
    assert v_placement(1) == {0: 0, 1: 0}


def test_stages_of_rank():
    assert stages_of_rank(looped_placement(4, 3), 1) == [1, 5, 9]
    assert stages_of_rank(v_placement(4), 0) == [0, 7]
    assert stages_of_rank(v_placement(4), 9) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 1), "num_ranks must be an int >= 1, got 0"),
        ((2, 0), "num_chunks must be an int >= 1, got 0"),
        ((True, 2), "num_ranks must be an int >= 1, got True"),
        ((2.0, 1), "num_ranks must be an int >= 1, got 2.0"),
        ((-1, 1), "num_ranks must be an int >= 1, got -1"),
    ],
)
def test_looped_placement_rejects_bad_counts(args, message):
    with pytest.raises(ValueError, match=message):
        looped_placement(*args)


def test_v_placement_rejects_bad_counts():
    with pytest.raises(ValueError, match="num_ranks"):
        v_placement(0)
