"""Issue 21 corners on torch LocalCluster: no library thread outlives a run (failed or finished),
MPipe recompute replays the owner's random state, MPipe T=0 takes a parameter-free preprocess."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from mlp_harness import MLPStage, batch, mse, weights
from mpipe_harness import TOL, Case, check, data, torch_modules

from hyper_parallel.core.pipeline_parallel.features.mpipe.transpose import ScheduleMPipeTranspose
from hyper_parallel.core.pipeline_parallel.schedule import Schedule1F1B
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster, RankFailedError

# ---------------------------------------------------------------------------------------- threads

MICRO, STEPS = 4, 3


class _Boom(RuntimeError):
    pass


class _FailingStage(MLPStage):
    """An MLP stage whose forward raises at micro-batch ``micro`` of step ``step`` (0-based)."""

    def __init__(self, index, num, w, fail_at):
        super().__init__(index, num, w, False)
        self.calls, self.fail_at = 0, fail_at
        self.seen: set[str] = set()  # library threads alive during the forwards

    def forward(self, h, skip=None):
        self.seen.update(_library_threads())
        step, micro = divmod(self.calls, MICRO)
        self.calls += 1
        if (step, micro) == self.fail_at:
            raise _Boom(f"stage {self.index} fails at step {step} micro-batch {micro}")
        return super().forward(h, skip)


def _library_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("hyper-parallel") and t.is_alive())


def _train(failing_rank: int | None, fail_at: tuple[int, int]) -> list[str]:
    p = get_platform()
    w = weights(4)
    stage = PipelineStage(_FailingStage(p.rank, 4, w, fail_at if p.rank == failing_rank else None), p.rank, 4)
    sched = Schedule1F1B(stage, MICRO, loss_fn=mse)
    x, y = (torch.from_numpy(a) for a in batch(2 * MICRO, MICRO, False))
    for _ in range(STEPS):
        sched.run(x, target=y if stage.is_last else None)
        stage.zero_grad()
    return stage.submodule.seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("failing_rank, fail_at", [(0, (1, 2)), (0, (0, 0)), (1, (1, 2)), (2, (2, 3)),
                                                   (3, (1, 1)), (3, (0, 3))])
def test_no_library_thread_outlives_a_failed_run(failing_rank, fail_at):
    with pytest.raises(RankFailedError) as info:
        LocalCluster(4, platform="torch").run(_train, failing_rank, fail_at)
    assert info.value.rank == failing_rank and "_Boom" in str(info.value)
    assert _library_threads() == []


@pytest.mark.timeout(120)
def test_no_library_thread_outlives_finished_runs():
    seen = LocalCluster(4, platform="torch").run(_train, None, (-1, -1))
    assert all("hyper-parallel-wait-watch" in names for names in seen)  # the watch ran during the runs ...
    assert _library_threads() == []  # ... and stopped with the last of them


# ---------------------------------------------------------------- MPipe: dropout in the preprocess

DROP = 0.5


def _dropout_encoder(encoder):
    """The harness encoder followed by dropout; every call logs its image rows and kept mask."""

    class DropEncoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc, self.drop, self.log = encoder, torch.nn.Dropout(DROP), []

        def forward(self, image, tokens):
            h, tokens = self.enc(image, tokens)
            out = self.drop(h)
            self.log.append((image.detach().numpy().copy(), (out != 0).detach().numpy().copy()))
            return out, tokens

    return DropEncoder()


def _dropout_rank(case) -> dict:
    p = get_platform()
    encoder, bodies = torch_modules(p.world_size, 1, True)
    pre = _dropout_encoder(encoder)
    stage = PipelineStage(bodies[p.rank], p.rank, p.world_size)
    schedule = ScheduleMPipeTranspose(stage, case.micro, pre, 1, loss_fn=mse, **case.options())
    image, tokens, target = data(case)
    if case.inputs == "owned":
        rows = schedule.owned_sample_indices(len(image))
        image, tokens = image[rows], tokens[rows]
    torch.manual_seed(100 + p.rank)
    losses = [float(v) for v in schedule.run(torch.from_numpy(image), torch.from_numpy(tokens),
                                             target=torch.from_numpy(target))]
    grads = {name: g.numpy().copy() for name, g in schedule.named_gradients().items()}
    return {"rank": p.rank, "losses": losses, "grads": grads, "log": pre.log,
            "owners": [schedule.owner_of(j) for j in range(case.micro)]}


def _masks_of_the_forward(case, results) -> list[np.ndarray]:
    """Micro-batch j's mask as its owner's forward drew it; every other call on j (stage 0's
    recompute) must have drawn the same."""
    image = data(case)[0]
    per = case.per_micro
    masks = []
    for j in range(case.micro):
        rows = image[j * per:(j + 1) * per]
        calls = {r["rank"]: [m for img, m in r["log"] if np.array_equal(img, rows)] for r in results}
        owner = results[0]["owners"][j]
        forward = calls[owner][0]
        for rank, found in calls.items():
            for k, mask in enumerate(found):
                assert np.array_equal(mask, forward), \
                    f"micro-batch {j}: call {k} on rank {rank} drew another mask than its owner's (rank {owner}) forward"
        masks.append(forward)
    return masks


def _dropout_oracle(case, num_stages, masks):
    encoder, bodies = torch_modules(num_stages, 1, True)
    image, tokens, target = (torch.from_numpy(a) for a in data(case))
    per, total, losses = case.per_micro, 0.0, []
    for j in range(case.micro):
        rows = slice(j * per, (j + 1) * per)
        h, tok = encoder(image[rows], tokens[rows])
        h = h * torch.from_numpy(masks[j]).float() / (1 - DROP)
        h = bodies[0](h, tok)
        for body in bodies[1:]:
            h = body(h)
        loss = ((h - target[rows]) ** 2).mean()
        losses.append(float(loss.detach()))
        total = total + loss / case.micro
    total.backward()
    grads = {f"stage{s}.{n}": prm.grad.numpy() for s, b in enumerate(bodies) for n, prm in b.named_parameters()}
    grads.update({f"preprocess.enc.{n}": prm.grad.numpy() for n, prm in encoder.named_parameters()})
    return losses, grads


def _check_dropout(case, results):
    masks = _masks_of_the_forward(case, results)
    assert not any(m.all() for m in masks)  # dropout dropped something in every micro-batch
    ref_losses, ref_grads = _dropout_oracle(case, len(results), masks)
    losses = next(r["losses"] for r in results if r["losses"])
    np.testing.assert_allclose(losses, ref_losses, **TOL["torch"], err_msg="per-micro-batch losses")
    for r in results:
        for name, g in r["grads"].items():
            ref = ref_grads[name]
            scale = max(float(np.abs(ref).max()), 1.0)
            np.testing.assert_allclose(g, ref, rtol=TOL["torch"]["rtol"], atol=TOL["torch"]["atol"] * scale,
                                       err_msg=f"{case.name}: {name} on rank {r['rank']}")
    assert {n for n in ref_grads if n.startswith("preprocess.")} <= set(results[0]["grads"])


DROPOUT_CASES = [
    (2, Case("recompute", 1, 4, 1)),
    (3, Case("recompute-owned-inputs", 1, 5, 1, inputs="owned")),
    (3, Case("recompute-min-overflow", 1, 7, 1, overflow_mode="min", overlap_p2p=True)),
    (2, Case("owner", 1, 4, 1, owner_backward=True)),
    (3, Case("owner-owned-inputs", 1, 5, 1, owner_backward=True, inputs="owned")),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("ranks, case", DROPOUT_CASES, ids=[f"{c.name}-p{r}" for r, c in DROPOUT_CASES])
def test_mpipe_dropout_preprocess_matches_the_non_pipelined_model(ranks, case):
    results = LocalCluster(ranks, platform="torch").run(_dropout_rank, case)
    _check_dropout(case, results)


# ---------------------------------------------------------------- MPipe: T=0 with a parameter-free preprocess

class _Double(torch.nn.Module):
    """A parameter-free preprocess that is not the identity."""

    def forward(self, image, tokens):
        return image * 2, tokens


class _DoublingIdentity(torch.nn.Identity):
    """A subclass of nn.Identity with its own forward: not the identity, so it must run."""

    def forward(self, image, tokens):
        return image * 2, tokens


def _t0_rank(case, kind: str) -> dict:
    p = get_platform()
    layers = 1 if kind == "frozen" else 0
    encoder, bodies = torch_modules(p.world_size, layers, False)
    pre = {"identity": torch.nn.Identity(), "double": _Double(), "frozen": encoder,
           "doubling-identity": _DoublingIdentity()}[kind]
    stage = PipelineStage(bodies[p.rank], p.rank, p.world_size)
    schedule = ScheduleMPipeTranspose(stage, case.micro, pre, 0, loss_fn=mse, **case.options())
    image, tokens, target = data(case)
    if case.inputs == "owned":
        rows = schedule.owned_sample_indices(len(image))
        image, tokens = image[rows], tokens[rows]
    losses = [float(v) for v in schedule.run(torch.from_numpy(image), torch.from_numpy(tokens),
                                             target=torch.from_numpy(target))]
    grads = {name: g.numpy().copy() for name, g in schedule.named_gradients().items()}
    return {"rank": p.rank, "losses": [losses], "grads": grads}


T0_CASES = [(2, Case("t0", 1, 4, 0)), (3, Case("t0-owned-overflow", 1, 5, 0, inputs="owned", overlap_p2p=True)),
            (3, Case("t0-min", 1, 4, 0, overflow_mode="min"))]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["identity", "double", "frozen"])
@pytest.mark.parametrize("ranks, case", T0_CASES, ids=[f"{c.name}-p{r}" for r, c in T0_CASES])
def test_mpipe_t0_takes_a_parameter_free_preprocess(ranks, case, kind):
    """T=0 with nn.Identity() is the dataload-only pipeline; another parameter-free (or frozen)
    module is run by the owners, without a backward, as stage 0's input maker."""
    results = LocalCluster(ranks, platform="torch").run(_t0_rank, case, kind)
    if kind == "identity":
        check(case, results)  # = T=0 with preprocess_module=None: the raw inputs are stage 0's
    elif kind == "frozen":
        check(Case(case.name, case.chunks, case.micro, 1, trainable=False, inputs=case.inputs), results)
    else:
        ref_losses, ref_grads = _doubled_oracle(case, ranks)
        losses = next(r["losses"][0] for r in results if r["losses"][0])
        np.testing.assert_allclose(losses, ref_losses, **TOL["torch"])
        got = {n: g for r in results for n, g in r["grads"].items()}
        assert set(got) == set(ref_grads)
        for name, g in got.items():
            np.testing.assert_allclose(g, ref_grads[name], rtol=1e-5, atol=1e-7 * max(np.abs(ref_grads[name]).max(), 1))


@pytest.mark.timeout(180)
def test_mpipe_t0_runs_a_subclass_of_the_identity_that_has_its_own_forward():
    """Only the identity module itself is skipped as dataload-only: a subclass overriding forward
    is a preprocess like any other parameter-free module (it used to be skipped silently)."""
    ranks, case = T0_CASES[0]
    results = LocalCluster(ranks, platform="torch").run(_t0_rank, case, "doubling-identity")
    ref_losses, _ = _doubled_oracle(case, ranks)
    losses = next(r["losses"][0] for r in results if r["losses"][0])
    np.testing.assert_allclose(losses, ref_losses, **TOL["torch"])


def _doubled_oracle(case, num_stages):
    _, bodies = torch_modules(num_stages, 0, True)
    image, tokens, target = (torch.from_numpy(a) for a in data(case))
    per, total, losses = case.per_micro, 0.0, []
    for j in range(case.micro):
        rows = slice(j * per, (j + 1) * per)
        h = bodies[0](image[rows] * 2, tokens[rows])
        for body in bodies[1:]:
            h = body(h)
        loss = ((h - target[rows]) ** 2).mean()
        losses.append(float(loss.detach()))
        total = total + loss / case.micro
    total.backward()
    return losses, {f"stage{s}.{n}": prm.grad.numpy() for s, b in enumerate(bodies) for n, prm in b.named_parameters()}


def _t0_refused(trainable_on: tuple[int, ...], identity_on: tuple[int, ...]) -> None:
    p = get_platform()
    encoder, bodies = torch_modules(2, 1, p.rank in trainable_on)
    pre = encoder if p.rank in trainable_on else torch.nn.Identity() if p.rank in identity_on else None
    ScheduleMPipeTranspose(PipelineStage(bodies[p.rank], p.rank, 2), 2, pre, 0, loss_fn=mse)


@pytest.mark.parametrize("trainable_on, identity_on, message", [
    ((0, 1), (), r"num_transpose_layers=0 is the dataload-only mode: .* trainable parameters \['layers.0.weight', "
                 r"'layers.0.bias'\] of the preprocess would get no gradient; pass the preprocess's layer count"),
    ((), (0,), r"pipeline ranks disagree on whether a preprocess_module was passed: rank 0 has True but rank 1 has "
               r"False"),
])
def test_mpipe_t0_refuses_a_trainable_preprocess_saying_why(trainable_on, identity_on, message):
    with pytest.raises(RankFailedError, match=message) as info:
        LocalCluster(2, platform="torch").run(_t0_refused, trainable_on, identity_on)
    assert isinstance(info.value.error, ValueError)
