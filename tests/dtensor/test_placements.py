"""Shard / Replicate / Partial: equality, repr, validation."""

import pytest

from hyper_parallel.core.placement_types import (
    Partial,
    Replicate,
    Shard,
    check_placements,
    grad_placements_of,
)


def test_equality_hash_and_repr():
    assert Shard(0) == Shard(0) and Shard(0) != Shard(1) and Shard(0) != Replicate()
    assert Partial() == Partial("sum") and Partial("sum") != Partial("max")
    assert len({Shard(1), Shard(1), Replicate(), Replicate(), Partial(), Partial("avg")}) == 4
    assert [repr(p) for p in (Shard(1), Replicate(), Partial("min"))] == ["Shard(dim=1)", "Replicate()", "Partial(min)"]


def test_kind_queries():
    assert Shard(2).is_shard() and Shard(2).is_shard(2) and not Shard(2).is_shard(1)
    assert Replicate().is_replicate() and not Replicate().is_shard() and not Replicate().is_partial()
    assert Partial("avg").is_partial() and not Partial().is_replicate()


def test_validation_errors():
    with pytest.raises(TypeError, match=r"Shard\(dim\) needs an int tensor dimension, got '0'"):
        Shard("0")
    with pytest.raises(TypeError, match="got True"):
        Shard(True)
    with pytest.raises(ValueError, match="Partial reduce_op must be one of sum, avg, max, min, got 'prod'"):
        Partial("prod")
    with pytest.raises(ValueError, match=r"Shard\(dim=-3\) is out of range for a tensor with 2 dimensions"):
        Shard(-3).normalized(2)


def test_check_placements():
    assert check_placements([Shard(-1), Replicate()], 2, 3) == (Shard(2), Replicate())
    with pytest.raises(ValueError, match=r"1 placements \[Shard\(dim=0\)\] given for a 2-D mesh"):
        check_placements([Shard(0)], 2, 2)
    with pytest.raises(TypeError, match="got a single Placement"):
        check_placements(Shard(0), 1, 2)
    with pytest.raises(TypeError, match="must be Shard, Replicate or Partial, got 'S0'"):
        check_placements(["S0"], 1, 2)
    assert grad_placements_of([Partial("max"), Shard(0), Replicate()]) == (Replicate(), Shard(0), Replicate())
