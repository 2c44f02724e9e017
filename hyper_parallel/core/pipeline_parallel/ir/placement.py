"""Stage placement: which rank holds which pipeline stage."""

from __future__ import annotations


def is_int(value: object) -> bool:
    """An int that is not a bool (``True`` is an int to Python, never a count or an index here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int (not a bool), else raise TypeError naming it."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return value  # type: ignore[return-value]


def check_flag(name: str, value: object) -> bool:
    """Return ``value`` if it is a bool, else raise TypeError naming it (``"False"`` or ``0.0`` are
    truthy or falsy by accident, never a switch)."""
    if isinstance(value, bool):
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool"):  # numpy.bool_, e.g. from a config array
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r} ({kind.__name__})")


def check_count(name: str, value: object, minimum: int) -> int:
    """Return ``value`` if it is an int (not a bool) >= ``minimum``, else raise ValueError."""
    if not is_int(value) or value < minimum:  # type: ignore[operator]
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def looped_placement(num_ranks: int, num_chunks: int) -> dict[int, int]:
    """Stage ``c * num_ranks + r`` -> rank ``r`` (interleaved / looped schedules)."""
    p = check_count("num_ranks", num_ranks, 1)
    v = check_count("num_chunks", num_chunks, 1)
    return {c * p + r: r for c in range(v) for r in range(p)}


def v_placement(num_ranks: int) -> dict[int, int]:
    """Stages ``r`` and ``2 * num_ranks - 1 - r`` -> rank ``r`` (ZB-V, DualPipeV)."""
    p = check_count("num_ranks", num_ranks, 1)
    placement = {r: r for r in range(p)}
    placement.update({2 * p - 1 - r: r for r in range(p)})
    return dict(sorted(placement.items()))


def stages_of_rank(stage_to_rank: dict[int, int], rank: int) -> list[int]:
    """Sorted stages that ``stage_to_rank`` puts on ``rank``."""
    return sorted(stage for stage, owner in stage_to_rank.items() if owner == rank)
