"""Issue 21 MPipe corners on MindSpore LocalCluster (small: PyNative is slow): the recompute
backward replays the owner's random state (dropout in the preprocess), and T=0 takes nn.Identity."""

from __future__ import annotations

import numpy as np
import pytest
from mpipe_harness import TOL, Case, check, data, mindspore_modules, mse

from hyper_parallel.core.pipeline_parallel.mpipe import ScheduleMPipeTranspose
from hyper_parallel.core.pipeline_parallel.stage import PipelineStage
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
