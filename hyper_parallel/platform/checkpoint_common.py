"""What both frameworks' checkpoint code shares (no framework import): the error every rank raises,
the agreement of all ranks on an outcome, and the comparison of a checkpoint's entries with a model's.

An *entry spec* is ``(shape, dtype)`` (a tuple of ints and the dtype's name) for a tensor and ``None``
for a pickled value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

Spec = tuple[tuple[int, ...], str] | None
SHOWN = 8  # entries a message lists by name before "... and N more"


class CheckpointError(Exception):
    """A checkpoint could not be saved or loaded. Raised on every rank with the same message;
    ``failures`` maps each rank that failed to what went wrong there (its file and the cause). On the
    ranks that failed, the local exception is the ``__cause__``."""

    def __init__(self, action: str, path: str, failures: Mapping[int, str]) -> None:
        lines = [f"rank {r}: {why}" for r, why in sorted(failures.items())]
        super().__init__(f"could not {action} the checkpoint {path!r} (nothing was changed):\n  " + "\n  ".join(lines))
        self.action, self.path, self.failures = action, path, dict(failures)


class EngineError(RuntimeError):
    """A failure of the framework's checkpoint engine (torch's ``CheckpointException`` is no ``Exception``),
    as an ``Exception`` naming the rank and the folder; ``original`` is what the engine raised."""

    def __init__(self, rank: int, action: str, path: str, original: BaseException) -> None:
        super().__init__(f"rank {rank} could not {action} {path!r}: {describe(original)}")
        self.original = original


def describe(error: BaseException) -> str:
    """One line for an exception. torch's ``CheckpointException`` keeps the per-rank causes in
    ``failures`` (rank -> ``(exception, traceback)``): those are shown instead of its tracebacks."""
    inner = getattr(error, "failures", None)
    if isinstance(inner, Mapping) and not isinstance(error, CheckpointError):
        causes = []
        for rank, wrapped in sorted(inner.items()):
            cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            causes.append(f"rank {rank}: {type(cause).__name__}: {cause}")
        return f"{type(error).__name__}: " + "; ".join(causes)
    return f"{type(error).__name__}: {error}"


def agree(platform: Any, action: str, path: str, error: BaseException | None, where: str = "",
          payload: Any = None) -> list[Any]:
    """Every rank brings its outcome (``error`` or ``None``); when any rank failed, every rank raises one
    :class:`CheckpointError` naming each failed rank (``where``: the file or step it was at) and the cause.
    Otherwise returns every rank's ``payload`` in rank order. A collective over the world."""
    mine = None if error is None else (f"{where}: " if where else "") + describe(error)
    everyone = platform.all_gather_object((mine, payload))
    failures = {r: why for r, (why, _) in enumerate(everyone) if why is not None}
    if failures:
        raise CheckpointError(action, path, failures) from (error.original if isinstance(error, EngineError) else error)
    return [p for _, p in everyone]


def _listed(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:SHOWN])
    return shown + (f" ... and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def _spec_text(spec: Spec) -> str:
    return "a pickled value" if spec is None else f"shape {list(spec[0])} {spec[1]}"


def mismatches(saved: Mapping[str, Spec], wanted: Mapping[str, Spec], strict: bool,
               known: Iterable[str] | None = None) -> list[str]:
    """How the checkpoint's entries ``saved`` differ from the model's ``wanted`` (one line per kind of
    difference; empty when they match). ``known``: every key any rank of the job wants (a checkpoint in a
    format that every rank reads from whole holds the others' entries too); entries outside it are extra.
    ``strict=False`` allows missing and extra entries; a shape or dtype that differs is always an error."""
    problems = []
    known_keys = set(wanted) if known is None else set(known) | set(wanted)
    missing = [k for k in wanted if k not in saved]
    extra = [k for k in saved if k not in known_keys]
    if strict and missing:
        problems.append(f"the checkpoint lacks {len(missing)} entries the model has: {_listed(missing)}")
    if strict and extra:
        problems.append(f"the checkpoint holds {len(extra)} entries the model lacks: {_listed(extra)}")
    for key, spec in wanted.items():
        if key in saved and saved[key] != spec:
            problems.append(f"entry {key!r}: the checkpoint has {_spec_text(saved[key])}, the model {_spec_text(spec)}")
    return problems
