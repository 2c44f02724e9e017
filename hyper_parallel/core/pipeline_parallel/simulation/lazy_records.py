"""Trace records made on first use.

A large simulation holds millions of trace records (``{"rank", "step", "kind", "start", "end"}``,
see ``trace.py``), and most callers (the chart, the tuner, the summary numbers) never read them.
`lazy_records` turns the ``records`` field of a dataclass into a property: a `RecordSource`
given for it is built into the list the first time ``records`` is read, a list is kept as it is.
Every reader sees a plain list of dicts, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

_C = TypeVar("_C")


class RecordSource:
    """The recipe of a list of trace records, run once when the list is first needed."""

    def __init__(self, build: Callable[[], list[dict[str, Any]]]) -> None:
        self._build = build

    def build(self) -> list[dict[str, Any]]:
        return self._build()


_SLOT = "_records_or_source"


def lazy_records(cls: _C) -> _C:
    """Class decorator (after ``@dataclass``): ``records`` accepts a list or a `RecordSource`."""

    def get(self: Any) -> list[dict[str, Any]]:
        value = self.__dict__.get(_SLOT)
        if isinstance(value, RecordSource):
            value = value.build()
            self.__dict__[_SLOT] = value
        return value

    def put(self: Any, value: list[dict[str, Any]] | RecordSource) -> None:
        self.__dict__[_SLOT] = value

    def getstate(self: Any) -> dict[str, Any]:
        get(self)  # a pickle holds the records themselves, not how to build them
        return dict(self.__dict__)

    cls.records = property(get, put, doc="The trace records (built on first use from a RecordSource).")  # type: ignore[attr-defined]
    cls.__getstate__ = getstate  # type: ignore[attr-defined]
    return cls


def records_or_source(obj: Any) -> list[dict[str, Any]] | RecordSource:
    """What ``obj.records`` holds, without building it."""
    return obj.__dict__.get(_SLOT, [])
