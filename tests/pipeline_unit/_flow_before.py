# ruff: noqa
# Frozen copy of lowering/flow.py as of cd39060, read by _levels_before.py: the oracle for the
# speed test (test_levels_speed_equal.py). Do not edit.
"""The compute lists of a whole job read once, and executed once, without tensors.

``flow_of`` reads every rank's compute list into what each step waits for and makes (checking
what ``validate_compute`` checks step by step: kinds, placement, ranges); ``Flow.run`` then
executes the job in time linear in its steps (each step once, woken by the value it waits for),
which proves it free of deadlock (or finds it stuck), and carries one number per value along:
an eager clock entry of one rank (``rank_plan.py``) or the step's level (``levels.py``).
"""

from __future__ import annotations

from collections import defaultdict
from itertools import accumulate
from dataclasses import dataclass, field

from hyper_parallel.core.pipeline_parallel.ir.steps import DataKey, MetaStep, MetaStepType, Schedule

_T = MetaStepType
_BACKWARD = (_T.BWD, _T.BWD_INPUT)
_FEW = 8  # up to this many metadata receives on a channel, each one's place is a minimum of its own


@dataclass
class Flow:
    """The compute lists read once: per rank and step, the values it waits for and makes."""

    stage_to_rank: dict[int, int]
    items: dict[int, list[MetaStep]]
    needs: dict[int, list[list[DataKey]]]  # values a step waits for (its inputs; metadata put in its gap)
    makes: dict[int, list[list[DataKey]]]
    natural: dict[DataKey, int] = field(default_factory=dict)  # remote value -> index of its consumer
    channels: dict[tuple[int, int], list[DataKey]] = field(default_factory=lambda: defaultdict(list))
    """(sender, receiver) -> the data values sent, in the sender's order (FIFO)."""
    meta_gap: dict[DataKey, int] = field(default_factory=dict)  # carried forward value -> its RECV_META's gap

    meta_early: dict[DataKey, int] = field(default_factory=dict)
    """The same, at the earliest place ``prefetch`` can pull it to (each later data receive of its
    channel one step early): a wait there is stricter than at any place lowering picks."""
    waits: dict[str, dict[int, dict[int, list[DataKey]]]] = field(default_factory=dict)
    """"natural" / "early" -> rank -> step index -> values whose RECV_META waits right before it."""

    def run(self, rank: int | None, placement: str = "natural", levels: bool = False) -> dict[DataKey, int] | None:
        """Execute the compute job (each step once it has what it waits for, the metadata waits at
        ``placement``); None when a rank is stuck. Returns, per value, the last compute step of
        ``rank`` that its making follows; with ``levels``, the level of the step that made it
        instead: one more than the level of the step before it on its rank, and than the level
        of each step of its rank that made one of its inputs; two more than that of a step of
        another rank that did (``levels.py``)."""
        waits = self.waits.get(placement, {})
        step = 1 if levels else 0
        crossing = self.natural if levels else {}  # a value from another rank: one level more
        made: dict[DataKey, int] = {}
        waiting: dict[DataKey, list[int]] = {}
        cursor = dict.fromkeys(self.items, 0)
        last = dict.fromkeys(self.items, -1)
        ready = list(self.items)
        while ready:
            q = ready.pop()
            k, steps, needs, makes, clock = cursor[q], self.items[q], self.needs[q], self.makes[q], last[q]
            extra = waits.get(q, {})
            end = len(steps)
            while k < end:
                blocked = None
                value = clock + step
                more = extra.get(k)
                for key in (needs[k] + more if more else needs[k]):
                    seen = made.get(key)
                    if seen is None:
                        blocked = key
                        break
                    if key in crossing:
                        seen += 1
                    if seen + step > value:
                        value = seen + step
                if blocked is not None:
                    waiting.setdefault(blocked, []).append(q)
                    break
                clock = k if q == rank else value
                for key in makes[k]:
                    if key in made:
                        return None  # made twice
                    made[key] = clock
                    woken = waiting.pop(key, None)
                    if woken:
                        ready += woken
                k += 1
            cursor[q], last[q] = k, clock
        if any(cursor[q] < len(steps) for q, steps in self.items.items()):
            return None
        return made


def read_flow(compute: Schedule, stage_to_rank: dict[int, int], num_micro: int, forward_only: bool) -> Flow | None:
    """The flow of the compute lists, or None where they hold something the pass does not model
    or break a rule ``validate_compute`` checks locally (placement, ranges, step shapes)."""
    num_stages = len(stage_to_rank)
    ranks = set(stage_to_rank.values())
    if not all(type(x) is int for x in (*stage_to_rank, *ranks, *compute)) or type(num_micro) is not int \
            or sorted(stage_to_rank) != list(range(num_stages)) or not ranks <= set(compute):
        return None
    if any(step is not None for q in set(compute) - ranks for step in compute[q]):
        return None  # steps on a rank that holds no stage
    flow = Flow(stage_to_rank, {}, {}, {})
    owner = stage_to_rank
    natural = flow.natural
    # per stage: the channel list its forward output / input gradient goes to (None: same rank or none)
    ahead = [flow.channels[(owner[s], owner[s + 1])] if s + 1 < num_stages and owner[s + 1] != owner[s] else None
             for s in range(num_stages)]
    behind = [flow.channels[(owner[s], owner[s - 1])] if s > 0 and owner[s - 1] != owner[s] else None
              for s in range(num_stages)]
    fwd, bwd, bwd_input, bwd_weight = _T.FWD, _T.BWD, _T.BWD_INPUT, _T.BWD_WEIGHT
    last = num_stages - 1
    for q in sorted(compute):
        items = [step for step in compute[q] if step is not None]
        needs: list[list[DataKey]] = []
        makes: list[list[DataKey]] = []
        for k, step in enumerate(items):
            kind = step.meta_type
            if kind.is_overlap:
                parts = step.sub_steps or ()
                if len(parts) != 2 or sum(part.meta_type is fwd for part in parts) != 1 or not any(
                        part.meta_type in (bwd, bwd_input, bwd_weight) for part in parts):
                    return None
            elif step.sub_steps or not kind.is_compute:
                return None
            else:
                parts = (step,)
            wait: list[DataKey] = []
            make: list[DataKey] = []
            for part in parts:
                s, i, pk = part.stage_index, part.micro_index, part.meta_type
                if owner.get(s) != q or type(i) is not int or not 0 <= i < num_micro:
                    return None
                if pk is fwd:
                    if s > 0:
                        key = ("F", s - 1, i)
                        wait.append(key)
                        if behind[s] is not None:
                            natural[key] = k
                    key = ("F", s, i)
                    make.append(key)
                    if ahead[s] is not None:
                        ahead[s].append(key)
                elif pk is bwd or pk is bwd_input:
                    if forward_only:
                        return None
                    wait.append(("F", s, i))
                    if s < last:
                        key = ("G", s + 1, i)
                        wait.append(key)
                        if ahead[s] is not None:
                            natural[key] = k
                    key = ("G", s, i)
                    make.append(key)
                    if pk is bwd:
                        make.append(("W", s, i))
                    if behind[s] is not None:
                        behind[s].append(key)
                elif pk is bwd_weight:
                    if forward_only:
                        return None
                    wait.append(("G", s, i))  # its own I.s.m (made on this rank)
                    make.append(("W", s, i))
                else:
                    return None
            needs.append(wait)
            makes.append(make)
        flow.items[q], flow.needs[q], flow.makes[q] = items, needs, makes
    return flow


def _place_metadata(flow: Flow, metadata: str) -> bool:
    """Where lowering puts each RECV_META (``p2p._place_recvs``): the runtime waits there, so the
    step after it waits for the forward value's making too. ``natural``: every receive at its
    natural place (what lowering's dependency run sees); ``early``: every data receive without
    metadata of its own one step early (where ``prefetch`` may put it), which may pull a metadata
    receive of its channel earlier (FIFO). False when a value is sent to a rank that never
    consumes it (a step is missing there)."""
    natural = flow.natural
    for (_, receiver), sent in list(flow.channels.items()):
        try:
            gaps = [natural[key] for key in sent]
        except KeyError:
            return False
        if metadata == "none" or not sent:
            continue
        carried: dict[int, DataKey] = {}  # place in the channel -> value
        stages_seen: set[int] = set()
        for place, key in enumerate(sent):
            if key[0] == "F" and (metadata == "all" or key[1] not in stages_seen):
                stages_seen.add(key[1])
                carried[place] = key
        end = len(flow.items[receiver])
        for table, shift in ((flow.meta_gap, 0), (flow.meta_early, 1)):
            wanted = gaps if shift == 0 else [g if place in carried else max(0, g - 1) for place, g in enumerate(gaps)]
            # a metadata receive goes no later than any later receive of its channel (FIFO): the minimum of
            # the places wanted from its own on, the end of the list if none is earlier
            if len(carried) <= _FEW:  # metadata for the first value of each stage only: a few minima
                for place, key in carried.items():
                    table[key] = min(end, min(wanted[place:]))
                continue
            after = list(accumulate(reversed(wanted + [end]), min))[::-1]  # data receives: suffix minima (FIFO)
            meta = end
            for place in sorted(carried, reverse=True):  # metadata receives: suffix minima too
                meta = min(meta, after[place])
                table[carried[place]] = meta
    for name, table in (("natural", flow.meta_gap), ("early", flow.meta_early)):
        waits: dict[int, dict[int, list[DataKey]]] = defaultdict(lambda: defaultdict(list))
        for key, gap in table.items():
            waits[flow.stage_to_rank[key[1] + 1]][gap].append(key)
        flow.waits[name] = waits
    return True


def flow_of(compute: Schedule, stage_to_rank: dict[int, int], num_micro: int, metadata: str,
             forward_only: bool) -> Flow | None:
    flow = read_flow(compute, stage_to_rank, num_micro, forward_only)
    if flow is None or not _place_metadata(flow, metadata):
        return None
    return flow


def counts_complete(made: dict[DataKey, int], num_stages: int, num_micro: int, forward_only: bool) -> bool:
    """Every stage made every micro-batch's forward (and backward: its input gradient and its weight
    gradient) exactly once: values are made once (``run``) and lie in range (``_read``)."""
    total = num_stages * num_micro
    if forward_only:
        return len(made) == total
    return len(made) == 3 * total  # F, G and W of every (stage, micro), each once
