"""Saved-activation bytes of a torch stage forward (read from its autograd graph)."""

from __future__ import annotations

from typing import Any

import torch
from hyper_parallel.platform.base import ForwardRecord


def saved_bytes(record: ForwardRecord) -> int:
    """Bytes of the distinct storages the graph of ``record`` still saves for its backward,
    parameters excluded. Walks the nodes reachable from the outputs and reads what each saved
    (packed by the platform's saved-tensor hooks, or plain); what a custom autograd Function
    saved is not seen."""
    params = {p.untyped_storage().data_ptr() for p in record.params if isinstance(p, torch.Tensor)}
    seen_nodes: set[int] = set()
    storages: dict[int, int] = {}
    stack = [o.grad_fn for o in record.outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        for tensor in _saved_tensors(node):
            ptr = tensor.untyped_storage().data_ptr()
            if ptr and ptr not in params:
                storages[ptr] = tensor.untyped_storage().nbytes()
        stack.extend(next_node for next_node, _ in node.next_functions)
    return sum(storages.values())


def _saved_tensors(node: Any) -> list[torch.Tensor]:
    out = []
    for name in dir(type(node)):
        if not name.startswith("_raw_saved_"):
            continue
        try:
            raw = getattr(node, name)
        except RuntimeError:  # freed by a backward that ran already
            continue
        for item in raw if isinstance(raw, (list, tuple)) else (raw,):
            packed = getattr(item, "data", None) if item is not None else None
            tensor = getattr(packed, "tensor", packed)  # the platform's pack keeps ``.tensor``
            if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided:
                out.append(tensor)
    return out
