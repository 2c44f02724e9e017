"""Issue 21 corners on MindSpore LocalCluster (small: PyNative is slow): the MPipe recompute
backward replays the owner's random state (dropout in the preprocess), T=0 takes nn.Identity, and
ZB-H1 / ZB-V on stages with a gradient-scaling tensor hook match the non-pipelined model, and a
loss_fn Cell's own Parameter gets the non-pipelined gradient under 1F1B / ZB-H1 / ZB-V (engine and
recompute paths), put back by a failed run."""

from __future__ import annotations

import numpy as np
import pytest
from mpipe_harness import TOL, Case, check, data, mindspore_modules, mse

from hyper_parallel.core.pipeline_parallel.features.mpipe.transpose import ScheduleMPipeTranspose
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster

ms = pytest.importorskip("mindspore")
DROP = 0.5


def _drop_encoder(encoder):
    from mindspore import nn, ops

    class DropEncoder(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.enc, self.log = encoder, []

        def construct(self, image, tokens):
            h, tokens = self.enc(image, tokens)
            out = ops.dropout(h, p=DROP)  # draws from the process-wide (ops) random state
            self.log.append((image.asnumpy().copy(), (out.asnumpy() != 0)))
            return out, tokens

    return DropEncoder()


def _rank(case: Case, kind: str) -> dict:
    p = get_platform()
    layers = 1 if kind == "dropout" else 0
    encoder, bodies = mindspore_modules(p.world_size, layers, True)
    pre = _drop_encoder(encoder) if kind == "dropout" else ms.nn.Identity()
    stage = PipelineStage(bodies[p.rank], p.rank, p.world_size)
    schedule = ScheduleMPipeTranspose(stage, case.micro, pre, layers, loss_fn=mse, **case.options())
    image, tokens, target = data(case)
    ms.set_seed(100 + p.rank)
    out = schedule.run(ms.Tensor(image), ms.Tensor(tokens), target=ms.Tensor(target))
    grads = {name: p.to_numpy(g).copy() for name, g in schedule.named_gradients().items()}
    return {"rank": p.rank, "losses": [[float(x.asnumpy()) for x in out]], "grads": grads,
            "log": getattr(pre, "log", []), "owners": [schedule.owner_of(j) for j in range(case.micro)]}


@pytest.mark.timeout(300)
def test_mpipe_t0_takes_the_identity_cell():
    case = Case("t0-identity", 1, 3, 0)
    check(case, LocalCluster(2, platform="mindspore").run(_rank, case, "identity"), "mindspore")


def _oracle(case: Case, num_stages: int, masks: list[np.ndarray]) -> tuple[list[float], dict[str, np.ndarray]]:
    encoder, bodies = mindspore_modules(num_stages, 1, True)
    image, tokens, target = (ms.Tensor(a) for a in data(case))
    per = case.per_micro
    names = [(f"stage{s}.{prm.name}", prm) for s, b in enumerate(bodies) for prm in b.trainable_params()]
    names += [(f"preprocess.{prm.name}", prm) for prm in _drop_encoder(encoder).trainable_params()]  # its names

    def micro_loss(j: int):
        rows = slice(j * per, (j + 1) * per)
        h, tok = encoder(image[rows], tokens[rows])
        h = bodies[0](h * ms.Tensor(masks[j].astype(np.float32)) / (1 - DROP), tok)
        for body in bodies[1:]:
            h = body(h)
        return ((h - target[rows]) ** 2).mean()

    losses = [float(micro_loss(j).asnumpy()) for j in range(case.micro)]

    def total():
        out = micro_loss(0) / case.micro
        for j in range(1, case.micro):
            out = out + micro_loss(j) / case.micro
        return out

    _, grads = ms.value_and_grad(total, None, weights=[prm for _, prm in names])()
    return losses, {name: g.asnumpy() for (name, _), g in zip(names, grads)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("owner_backward", [False, True], ids=["recompute", "owner"])
def test_mpipe_dropout_preprocess_matches_the_non_pipelined_model(owner_backward):
    case = Case("dropout", 1, 3, 1, owner_backward=owner_backward)
    results = LocalCluster(2, platform="mindspore").run(_rank, case, "dropout")
    image, per = data(case)[0], case.per_micro
    masks = []
    for j in range(case.micro):
        rows = image[j * per:(j + 1) * per]
        calls = {r["rank"]: [m for img, m in r["log"] if np.array_equal(img, rows)] for r in results}
        owner = results[0]["owners"][j]
        forward = calls[owner][0]
        for rank, found in calls.items():
            for mask in found:
                assert np.array_equal(mask, forward), f"micro-batch {j}: rank {rank} drew another mask than rank {owner}"
        masks.append(forward)
    assert not any(m.all() for m in masks)
    assert any(o != 0 for o in results[0]["owners"])  # some micro-batch is preprocessed away from stage 0's rank
    ref_losses, ref_grads = _oracle(case, 2, masks)
    tol = TOL["mindspore"]
    losses = next(r["losses"][0] for r in results if r["losses"][0])
    np.testing.assert_allclose(losses, ref_losses, **tol)
    for r in results:
        for name, g in r["grads"].items():
            ref = ref_grads[name]
            np.testing.assert_allclose(g, ref, rtol=tol["rtol"], atol=tol["atol"] * max(float(np.abs(ref).max()), 1.0),
                                       err_msg=f"{name} on rank {r['rank']}")
    assert {n for n in ref_grads if n.startswith("preprocess.")} <= set(results[0]["grads"])


# ------------------------------------------- zero bubble: a gradient-scaling hook in every stage

D, M, PER = 4, 4, 2


def _hooked_stage(s: int, calls: list[int]):
    """``tanh(x @ w + b)`` with a hook halving the gradient of ``x @ w + b`` (the dx/dW boundary:
    its node has an edge into ``b``); each call of the hook notes the stage."""
    from mindspore import nn, ops

    class Hooked(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            rng = np.random.default_rng(10 + s)
            self.w = ms.Parameter(ms.Tensor((rng.standard_normal((D, D)) * 0.5).astype(np.float32)), name=f"w{s}")
            self.b = ms.Parameter(ms.Tensor((rng.standard_normal(D) * 0.1).astype(np.float32)), name=f"b{s}")

        def construct(self, x):
            h = ops.matmul(x, self.w) + self.b
            h.register_hook(lambda g: (calls.append(s), g * 0.5)[1])
            return ops.tanh(h)

    return Hooked()


def _zb_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.standard_normal((M * PER, D)).astype(np.float32), rng.standard_normal((M * PER, D)).astype(np.float32))


def _reference_grads(cells, loss, params, x, y):
    """The non-pipelined gradients: every micro-batch through all cells, mean of the M losses."""

    def total():
        out = 0.0
        for i in range(M):
            h = ms.Tensor(x[i * PER:(i + 1) * PER])
            for cell in cells:
                h = cell(h)
            out = out + loss(h, ms.Tensor(y[i * PER:(i + 1) * PER])) / M
        return out

    return {prm.name: g.asnumpy() for prm, g in zip(params, ms.grad(total, None, weights=params)())}


def _zb_rank(cls, chunks: int, calls: list[int]) -> dict[str, np.ndarray]:
    p = get_platform()
    placement = cls.stage_placement(p.world_size, chunks)
    stages = [PipelineStage(_hooked_stage(s, calls), s, len(placement)) for s, r in sorted(placement.items())
              if r == p.rank]
    schedule = cls(stages if len(stages) > 1 else stages[0], M, loss_fn=mse)
    x, y = _zb_data()
    schedule.run(ms.Tensor(x), target=ms.Tensor(y) if any(st.is_last for st in stages) else None)
    return {prm.name: p.to_numpy(p.get_grad(prm)).copy() for st in stages for prm in st.submodule.trainable_params()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cls_name, chunks", [("ScheduleInterleavedZeroBubble", 1), ("ScheduleZBVZeroBubble", 2)],
                         ids=["ZB-H1", "ZB-V"])
def test_zero_bubble_with_a_gradient_scaling_hook_matches_the_non_pipelined_model(cls_name, chunks):
    """The engine's dx/dW split on every stage: before the fix the weight pass ran the hook again
    (twice per micro-batch, b's gradient halved once more)."""
    import hyper_parallel

    cls = getattr(hyper_parallel, cls_name)
    calls: list[int] = []
    results = LocalCluster(2, platform="mindspore").run(_zb_rank, cls, chunks, calls)
    num = 2 * chunks
    assert sorted(calls) == sorted(list(range(num)) * M)  # once per stage and micro-batch
    cells = [_hooked_stage(s, []) for s in range(num)]
    params = [prm for c in cells for prm in c.trainable_params()]
    x, y = _zb_data()

    ref = _reference_grads(cells, mse, params, x, y)
    got = {name: g for r in results for name, g in r.items()}
    assert set(got) == set(ref)
    tol = TOL["mindspore"]
    for name, g in got.items():
        np.testing.assert_allclose(g, ref[name], rtol=tol["rtol"], atol=tol["atol"] * max(float(np.abs(ref[name]).max()), 1.0),
                                   err_msg=name)


# ------------------------------------------- a loss_fn Cell with its own trainable Parameter

def _plain_stage(s: int):
    """``tanh(x @ w + b)`` (no hooks)."""
    from mindspore import nn, ops

    class Plain(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            rng = np.random.default_rng(30 + s)
            self.w = ms.Parameter(ms.Tensor((rng.standard_normal((D, D)) * 0.5).astype(np.float32)), name=f"w{s}")
            self.b = ms.Parameter(ms.Tensor((rng.standard_normal(D) * 0.1).astype(np.float32)), name=f"b{s}")

        def construct(self, x):
            return ops.tanh(ops.matmul(x, self.w) + self.b)

    return Plain()


def _scaled_mse():
    """A loss Cell with a trainable per-feature scale (reaches the loss through the stage output)."""
    from mindspore import nn

    class ScaledMSE(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.scale = ms.Parameter(ms.Tensor(np.array([1.5, -0.5, 0.75, 2.0], np.float32)), name="loss_scale")

        def construct(self, out, target):
            return ((out * self.scale - target) ** 2).mean()

    return ScaledMSE()


def _loss_rank(cls, chunks: int, autograd: str) -> dict[str, np.ndarray | None]:
    p = get_platform()
    assert p.autograd_mode == autograd
    placement = cls.stage_placement(p.world_size, chunks)
    stages = [PipelineStage(_plain_stage(s), s, len(placement)) for s, r in sorted(placement.items()) if r == p.rank]
    loss = _scaled_mse()
    schedule = cls(stages if len(stages) > 1 else stages[0], M, loss_fn=loss)
    x, y = _zb_data()
    last = any(st.is_last for st in stages)
    schedule.run(ms.Tensor(x), target=ms.Tensor(y) if last else None)
    out = {prm.name: p.to_numpy(p.get_grad(prm)).copy() for st in stages for prm in st.submodule.trainable_params()}
    if last:
        grad = p.get_grad(loss.scale)
        out["loss_scale"] = None if grad is None else p.to_numpy(grad).copy()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("autograd", ["engine", "recompute"])
@pytest.mark.parametrize("cls_name, chunks", [("Schedule1F1B", 1), ("ScheduleInterleavedZeroBubble", 1),
                                              ("ScheduleZBVZeroBubble", 2)], ids=["1F1B", "ZB-H1", "ZB-V"])
def test_loss_fn_cell_parameter_gets_the_non_pipelined_gradient(cls_name, chunks, autograd, monkeypatch):
    """The last stage's backward (full on 1F1B, the dx/dW split on ZB-H1 / ZB-V; engine and
    recompute paths) differentiates the loss Cell's own Parameter too, scaled by 1/M like the
    stages' gradients. Before the fix it got no gradient at all."""
    import hyper_parallel

    monkeypatch.setenv("HYPER_PARALLEL_MS_AUTOGRAD", autograd)
    cls = getattr(hyper_parallel, cls_name)
    results = LocalCluster(2, platform="mindspore").run(_loss_rank, cls, chunks, autograd)
    cells = [_plain_stage(s) for s in range(2 * chunks)]
    loss = _scaled_mse()
    params = [prm for c in cells for prm in c.trainable_params()] + [loss.scale]
    x, y = _zb_data()

    ref = _reference_grads(cells, loss, params, x, y)
    got = {name: g for r in results for name, g in r.items()}
    assert set(got) == set(ref)
    assert got["loss_scale"] is not None, "the loss_fn Cell's Parameter got no gradient"
    tol = TOL["mindspore"]
    for name, g in got.items():
        np.testing.assert_allclose(g, ref[name], rtol=tol["rtol"], atol=tol["atol"] * max(float(np.abs(ref[name]).max()), 1.0),
                                   err_msg=name)



def _run_then_fail(cls_name: str) -> bool | None:
    """One good step, then one whose loss raises at its third call (after earlier micro-batches'
    backwards accumulated into the loss Cell's Parameter): the failed run must put the good step's
    gradient back. ``None`` on the rank without the loss."""
    import hyper_parallel

    p = get_platform()
    stage = PipelineStage(_plain_stage(p.rank), p.rank, p.world_size)
    loss = _scaled_mse()
    schedule = getattr(hyper_parallel, cls_name)(stage, M, loss_fn=loss)
    x, y = (ms.Tensor(a) for a in _zb_data())
    target = y if stage.is_last else None
    schedule.run(x, target=target)
    if not stage.is_last:
        with pytest.raises(Exception):
            schedule.run(x)
        return None
    before = p.get_grad(loss.scale)
    assert before is not None, "the loss_fn Cell's Parameter got no gradient"
    before = p.to_numpy(before).copy()
    calls, inner = [], loss.construct

    def failing(out, tgt):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("injected failure in the loss")
        return inner(out, tgt)

    loss.construct = failing
    with pytest.raises(Exception):
        schedule.run(x, target=target)
    return bool(np.array_equal(p.to_numpy(p.get_grad(loss.scale)), before))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cls_name", ["Schedule1F1B", "ScheduleInterleavedZeroBubble"], ids=["1F1B", "ZB-H1"])
def test_a_failed_run_restores_the_loss_cell_parameter_gradient(cls_name):
    results = LocalCluster(2, platform="mindspore", timeout=60).run(_run_then_fail, cls_name)
    assert results == [None, True]
