"""A tiny multimodal model for MPipe tests on torch and MindSpore, and its non-pipelined oracle.

The preprocess is an "image encoder" of T tanh layers: ``(image, tokens) -> (feature, tokens)``
(the integer tokens pass through, not differentiable). Body stage 0 adds the mean token
embedding to the feature, every body stage is a tanh layer, the last one maps to one output for
an MSE loss. With T = 0 (dataload only) stage 0 gets the raw ``(image, tokens)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.core.pipeline_parallel.features.mpipe.transpose import ScheduleMPipeTranspose
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
from hyper_parallel.platform import get_platform

WIDTH, VOCAB, SEQ = 6, 5, 3
TOL = {"torch": dict(rtol=1e-5, atol=1e-7), "mindspore": dict(rtol=1e-5, atol=1e-6)}


@dataclass(frozen=True)
class Case:
    name: str
    chunks: int
    micro: int
    layers: int  # num_transpose_layers
    trainable: bool = True
    owner_backward: bool = False
    overflow_mode: str = "full"
    inputs: str = "global"
    overlap_p2p: bool = False
    runs: int = 1
    per_micro: int = 2

    def options(self) -> dict[str, Any]:
        return dict(overflow_mode=self.overflow_mode, owner_backward=self.owner_backward, inputs=self.inputs,
                    overlap_p2p=self.overlap_p2p)


# The test matrix: every preprocess kind x (m <= p, m > NT) x overflow mode, on each engine.
KINDS = ("dataload-only", "recompute", "owner", "frozen")
REGIMES = ("m<=p", "m>NT")
REQUIRED = frozenset((k, r, mode) for k in KINDS for r in REGIMES for mode in ("full", "min"))


def combination(case: Case, num_ranks: int) -> tuple[str, str, str]:
    """(preprocess kind, micro-batch regime, overflow mode) a case runs on ``num_ranks`` ranks
    (NT = min(p, m) owners, so m > NT means m > p)."""
    kind = ("dataload-only" if case.layers == 0 else "frozen" if not case.trainable
            else "owner" if case.owner_backward else "recompute")
    return kind, "m<=p" if case.micro <= num_ranks else "m>NT", case.overflow_mode


def missing_combinations(cases: list[tuple[int, Case]]) -> set[tuple[str, str, str]]:
    """The required combinations that no ``(num_ranks, case)`` hits."""
    return set(REQUIRED) - {combination(case, p) for p, case in cases}

def weights(num_stages: int, layers: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def mat(*shape: int, scale: float = 0.5) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    out = {f"enc{k}.{part}": mat(WIDTH, WIDTH) if part == "weight" else mat(WIDTH, scale=0.1)
           for k in range(layers) for part in ("weight", "bias")}
    out["emb"] = mat(VOCAB, WIDTH)
    for s in range(num_stages):
        rows = 1 if s == num_stages - 1 else WIDTH
        out[f"{s}.weight"], out[f"{s}.bias"] = mat(rows, WIDTH), mat(rows, scale=0.1)
    return out


def data(case: Case, seed: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    size = case.micro * case.per_micro
    return (rng.standard_normal((size, WIDTH)).astype(np.float32),
            rng.integers(0, VOCAB, (size, SEQ)).astype(np.int64),
            rng.standard_normal((size, 1)).astype(np.float32))


# ---------------------------------------------------------------------- torch
def torch_modules(num_stages: int, layers: int, trainable: bool) -> tuple[Any, list[Any]]:
    import torch
    from torch import nn

    w = {k: torch.from_numpy(v.copy()) for k, v in weights(num_stages, layers).items()}

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))
            with torch.no_grad():
                for k, lin in enumerate(self.layers):
                    lin.weight.copy_(w[f"enc{k}.weight"])
                    lin.bias.copy_(w[f"enc{k}.bias"])
            self.requires_grad_(trainable)

        def forward(self, image: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = image
            for lin in self.layers:
                h = torch.tanh(lin(h))
            return h, tokens

    class Body(nn.Module):
        def __init__(self, s: int) -> None:
            super().__init__()
            self.s, self.last = s, s == num_stages - 1
            self.lin = nn.Linear(WIDTH, 1 if self.last else WIDTH)
            with torch.no_grad():
                self.lin.weight.copy_(w[f"{s}.weight"])
                self.lin.bias.copy_(w[f"{s}.bias"])
            if s == 0:
                self.emb = nn.Parameter(w["emb"].clone())

        def forward(self, h: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
            if self.s == 0:
                h = h + self.emb[tokens].mean(dim=1)
            return self.lin(h) if self.last else torch.tanh(self.lin(h))

    return (Encoder() if layers else None), [Body(s) for s in range(num_stages)]


def torch_oracle(case: Case, num_stages: int) -> tuple[list[float], dict[str, np.ndarray]]:
    import torch

    encoder, bodies = torch_modules(num_stages, case.layers, case.trainable)
    image, tokens, target = (torch.from_numpy(a) for a in data(case))
    per = case.per_micro
    total, losses = 0.0, []
    for i in range(case.micro):
        rows = slice(i * per, (i + 1) * per)
        h = encoder(image[rows], tokens[rows]) if encoder is not None else (image[rows], tokens[rows])
        h = bodies[0](*h)
        for body in bodies[1:]:
            h = body(h)
        loss = ((h - target[rows]) ** 2).mean()
        losses.append(float(loss.detach()))
        total = total + loss / case.micro
    total.backward()
    grads = {f"stage{s}.{n}": prm.grad.numpy().copy() for s, b in enumerate(bodies) for n, prm in b.named_parameters()}
    if encoder is not None and case.trainable:
        grads.update({f"preprocess.{n}": prm.grad.numpy().copy() for n, prm in encoder.named_parameters()})
    return losses, grads


# ---------------------------------------------------------------------- MindSpore
def mindspore_modules(num_stages: int, layers: int, trainable: bool) -> tuple[Any, list[Any]]:
    import mindspore as ms
    from mindspore import nn, ops

    w = weights(num_stages, layers)

    def param(key: str, name: str) -> ms.Parameter:
        return ms.Parameter(ms.Tensor(w[key]), name=name, requires_grad=True)

    class Encoder(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.ws = ms.ParameterTuple([param(f"enc{k}.weight", f"enc{k}.weight") for k in range(layers)])
            self.bs = ms.ParameterTuple([param(f"enc{k}.bias", f"enc{k}.bias") for k in range(layers)])
            if not trainable:
                for prm in (*self.ws, *self.bs):
                    prm.requires_grad = False

        def construct(self, image: Any, tokens: Any) -> Any:
            h = image
            for wk, bk in zip(self.ws, self.bs):
                h = ops.tanh(ops.matmul(h, wk.T) + bk)
            return h, tokens

    class Body(nn.Cell):
        def __init__(self, s: int) -> None:
            super().__init__()
            self.s, self.last = s, s == num_stages - 1
            self.weight = param(f"{s}.weight", f"s{s}.weight")
            self.bias = param(f"{s}.bias", f"s{s}.bias")
            self.emb = param("emb", "s0.emb") if s == 0 else None

        def construct(self, h: Any, tokens: Any = None) -> Any:
            if self.s == 0:
                h = h + ops.gather(self.emb, tokens, 0).mean(axis=1)
            y = ops.matmul(h, self.weight.T) + self.bias
            return y if self.last else ops.tanh(y)

    return (Encoder() if layers else None), [Body(s) for s in range(num_stages)]


def mindspore_oracle(case: Case, num_stages: int) -> tuple[list[float], dict[str, np.ndarray]]:
    import mindspore as ms

    encoder, bodies = mindspore_modules(num_stages, case.layers, case.trainable)
    image, tokens, target = (ms.Tensor(a) for a in data(case))
    per = case.per_micro
    names = [(f"stage{s}.{prm.name}", prm) for s, b in enumerate(bodies) for prm in b.trainable_params()]
    if encoder is not None and case.trainable:
        names += [(f"preprocess.{prm.name}", prm) for prm in encoder.trainable_params()]

    def micro_loss(i: int) -> Any:
        rows = slice(i * per, (i + 1) * per)
        h = encoder(image[rows], tokens[rows]) if encoder is not None else (image[rows], tokens[rows])
        h = bodies[0](*h)
        for body in bodies[1:]:
            h = body(h)
        return ((h - target[rows]) ** 2).mean()

    losses = [float(micro_loss(i).asnumpy()) for i in range(case.micro)]

    def total() -> Any:
        out = micro_loss(0) / case.micro
        for i in range(1, case.micro):
            out = out + micro_loss(i) / case.micro
        return out

    _, grads = ms.value_and_grad(total, None, weights=[prm for _, prm in names])()
    return losses, {name: g.asnumpy() for (name, _), g in zip(names, grads)}


# ---------------------------------------------------------------------- one rank
def run_case(case: Case) -> dict[str, Any]:
    """Body of one rank: per-run losses, and every gradient by ``schedule.named_gradients`` name."""
    p = get_platform()
    n = p.world_size
    num_stages = n * case.chunks
    build = torch_modules if p.name == "torch" else mindspore_modules
    encoder, bodies = build(num_stages, case.layers, case.trainable)
    stages = [PipelineStage(bodies[c * n + p.rank], c * n + p.rank, num_stages) for c in range(case.chunks)]
    loss_fn = mse
    schedule = ScheduleMPipeTranspose(stages if case.chunks > 1 else stages[0], case.micro, encoder, case.layers,
                                      loss_fn=loss_fn, **case.options())
    image, tokens, target = data(case)
    if case.inputs == "owned":
        rows = schedule.owned_sample_indices(len(image))
        image, tokens = image[rows], tokens[rows]
    losses = []
    for _ in range(case.runs):
        out = schedule.run(p.from_numpy(image), p.from_numpy(tokens), target=p.from_numpy(target))
        losses.append([float(p.to_numpy(x)) for x in out])
    grads = {name: p.to_numpy(g).copy() for name, g in schedule.named_gradients().items()}
    return {"rank": p.rank, "losses": losses, "grads": grads}


def mse(out: Any, target: Any) -> Any:
    return ((out - target) ** 2).mean()


def check(case: Case, results: list[dict[str, Any]], framework: str = "torch") -> None:
    """Losses and every gradient (body stages once, the preprocess on every rank) against the oracle."""
    num_stages = len(results) * case.chunks
    oracle = torch_oracle if framework == "torch" else mindspore_oracle
    ref_losses, ref_grads = oracle(case, num_stages)
    tol = TOL[framework]
    losses = [r["losses"] for r in results if r["losses"][0]]
    assert len(losses) == 1, f"losses came back on {len(losses)} ranks"
    for run in losses[0]:
        np.testing.assert_allclose(run, ref_losses, **tol, err_msg=f"{case.name}: per-micro-batch losses")
    body: dict[str, np.ndarray] = {}
    for r in results:
        pre = {k: v for k, v in r["grads"].items() if k.startswith("preprocess.")}
        assert set(pre) == {k for k in ref_grads if k.startswith("preprocess.")}, (case.name, r["rank"], set(pre))
        for name, g in pre.items():
            _close(g, case.runs * ref_grads[name], tol, f"{case.name}: {name} on rank {r['rank']}")
        for name, g in r["grads"].items():
            if not name.startswith("preprocess."):
                assert name not in body, f"{case.name}: {name} reported twice"
                body[name] = g
    assert set(body) == {k for k in ref_grads if not k.startswith("preprocess.")}, set(body) ^ set(ref_grads)
    for name, g in body.items():
        _close(g, case.runs * ref_grads[name], tol, f"{case.name}: gradient of {name}")


def _close(got: np.ndarray, ref: np.ndarray, tol: dict[str, float], what: str) -> None:
    scale = max(float(np.abs(ref).max()), 1.0)
    np.testing.assert_allclose(got, ref, rtol=tol["rtol"], atol=tol["atol"] * scale, err_msg=what)
