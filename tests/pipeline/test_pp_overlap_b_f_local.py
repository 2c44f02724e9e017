"""overlap_b_f on LocalCluster (pp=2 x ep=2 in one process) with an MoE stage whose dispatch and
combine are the platform's all_to_all over the ``ep`` mesh dimension: interleaved 1F1B with the pairs
run on a CommComputeOverlap gives bitwise the losses and gradients of the plain schedule, and both
match a non-pipelined oracle (the stages chained, one backward per micro-batch). MindSpore is the lean case (PyNative is slow); torch runs the same model."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from hyper_parallel.core.pipeline_parallel.features.overlap import CommComputeOverlap, HookCoordinator
from hyper_parallel.core.pipeline_parallel.schedule import ScheduleInterleaved1F1B
from hyper_parallel.core.pipeline_parallel.zero_bubble_schedules import ScheduleDualPipeV
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster

PP, EP, CHUNKS, MICRO = 2, 2, 2, 4
STAGES = PP * CHUNKS
WIDTH, ROWS = 4, 2  # rows per micro-batch and ep rank
TIMEOUT = 300.0
TOL = {"torch": dict(rtol=1e-5, atol=1e-7), "mindspore": dict(rtol=1e-5, atol=1e-6)}


def weights(stage: int, ep: int) -> dict[str, np.ndarray]:
    """Replicated weights seeded by stage, the expert by (stage, ep rank)."""
    shared, own = np.random.default_rng(stage), np.random.default_rng(100 + 10 * stage + ep)
    return {
        "mix.weight": (shared.standard_normal((WIDTH, WIDTH)) * 0.5).astype(np.float32),
        "mix.bias": (shared.standard_normal(WIDTH) * 0.1).astype(np.float32),
        "router.weight": (shared.standard_normal((EP, WIDTH)) * 0.5).astype(np.float32),
        "router.bias": np.zeros(EP, np.float32),
        "expert.weight": (own.standard_normal((WIDTH, WIDTH)) * 0.5).astype(np.float32),
        "expert.bias": (own.standard_normal(WIDTH) * 0.1).astype(np.float32),
    }


def data(ep: int, micro: int = MICRO) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7 + ep)
    return (rng.standard_normal((micro * ROWS, WIDTH)).astype(np.float32),
            rng.standard_normal((micro * ROWS, WIDTH)).astype(np.float32))


@dataclass(frozen=True)
class Shape:
    """A schedule and its sizes: ``ScheduleInterleaved1F1B`` ("off": overlap_b_f=False, "pairs":
    overlap_b_f=True run in sequence, "on": overlap_b_f=True on a CommComputeOverlap) or
    ``ScheduleDualPipeV`` (its pairs always: "off" in sequence, "on" on a CommComputeOverlap)."""

    cls: type = ScheduleInterleaved1F1B
    pp: int = PP
    chunks: int = CHUNKS
    micro: int = MICRO

    @property
    def stages(self) -> int:
        return self.pp * self.chunks

    def indices(self, pp_rank: int) -> list[int]:
        return sorted(s for s, r in self.cls.stage_placement(self.pp, self.chunks).items() if r == pp_rank)

    def modes(self) -> tuple[str, ...]:
        if self.cls is ScheduleDualPipeV:
            return ("off", "on")
        if self.micro < ScheduleInterleaved1F1B.min_overlap_microbatches(self.pp):  # no pair: "on" is refused
            return ("off", "pairs")
        return ("off", "pairs", "on")

    def schedule(self, stages, mode, overlap, loss):
        if self.cls is ScheduleDualPipeV:
            return ScheduleDualPipeV(stages, self.micro, loss_fn=loss, comm_compute_overlap=overlap)
        return ScheduleInterleaved1F1B(stages, self.micro, loss_fn=loss, overlap_b_f=mode != "off",
                                       comm_compute_overlap=overlap)


DEFAULT = Shape()


def exchange(p, group, overlap, kind, last):
    """A differentiable all-to-all of row blocks over ``group`` (its gradient goes back the same way),
    with sync points when ``overlap`` is given."""

    def a2a(x):
        def move(t):
            return p.cat(p.all_to_all(p.chunk(t, EP, 0), group), 0)

        return p.custom_function(move, move, x)

    if overlap is None:
        return a2a
    return overlap.wrap_dispatch(a2a) if kind == "dispatch" else overlap.wrap_combine(a2a, is_last_layer=last)


def make_stage(framework, stage, ep, group, overlap):
    """``h = x + tanh(mix(x)); out = h + sum_e softmax(router(h))_e * relu(expert_e(h))``, expert e on ep rank e."""
    p = get_platform()
    w = weights(stage, ep)
    dispatch, combine = exchange(p, group, overlap, "dispatch", False), exchange(p, group, overlap, "combine", True)
    if framework == "torch":
        import torch
        from torch import nn

        class Stage(nn.Module):
            def __init__(self):
                super().__init__()
                self.mix, self.router, self.expert = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, EP), nn.Linear(WIDTH, WIDTH)
                with torch.no_grad():
                    for name, value in self.named_parameters():
                        value.copy_(torch.from_numpy(w[name]))

            def forward(self, x):
                h = x + torch.tanh(self.mix(x))
                gate = torch.softmax(self.router(h), dim=-1)
                back = combine(torch.relu(self.expert(dispatch(h.repeat(EP, 1))))).chunk(EP, 0)
                return h + sum(gate[:, e:e + 1] * back[e] for e in range(EP))

        return Stage()
    import mindspore as ms
    from mindspore import nn, ops

    class Cell(nn.Cell):
        def __init__(self):
            super().__init__()
            self.mix, self.router, self.expert = nn.Dense(WIDTH, WIDTH), nn.Dense(WIDTH, EP), nn.Dense(WIDTH, WIDTH)
            for name, value in self.parameters_and_names():
                value.set_data(ms.Tensor(w[name]))

        def construct(self, x):
            h = x + ops.tanh(self.mix(x))
            gate = ops.softmax(self.router(h), -1)
            back = combine(ops.relu(self.expert(dispatch(ops.tile(h, (EP, 1))))))
            out = h
            for e in range(EP):
                out = out + gate[:, e:e + 1] * back[e * ROWS:(e + 1) * ROWS]
            return out

    return Cell()


def to_numpy(framework, tensor):
    return tensor.detach().numpy().copy() if framework == "torch" else tensor.asnumpy()


def loss_fn(framework):
    def mse(out, target):
        return ((out - target) ** 2).mean()

    return mse


def rank_body(framework, shape=DEFAULT, modes=None):
    import hyper_parallel as hp

    p = get_platform()
    mesh = hp.init_device_mesh("cpu", (shape.pp, EP), mesh_dim_names=("pp", "ep"))
    pp, ep = mesh.get_local_rank("pp"), mesh.get_local_rank("ep")
    group = mesh.get_group("ep")
    x, y = data(ep, shape.micro)
    out = {}
    indices = shape.indices(pp)
    for mode in modes or shape.modes():
        trace: list[str] = []
        overlap = None
        if mode == "on":
            overlap = CommComputeOverlap(timeout=TIMEOUT)
            overlap.coordinator = HookCoordinator(TIMEOUT, trace=lambda event, side, role, _t=trace: _t.append(side))
        modules = [make_stage(framework, s, ep, group, overlap) for s in indices]
        stages = [PipelineStage(m, s, shape.stages, mesh=mesh) for m, s in zip(modules, indices, strict=True)]
        schedule = shape.schedule(stages, mode, overlap, loss_fn(framework))
        losses = schedule.run(p.from_numpy(x), target=p.from_numpy(y) if stages[-1].is_last else None)
        out[mode] = {"losses": [float(to_numpy(framework, v)) for v in losses],
                     "grads": {f"{s}.{n}": to_numpy(framework, g) for s, st in zip(indices, stages, strict=True)
                               for n, g in st.named_gradients().items()},
                     "pairs": sum(step is not None and step.meta_type.name == "OVERLAP_B_F"
                                  for step in schedule.exec_order[schedule.pp_rank]),
                     "sides": sorted(set(trace))}
    out["oracle"] = oracle(framework, p, group, ep, pp, x, y, shape)
    return out


def oracle(framework, p, group, ep, pp, x, y, shape=DEFAULT):
    """All the stages chained on this rank (its ep line runs the same all-to-alls), one backward per
    micro-batch of loss / m with the framework's public autograd (torch) or the eager engine through
    the platform (MindSpore), gradients summed."""
    modules = [make_stage(framework, s, ep, group, None) for s in range(shape.stages)]
    mine = shape.indices(pp)
    named = [(f"{s}.{n}", q) for s in mine for n, q in (
        modules[s].named_parameters() if framework == "torch" else modules[s].parameters_and_names())]
    params = [q for m in modules for q in (m.parameters() if framework == "torch" else m.trainable_params())]
    mse = loss_fn(framework)
    losses, total = [], {}

    def whole(xs, ys):
        out = xs
        for module in modules:
            out = module(out)
        return mse(out, ys) / shape.micro

    for i in range(shape.micro):
        xs, ys = p.from_numpy(x[i * ROWS:(i + 1) * ROWS]), p.from_numpy(y[i * ROWS:(i + 1) * ROWS])
        if framework == "torch":
            import torch

            loss = whole(xs, ys)
            grads = torch.autograd.grad(loss, params)
        else:  # ms.value_and_grad cannot differentiate through custom_function's all-to-all: the
            # eager engine (what MindSpore 2.10 has in place of Tensor.backward), one chained graph
            record = p.stage_forward(lambda a, b: (whole(a, b),), (xs, ys), {}, params, [False, False])
            loss = record.outputs[0]
            p.stage_backward(record, [p.ones_like(loss)])
            grads = None
        losses.append(float(to_numpy(framework, loss)) * shape.micro)
        if grads is None:
            continue
        by_id = {id(q): g for q, g in zip(params, grads, strict=True)}
        for name, q in named:
            total[name] = total.get(name, 0) + to_numpy(framework, by_id[id(q)])
    if framework != "torch":
        total = {name: to_numpy(framework, p.get_grad(q)) for name, q in named}
    return {"losses": losses, "grads": total}


def check_results(results, framework, shape=DEFAULT, modes=None):
    """Every mode bitwise equal to "off" (losses and gradients), "off" equal to the oracle; returns
    the OVERLAP_B_F steps of each pipeline rank under the last mode."""
    modes = modes or shape.modes()
    for rank, res in enumerate(results):
        assert sorted(res["off"]["grads"]) == sorted(res["oracle"]["grads"]) and res["off"]["grads"], rank
        for mode in modes[1:]:
            assert res[mode]["losses"] == res["off"]["losses"], (rank, mode)
            assert sorted(res[mode]["grads"]) == sorted(res["off"]["grads"]), (rank, mode)
            for name, grad in res["off"]["grads"].items():
                assert np.array_equal(res[mode]["grads"][name], grad), (rank, mode, name)
        if "on" in modes:  # the pairs ran on the coordinator, both sides taking turns at the wrapped all-to-alls
            assert res["on"]["sides"] == (["backward", "forward"] if res["on"]["pairs"] else []), rank
        if res["off"]["losses"]:
            assert len(res["off"]["losses"]) == shape.micro
            np.testing.assert_allclose(res["off"]["losses"], res["oracle"]["losses"], **TOL[framework])
        for name, want in res["oracle"]["grads"].items():
            scale = max(1.0, float(np.abs(want).max()))
            np.testing.assert_allclose(res["off"]["grads"][name], want, rtol=TOL[framework]["rtol"],
                                       atol=TOL[framework]["atol"] * scale, err_msg=f"rank {rank} {name}")
    assert sum(bool(res["off"]["losses"]) for res in results) == EP  # the last stage's ranks, one per ep rank
    return [res[modes[-1]]["pairs"] for res in results[::EP]]


@pytest.mark.parametrize("framework, shape, pairs", [
    pytest.param("torch", DEFAULT, [2, 2], id="torch"),
    pytest.param("mindspore", DEFAULT, [2, 2], id="mindspore"),  # p=2, v=2, m=4: two pairs per rank
    pytest.param("mindspore", Shape(ScheduleDualPipeV, 2, 2, 4), [3, 3], id="mindspore-dualpipev-m4"),
])
def test_overlap_b_f_bitwise_and_oracle_local(framework, shape, pairs):
    modes = None
    if framework == "mindspore":
        pytest.importorskip("mindspore")
        modes = ("off", "on")  # PyNative is slow: the pairs run in sequence only on torch
    results = LocalCluster(shape.pp * EP, framework, timeout=TIMEOUT).run(rank_body, framework, shape, modes)
    assert check_results(results, framework, shape, modes) == pairs


def _matrix():
    for pp in (2, 3, 4):
        for chunks in (2, 3):
            for micro in (pp, 2 * pp, 2 * pp + 1):
                yield pytest.param(Shape(ScheduleInterleaved1F1B, pp, chunks, micro),
                                   id=f"interleaved-p{pp}-v{chunks}-m{micro}")
    for pp, micro in ((2, 4), (2, 5), (2, 8), (3, 6), (3, 7), (4, 8), (4, 9)):
        yield pytest.param(Shape(ScheduleDualPipeV, pp, 2, micro), id=f"dualpipev-p{pp}-m{micro}")


@pytest.mark.parametrize("shape", list(_matrix()))
def test_overlap_b_f_matrix_torch(shape):
    """pp x ep=2 on LocalCluster for ScheduleInterleaved1F1B at p in {2, 3, 4}, v in {2, 3}, m in
    {p, 2p, 2p+1} and ScheduleDualPipeV at several m: overlap pairs on a CommComputeOverlap (and,
    for interleaved, run in sequence) bitwise equal to no overlap, and equal to the oracle."""
    results = LocalCluster(shape.pp * EP, "torch", timeout=TIMEOUT).run(rank_body, "torch", shape)
    pairs = check_results(results, "torch", shape)
    # interleaved 1F1B at m = p runs all forwards in its warm-up: nothing to pair (and a
    # comm_compute_overlap is refused, test_pp_comm_compute_overlap.py)
    assert pairs == [0] * shape.pp if "on" not in shape.modes() else all(pairs), pairs


# ---------------------------------------------------------------- recompute and swap inside real pairs
def rank_body_policies(framework):
    """The overlapped schedule three ways: as is, with every MoE stage checkpointed (its forward,
    all-to-alls and sync points included, re-runs in the backward side of a pair), and with
    schedule-driven swap. Each returns losses, gradients, swapped keys and the coordinator's trace."""
    import hyper_parallel as hp
    from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper
    from hyper_parallel.core.pipeline_parallel.features.memory_stats import memory_stats

    p = get_platform()
    mesh = hp.init_device_mesh("cpu", (PP, EP), mesh_dim_names=("pp", "ep"))
    pp, ep = mesh.get_local_rank("pp"), mesh.get_local_rank("ep")
    group = mesh.get_group("ep")
    x, y = data(ep)
    out = {}
    for mode, options in (("on", {}), ("checkpoint", {}), ("swap", {"swap": True, "swap_threshold": 2})):
        trace: list[tuple[str, str]] = []
        overlap = CommComputeOverlap(timeout=TIMEOUT)
        overlap.coordinator = HookCoordinator(TIMEOUT, trace=lambda event, side, role, _t=trace: _t.append((event, side)))
        indices = [c * PP + pp for c in range(CHUNKS)]
        modules = [make_stage(framework, s, ep, group, overlap) for s in indices]
        if mode == "checkpoint":
            for module in modules:
                checkpoint_wrapper(module)
        stages = [PipelineStage(m, s, STAGES, mesh=mesh) for m, s in zip(modules, indices, strict=True)]
        schedule = ScheduleInterleaved1F1B(stages, MICRO, loss_fn=loss_fn(framework), overlap_b_f=True,
                                           comm_compute_overlap=overlap, **options)
        losses = schedule.run(p.from_numpy(x), target=p.from_numpy(y) if stages[-1].is_last else None)
        out[mode] = {"losses": [float(to_numpy(framework, v)) for v in losses],
                     "grads": {f"{s}.{n}": to_numpy(framework, g) for s, st in zip(indices, stages, strict=True)
                               for n, g in st.named_gradients().items()},
                     "trace": trace,
                     "swapped": memory_stats(schedule).swapped if mode == "swap" else None}
    return out


def _by_side(trace):
    """Each side's events in its order (the two sides' first events race: the second side's
    initial wait is logged from its own thread while the first side runs)."""
    return {side: [event for event, s in trace if s == side] for side in ("forward", "backward")}


def test_checkpoint_and_swap_inside_real_overlap_pairs_torch():
    """Checkpointed MoE stages in the pairs of ScheduleInterleaved1F1B(overlap_b_f=True) on a
    CommComputeOverlap: the re-run of a forward (its all-to-alls and sync points) inside the backward
    side makes no sync point fire again -- the coordinator's turns are exactly those of the run
    without recompute -- and losses and gradients are bitwise the same; with swap=True too, and the
    schedule swaps micro-batches of both ranks."""
    results = LocalCluster(PP * EP, "torch", timeout=TIMEOUT).run(rank_body_policies, "torch")
    for rank, res in enumerate(results):
        assert res["on"]["trace"], rank  # the sides took turns at the wrapped all-to-alls
        for mode in ("checkpoint", "swap"):
            assert _by_side(res[mode]["trace"]) == _by_side(res["on"]["trace"]), (rank, mode)
            assert res[mode]["losses"] == res["on"]["losses"], (rank, mode)
            assert sorted(res[mode]["grads"]) == sorted(res["on"]["grads"]), (rank, mode)
            for name, grad in res["on"]["grads"].items():
                assert np.array_equal(res[mode]["grads"][name], grad), (rank, mode, name)
        assert res["swap"]["swapped"], rank
