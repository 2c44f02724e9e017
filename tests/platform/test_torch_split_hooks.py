"""torch stage autograd against plain autograd where hooks, outside leaves and in-place ops meet it.

* Hooks at the dx/dW boundary (issue 21, item 1): a tensor hook on a weight-consuming op's output,
  on the stage output, a node prehook, an observing hook with ``retain_grad``, on a custom-function
  boundary node: the full backward, the split (``stage_backward_input`` + ``stage_backward_weight``)
  and plain ``Tensor.backward`` give the same input and parameter gradients, and every hook runs
  exactly once per backward.
* Leaves outside the stage's parameter list (item 4): the split gives them the gradient the full
  backward gives.
* In-place changes of saved tensors (item 3): the saved-tensor pool raises torch's error where
  torch raises it (pool and no pool, full and split, and through an activation swap), and valid
  in-place ops still run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hyper_parallel.platform.activations.swap import SwapGroup  # noqa: E402
from hyper_parallel.platform.torch import TorchPlatform  # noqa: E402
from hyper_parallel.platform.torch.activations import TorchSavedOps, _HostCopies  # noqa: E402

P = TorchPlatform()
INPLACE = "modified by an inplace operation"


def _rand(*shape: int, seed: int) -> Any:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class _PyLinear(torch.autograd.Function):
    """x @ w in Python: a boundary node that is a custom function."""

    @staticmethod
    def forward(ctx, x, w):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        x, w = ctx.saved_tensors
        return g @ w.t(), x.t() @ g


@dataclass
class Case:
    """A two-layer stage whose forward puts hooks on its graph; ``calls`` counts hook runs."""

    hooks: Callable[[Case, dict[str, Any]], None]  # called with the forward's tensors by name
    python_first_layer: bool = False
    calls: dict[str, int] = field(default_factory=dict)
    seen: dict[str, Any] = field(default_factory=dict)  # retained gradients, by name

    def __post_init__(self) -> None:
        self.w1 = torch.nn.Parameter(_rand(4, 6, seed=1) * 0.5)
        self.b1 = torch.nn.Parameter(_rand(6, seed=2) * 0.1)
        self.w2 = torch.nn.Parameter(_rand(6, 3, seed=3) * 0.5)
        self.params = [self.w1, self.b1, self.w2]

    def count(self, name: str, scale: float | None = None) -> Callable[[Any], Any]:
        def hook(g: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            return None if scale is None else g * scale

        return hook

    def forward(self, x: Any) -> Any:
        mm = _PyLinear.apply(x, self.w1) if self.python_first_layer else x @ self.w1
        h = mm + self.b1  # the add consumes the input-side mm and the weight b1: a boundary node
        t = torch.tanh(h)
        y = t @ self.w2
        self.hooks(self, {"mm": mm, "h": h, "t": t, "y": y})
        return y


def _tensor_hook_on_boundary_output(c: Case, v: dict[str, Any]) -> None:
    v["h"].register_hook(c.count("h", 2.0))


def _hook_on_stage_output(c: Case, v: dict[str, Any]) -> None:
    v["y"].register_hook(c.count("y", 3.0))


def _prehook_on_boundary_node(c: Case, v: dict[str, Any]) -> None:
    def prehook(grads: tuple[Any, ...]) -> tuple[Any, ...]:
        c.calls["pre"] = c.calls.get("pre", 0) + 1
        return tuple(None if g is None else g * 0.5 for g in grads)

    v["h"].grad_fn.register_prehook(prehook)


def _observing_hook_with_retain_grad(c: Case, v: dict[str, Any]) -> None:
    v["h"].retain_grad()
    c.seen["h"] = v["h"]
    v["h"].register_hook(c.count("h"))


def _hook_on_custom_function_output(c: Case, v: dict[str, Any]) -> None:
    v["mm"].register_hook(c.count("mm", 2.0))


def _tensor_hook_and_prehook_on_one_node(c: Case, v: dict[str, Any]) -> None:
    v["h"].register_hook(c.count("h", 2.0))
    _prehook_on_boundary_node(c, v)
    v["y"].register_hook(c.count("y", -1.0))


def _hook_off_the_boundary(c: Case, v: dict[str, Any]) -> None:
    v["t"].register_hook(c.count("t", 2.0))  # tanh's output: input side, not a boundary output


HOOKS = {
    "tensor_hook_on_boundary_output": (_tensor_hook_on_boundary_output, False),
    "hook_on_stage_output": (_hook_on_stage_output, False),
    "prehook_on_boundary_node": (_prehook_on_boundary_node, False),
    "observing_hook_with_retain_grad": (_observing_hook_with_retain_grad, False),
    "hook_on_custom_function_boundary": (_hook_on_custom_function_output, True),
    "tensor_hook_and_prehook_on_one_node": (_tensor_hook_and_prehook_on_one_node, False),
    "hook_off_the_boundary": (_hook_off_the_boundary, False),
}


def _run(case: Case, mode: str) -> tuple[Any, list[Any], dict[str, int], dict[str, Any]]:
    """(dx, parameter gradients, hook calls, retained gradients) of one backward in ``mode``."""
    for p in case.params:
        p.grad = None
    case.calls.clear()
    case.seen.clear()
    x, dy = _rand(5, 4, seed=0), _rand(5, 3, seed=9)
    if mode == "plain":
        leaf = x.clone().requires_grad_(True)
        case.forward(leaf).backward(dy)
        dx = leaf.grad
    else:
        rec = P.stage_forward(case.forward, (x,), {}, case.params, (True,))
        if mode == "full":
            (dx,) = P.stage_backward(rec, (dy,))
        else:
            (dx,) = P.stage_backward_input(rec, (dy,))
            P.stage_backward_weight(rec)
    retained = {k: t.grad.clone() for k, t in case.seen.items()}
    return dx.clone(), [p.grad.clone() for p in case.params], dict(case.calls), retained


@pytest.mark.parametrize("name", list(HOOKS))
def test_full_backward_split_and_plain_autograd_agree_with_hooks_at_the_boundary(name):
    hooks, python = HOOKS[name]
    case = Case(hooks, python_first_layer=python)
    plain = _run(case, "plain")
    no_hook = _run(Case(lambda c, v: None, python_first_layer=python), "plain")
    # the hook changes the weight gradients (or observes them): the case is not vacuous
    assert plain[2] and all(n == 1 for n in plain[2].values()), plain[2]
    if name != "observing_hook_with_retain_grad":
        assert not torch.allclose(plain[1][0], no_hook[1][0])
    for mode in ("full", "split"):
        dx, grads, calls, retained = _run(case, mode)
        torch.testing.assert_close(dx, plain[0], rtol=1e-6, atol=1e-7, msg=f"{mode}: dx")
        for i, (g, want) in enumerate(zip(grads, plain[1])):
            torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-7, msg=f"{mode}: gradient of parameter {i}")
        assert calls == plain[2], f"{mode}: hook calls {calls}, plain autograd {plain[2]}"
        for k, g in retained.items():
            torch.testing.assert_close(g, plain[3][k], rtol=1e-6, atol=1e-7, msg=f"{mode}: retained {k}.grad")


def test_split_of_two_stages_with_hooks_accumulates_like_two_full_backwards():
    # two micro-batches of one hooked stage: dx, dx, dW, dW (as a zero-bubble schedule runs them)
    case = Case(_tensor_hook_and_prehook_on_one_node)
    x = [_rand(5, 4, seed=s) for s in (0, 1)]
    dy = [_rand(5, 3, seed=s) for s in (7, 8)]

    def run(split: bool) -> list[Any]:
        for p in case.params:
            p.grad = None
        recs = [P.stage_forward(case.forward, (xi,), {}, case.params, (True,)) for xi in x]
        if split:
            for rec, g in zip(recs, dy):
                P.stage_backward_input(rec, (g,))
            for rec in recs:
                P.stage_backward_weight(rec)
        else:
            for rec, g in zip(recs, dy):
                P.stage_backward(rec, (g,))
        return [p.grad.clone() for p in case.params]

    for got, want in zip(run(True), run(False)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------- leaves outside the stage
@pytest.mark.parametrize("mode", ["full", "split"])
def test_a_trainable_tensor_outside_the_parameter_list_gets_its_gradient(mode):
    # the last stage with its loss: the loss function's own scale is no stage parameter
    w = torch.nn.Parameter(_rand(4, 3, seed=1))
    scale = torch.nn.Parameter(torch.tensor(1.5))
    target = _rand(5, 3, seed=2)

    def fn(x: Any) -> Any:
        return (((x @ w) * scale - target) ** 2).mean()

    x = _rand(5, 4, seed=0)
    leaf = x.clone().requires_grad_(True)
    fn(leaf).backward()
    want = (leaf.grad.clone(), w.grad.clone(), scale.grad.clone())
    w.grad = scale.grad = None
    rec = P.stage_forward(fn, (x,), {}, [w], (True,))
    if mode == "full":
        (dx,) = P.stage_backward(rec, (torch.ones(()),))
    else:
        (dx,) = P.stage_backward_input(rec, (torch.ones(()),))
        assert scale.grad is None and w.grad is None  # dx leaves every gradient to dW
        P.stage_backward_weight(rec)
    assert scale.grad is not None, "the loss function's parameter got no gradient"
    for got, ref in zip((dx, w.grad, scale.grad), want):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------- in-place changes
def _lin() -> tuple[Any, Any]:
    return torch.nn.Parameter(_rand(4, 6, seed=1) * 0.5), torch.nn.Parameter(_rand(6, 3, seed=3) * 0.5)


def _relu_then_add(w1: Any, w2: Any) -> Callable[[Any], Any]:
    def fn(x: Any) -> Any:
        h = (x @ w1).relu_()  # relu_ saves its result...
        h.add_(1.0)  # ...which this changes: its backward would read the wrong values
        return h @ w2

    return fn


def _backward(rec: Any, mode: str, dy: Any) -> None:
    if mode == "full":
        P.stage_backward(rec, (dy,))
    else:
        P.stage_backward_input(rec, (dy,))
        P.stage_backward_weight(rec)


@pytest.mark.parametrize("pool, mode", [(True, "full"), (True, "split"), (False, "full")])
def test_a_saved_tensor_changed_in_place_raises_like_torch(pool, mode):
    w1, w2 = _lin()
    fn = _relu_then_add(w1, w2)
    leaf = _rand(5, 4, seed=0).requires_grad_(True)
    with pytest.raises(RuntimeError, match=INPLACE):
        fn(leaf).backward(_rand(5, 3, seed=9))  # plain torch raises
    rec = P.stage_forward(fn, (_rand(5, 4, seed=0),), {}, [w1, w2], (True,), saved_pool=pool)
    with pytest.raises(RuntimeError, match=f"{INPLACE}.*at version 2; expected version 1"):
        _backward(rec, mode, _rand(5, 3, seed=9))


def _valid_inplace_ops(w1: Any, w2: Any) -> Callable[[Any], Any]:
    def fn(x: Any) -> Any:
        a = x @ w1  # mm does not save its output
        a.add_(1.0)  # an in-place op on a tensor nobody saved
        b = a * 1.0
        b.mul_(0.5)  # bumped before anything saves it...
        c = torch.tanh(b)  # ...then saved (tanh saves its result) and never changed again
        d = (c * 2.0).relu_()  # relu_ saves its result at the version relu_ made, as torch does
        e = d[:, :3] @ w2[:3]  # a view of the saved tensor, used, not changed
        f = torch.zeros(5, 3)
        f[:, 0] = e[:, 0]  # in-place writes into a fresh tensor
        return e + f

    return fn


@pytest.mark.parametrize("pool, mode", [(True, "full"), (True, "split"), (False, "full")])
def test_valid_in_place_ops_still_run(pool, mode):
    w1, w2 = _lin()
    fn = _valid_inplace_ops(w1, w2)
    x, dy = _rand(5, 4, seed=0), _rand(5, 3, seed=9)
    leaf = x.clone().requires_grad_(True)
    fn(leaf).backward(dy)
    want = [leaf.grad.clone(), w1.grad.clone(), w2.grad.clone()]
    w1.grad = w2.grad = None
    rec = P.stage_forward(fn, (x,), {}, [w1, w2], (True,), saved_pool=pool)
    if mode == "full":
        (dx,) = P.stage_backward(rec, (dy,))
    else:
        (dx,) = P.stage_backward_input(rec, (dy,))
        P.stage_backward_weight(rec)
    for got, ref in zip((dx, w1.grad, w2.grad), want):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


def _swapped_record(fn: Callable[[Any], Any], params: list[Any], change: Callable[[], None] | None) -> Any:
    """A forward whose saved activations go to the host and come back before the backward;
    ``change`` runs between the forward and the offload."""
    rec = P.stage_forward(fn, (_rand(5, 4, seed=0),), {}, params, (True,))
    ops = TorchSavedOps(P)
    items = [i for i in (ref() for ref in rec.native.pool.items) if i is not None and i.tensor is not None
             and ops.computed(i.tensor)]
    assert items
    if change is not None:
        change()
    group = SwapGroup(ops, _HostCopies(), items)
    group.launch_offload()
    group.finish_offload()
    assert all(i.tensor is None for i in items)
    return rec


@pytest.mark.parametrize("mode", ["full", "split"])
def test_swapped_activations_are_checked_when_they_leave(mode):
    w1, w2 = _lin()
    kept: dict[str, Any] = {}

    def fn(x: Any) -> Any:
        kept["h"] = h = torch.tanh(x @ w1)  # tanh saves its result
        return h @ w2

    dy = _rand(5, 3, seed=9)
    # unchanged before the offload: the copy that comes back is not checked again
    rec = _swapped_record(fn, [w1, w2], None)
    _backward(rec, mode, dy)
    assert w1.grad is not None
    # changed in place between the forward and the offload: the backward raises
    rec = _swapped_record(fn, [w1, w2], lambda: kept["h"].mul_(2.0))
    with pytest.raises(RuntimeError, match=INPLACE):
        _backward(rec, mode, dy)


class _ReluThenAdd(torch.nn.Module):
    def __init__(self, bad: bool) -> None:
        super().__init__()
        self.l1, self.l2, self.bad = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3), bad

    def forward(self, x: Any) -> Any:
        h = self.l1(x).relu_()  # relu_ saves its result
        if self.bad:
            h.add_(1.0)  # ...which this changes (plain torch raises)
        return self.l2(h)


@pytest.mark.parametrize("mode", ["full", "split"])
def test_a_recomputed_tensor_changed_in_place_raises_like_torch(mode):
    # checkpoint_wrapper drops what the forward saves and the re-run saves it again: the re-run
    # changes it in place exactly as the forward did, so the check applies to what the re-run saved
    from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper

    torch.manual_seed(0)
    dy = _rand(5, 3, seed=9)
    for bad in (False, True):
        module = checkpoint_wrapper(_ReluThenAdd(bad))
        rec = P.stage_forward(module, (_rand(5, 4, seed=0),), {}, list(module.parameters()), (True,))
        if not bad:
            _backward(rec, mode, dy)  # valid: runs
            continue
        with pytest.raises(RuntimeError, match=INPLACE):
            _backward(rec, mode, dy)


# ---------------------------------------------------------------------------- documented limits
def test_module_backward_hooks_that_change_gradients_run_once():
    lin1, lin2 = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)
    calls: list[str] = []
    handles = [
        lin2.register_full_backward_pre_hook(lambda m, go: (calls.append("pre"), tuple(g * 2 for g in go))[1]),
        lin2.register_full_backward_hook(
            lambda m, gi, go: (calls.append("post"), tuple(None if g is None else g * 3 for g in gi))[1]),
    ]
    params = [*lin1.parameters(), *lin2.parameters()]
    x, dy = _rand(5, 4, seed=0), _rand(5, 3, seed=9)

    def fn(a: Any) -> Any:
        return lin2(torch.tanh(lin1(a)))

    def run(mode: str) -> tuple[list[Any], list[str]]:
        for p in params:
            p.grad = None
        calls.clear()
        if mode == "plain":
            leaf = x.clone().requires_grad_(True)
            fn(leaf).backward(dy)
            dx = leaf.grad
        else:
            rec = P.stage_forward(fn, (x,), {}, params, (True,))
            (dx,) = P.stage_backward_input(rec, (dy,))
            P.stage_backward_weight(rec)
        return [dx.clone(), *(p.grad.clone() for p in params)], list(calls)

    try:
        want, want_calls = run("plain")
        got, got_calls = run("split")
    finally:
        for h in handles:
            h.remove()
    assert got_calls == want_calls == ["pre", "post"]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_a_node_posthook_at_the_boundary_runs_once_in_dx():
    # docs/zero_bubble.md: such a posthook runs in the input step only, with None for the weight
    # outputs (which the weight step computes without it): dx as in plain autograd, one call
    w1, w2 = _lin()
    seen: list[tuple[bool, ...]] = []

    def fn(x: Any) -> Any:
        h = x @ w1
        h.grad_fn.register_hook(lambda gi, go: seen.append(tuple(g is None for g in gi)))
        return torch.tanh(h) @ w2

    x, dy = _rand(5, 4, seed=0), _rand(5, 3, seed=9)
    leaf = x.clone().requires_grad_(True)
    fn(leaf).backward(dy)
    assert seen == [(False, False)]
    seen.clear()
    rec = P.stage_forward(fn, (x,), {}, [w1, w2], (True,))
    (dx,) = P.stage_backward_input(rec, (dy,))
    P.stage_backward_weight(rec)
    assert seen == [(False, True)], seen
    torch.testing.assert_close(dx, leaf.grad, rtol=1e-6, atol=1e-7)


def test_a_multi_grad_hook_across_the_boundary_fires_once_per_step():
    # docs/zero_bubble.md: torch.autograd.graph.register_multi_grad_hook fires once per engine run
    # that reaches one of its tensors; over a tensor that depends on the input and one computed
    # from parameters only it fires in I (with None for the latter) and again in W
    w1, w2 = _lin()
    seen: list[tuple[bool, ...]] = []

    def fn(x: Any) -> Any:
        h = x @ w1
        w = w2 * 1.0  # computed from a parameter only: the weight side
        torch.autograd.graph.register_multi_grad_hook((h, w), lambda gs: seen.append(tuple(g is None for g in gs)))
        return torch.tanh(h) @ w

    x, dy = _rand(5, 4, seed=0), _rand(5, 3, seed=9)
    fn(x.clone().requires_grad_(True)).backward(dy)
    assert seen == [(False, False)]
    seen.clear()
    rec = P.stage_forward(fn, (x,), {}, [w1, w2], (True,))
    P.stage_backward_input(rec, (dy,))
    P.stage_backward_weight(rec)
    assert seen == [(False, True), (True, False)], seen
