"""A dx/dW split of one stage backward that runs each backward formula once.

Terms, for the autograd graph of one stage forward seen from its outputs:

* the *input side* is every node from which a differentiable stage input can be reached;
* the *weight side* is every other node from which a leaf that takes a gradient can be reached:
  the stage's parameters and any other trainable tensor the forward used (a loss function's own
  parameter, a tensor from outside the module), all of which a full backward reaches too;
* a *boundary node* is an input-side node with edges into the weight side (the ``mm`` of
  ``x @ W.t()``: ``x`` is on the input side, ``W.t()`` on the weight side); those edges are its
  *weight edges*.

dx pass (:meth:`SplitPlan.run_input`): one engine run from the outputs to the inputs. The engine
runs only nodes on a path to a target, so no weight-side node runs and each boundary node computes
only its outputs toward the input side. The hooks at a boundary node (tensor hooks on its outputs,
``retain_grad``, node prehooks) run in this run, once, as in a full backward; a prehook that the
plan adds after them keeps the gradient the node then receives, every hook applied.

dW pass (:meth:`SplitPlan.run_weight`): every boundary node is called once more on that gradient,
and must now compute only its weight-edge outputs. A direct call runs no hook, so none runs twice.
A backward formula asks the engine run it is part of which outputs are wanted (the run's targets);
called outside any run it computes them all. So the calls are made from inside a tiny engine run
whose targets are exactly the weight edges: its one node is a custom function whose backward makes
the calls. The outputs then go, as roots, into one last engine run that takes them through the
weight side into the leaves' ``.grad`` (accumulating exactly like a full backward; the hooks of
weight-side tensors run there). Nothing walks the input side again.

Boundary nodes defined in Python (custom ``autograd.Function``) cannot be called that way, and
need not be: a custom function computes every output its ``needs_input_grad`` asks for, so the dx
run already computed its weight-edge outputs; a posthook the plan adds keeps them for dW.

The calls depend on engine internals (``Node.__call__`` and the per-run output mask), so
:func:`direct_calls_work` checks them once on a tiny graph; if they ever misbehave the split falls
back to walking the graph again for dW (correct values, but it recomputes dx and runs the hooks of
the input side a second time).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.autograd.variable import Variable

_logger = logging.getLogger("hyper_parallel")


def run_engine(roots: Sequence[Any], grads: Sequence[Any], keep_graph: bool, targets: Sequence[Any],
               accumulate: bool) -> tuple[Any, ...]:
    """The autograd engine, called directly: roots and targets are tensors or ``GradientEdge``s
    (no targets with ``accumulate``: every leaf reached, as ``Tensor.backward``)."""
    return Variable._execution_engine.run_backward(
        tuple(roots), tuple(grads), keep_graph, False, tuple(targets), True, accumulate_grad=accumulate
    )


class _InsideRun(torch.autograd.Function):
    """One-node graph whose backward calls ``callback`` while its engine run is the current one."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, callback: Callable[[], None]) -> torch.Tensor:
        ctx.callback = callback
        return anchor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        callback, ctx.callback = ctx.callback, None
        callback()
        return None, None


def call_masked(targets: Sequence[GradientEdge], callback: Callable[[], None]) -> None:
    """Run ``callback`` inside an engine run whose only wanted outputs are ``targets``."""
    anchor = torch.zeros((), requires_grad=True)
    with torch.enable_grad():
        out = _InsideRun.apply(anchor, callback)
    run_engine((out,), (torch.ones(()),), False, (anchor, *targets), False)


@dataclass
class _Boundary:
    node: Node
    weight: tuple[int, ...]  # indices of the weight edges among node.next_functions
    edges: tuple[GradientEdge, ...]  # the weight edges themselves
    python: bool  # a custom-function node: its hook keeps its weight-edge outputs, not its inputs
    seen: list[Any]  # what the hook on the node kept when the dx pass ran it


@dataclass
class SplitPlan:
    """Where the dx pass captures gradients and what the dW pass does with them."""

    boundary: list[_Boundary]  # parents before children
    weight_roots: list[tuple[GradientEdge, Any]]  # stage outputs computed from weight-side leaves only
    dx_only: list[Node]  # input-side nodes that run in dx and never again (see dx_only_saved)
    # per boundary node, what its hook kept in dx: the gradients at its inputs, hooks applied (for
    # a custom function: its weight-edge outputs); None where the dx pass did not run the node
    captured: list[Any] = field(default_factory=list)

    def boundary_saved(self) -> Iterator[Any]:
        """What the boundary nodes saved for their backward, as packed by saved-tensor hooks
        (plain tensors where no hook packed them); read without unpacking."""
        return _packed(b.node for b in self.boundary)

    def dx_only_saved(self) -> Iterator[Any]:
        """The same for the nodes that only dx runs: every input-side node but the boundary ones
        (dW runs no input-side node: it calls the built-in boundary nodes directly). A
        custom-function node is never listed: its backward may unpack its saved tensors more than
        once."""
        return _packed(self.dx_only)

    def run_input(self, roots: Sequence[Any], root_grads: Sequence[Any], leaves: Sequence[Any]) -> tuple[Any, ...]:
        """Input gradients (``None`` where unreached); keeps the boundary gradients for dW."""
        if not leaves:
            return ()
        found = run_engine(roots, root_grads, True, leaves, False)
        self.captured = [b.seen.pop() if b.seen else None for b in self.boundary]
        return tuple(found)

    def run_weight(self) -> None:
        """Accumulate the weight-side gradients into ``.grad``; drops everything kept for it."""
        edges: list[GradientEdge] = []
        values: list[Any] = []
        try:
            work = [(b, g) for b, g in zip(self.boundary, self.captured)
                    if g is not None and any(x is not None for x in g)]
            native = [(b, g) for b, g in work if not b.python]
            if native:
                targets = list({e: None for b, _ in native for e in b.edges})

                def call_all() -> None:
                    for b, grads in native:
                        outs = b.node(*grads)
                        for k, edge in zip(b.weight, b.edges):
                            if outs[k] is not None:
                                edges.append(edge)
                                values.append(outs[k])

                call_masked(targets, call_all)
            for b, outs in work:
                if b.python:
                    for edge, grad in zip(b.edges, outs):
                        if grad is not None:
                            edges.append(edge)
                            values.append(grad)
            for edge, grad in self.weight_roots:
                edges.append(edge)
                values.append(grad)
            if edges:
                run_engine(edges, values, False, (), True)
        finally:
            self.boundary, self.captured, self.weight_roots = [], [], []


def _keep_weight_outputs(weight: tuple[int, ...], seen: list[Any]) -> Callable[..., None]:
    """Posthook for a custom-function boundary node: keeps its weight-edge outputs."""

    def hook(grad_inputs: tuple[Any, ...], _grad_outputs: tuple[Any, ...]) -> None:
        seen.append(tuple(grad_inputs[k] for k in weight))

    return hook


def plan_split(root_edges: Sequence[GradientEdge], root_grads: Sequence[Any], leaves: Sequence[Any]) -> SplitPlan:
    """Walk the graph below ``root_edges`` once, find the boundary nodes and put on each the hook
    that keeps what dW needs when the dx pass runs it. ``leaves``: the differentiable inputs;
    every other leaf that takes a gradient is on the weight side."""
    leaf_ids = {id(t) for t in leaves}
    nexts: dict[Node, Any] = {}
    input_side: set[Node] = set()
    weight_side: set[Node] = set()
    boundary: list[_Boundary] = []
    dx_only: list[Node] = []
    for root in root_edges:  # post-order walk: a node is classified once all its children are
        if root.node in nexts:
            continue
        nexts[root.node] = nf = root.node.next_functions
        stack = [(root.node, iter(nf))]
        while stack:
            node, it = stack[-1]
            for child, _ in it:
                if child is not None and child not in nexts:
                    nexts[child] = cnf = child.next_functions
                    stack.append((child, iter(cnf)))
                    break
            else:
                stack.pop()
                nf = nexts[node]
                if not nf:
                    var = getattr(node, "variable", None)  # an AccumulateGrad
                    if var is not None:
                        (input_side if id(var) in leaf_ids else weight_side).add(node)
                    continue
                to_input = to_weight = False
                for child, _ in nf:
                    if child in input_side:
                        to_input = True
                    elif child in weight_side:
                        to_weight = True
                if to_input:
                    input_side.add(node)
                    if to_weight:
                        weight = tuple(k for k, (c, _) in enumerate(nf) if c in weight_side)
                        seen: list[Any] = []
                        python = not callable(node)
                        if python:
                            node.register_hook(_keep_weight_outputs(weight, seen))
                        else:  # added last: runs after the hooks already there, sees what the node gets
                            node.register_prehook(seen.append)
                        boundary.append(_Boundary(node, weight, tuple(GradientEdge(*nf[k]) for k in weight),
                                                  python, seen))
                    elif callable(node):
                        dx_only.append(node)
                elif to_weight:
                    weight_side.add(node)
    boundary.reverse()
    weight_roots = [(edge, grad) for edge, grad in zip(root_edges, root_grads) if edge.node in weight_side]
    return SplitPlan(boundary, weight_roots, dx_only)


def _packed(nodes: Iterable[Node]) -> Iterator[Any]:
    for node in nodes:
        for name in _raw_saved_names(type(node)):
            raw = getattr(node, name)
            for item in raw if isinstance(raw, (list, tuple)) else (raw,):
                if item is not None:
                    yield item.data


_RAW_SAVED: dict[type, tuple[str, ...]] = {}


def _raw_saved_names(node_type: type) -> tuple[str, ...]:
    names = _RAW_SAVED.get(node_type)
    if names is None:
        names = _RAW_SAVED[node_type] = tuple(a for a in dir(node_type) if a.startswith("_raw_saved_"))
    return names


def gradient_edges(tensors: Sequence[torch.Tensor]) -> list[GradientEdge]:
    """The engine edge each tensor's gradient enters by (its ``grad_fn`` or its accumulator)."""
    return [get_gradient_edge(t) for t in tensors]


_CHECK: list[str | None] = []
_CHECK_LOCK = threading.Lock()


def direct_calls_work() -> bool:
    """Whether masked direct node calls compute exactly the wanted outputs (checked once)."""
    with _CHECK_LOCK:
        if not _CHECK:
            try:
                _CHECK.append(_self_test())
            except Exception as exc:  # noqa: BLE001 - any failure means: do not use the calls
                _CHECK.append(f"{type(exc).__name__}: {exc}")
            if _CHECK[0] is not None:
                _logger.warning("hyper_parallel: torch dx/dW split falls back to a second graph walk for dW "
                                "(%s)", _CHECK[0])
    return _CHECK[0] is None


def _self_test() -> str | None:
    x = torch.tensor([[1.0, 2.0]], requires_grad=True)
    w = torch.tensor([[3.0], [4.0]], requires_grad=True)
    with torch.enable_grad():
        y = x @ w
    plan = plan_split(gradient_edges([y]), [torch.ones(1, 1)], [x])
    if len(plan.boundary) != 1:
        return f"found {len(plan.boundary)} boundary nodes in x @ w, expected 1"
    (dx,) = plan.run_input([y], [torch.ones(1, 1)], [x])
    got: list[Any] = []
    b, grads = plan.boundary[0], plan.captured[0]
    call_masked(b.edges, lambda: got.extend(b.node(*grads)))
    if got[0] is not None:
        return "a masked call still computed the input-side output"
    if got[1] is None or got[1].flatten().tolist() != [1.0, 2.0] or dx.flatten().tolist() != [3.0, 4.0]:
        return f"masked call gave {got}, dx {dx}"
    return None
