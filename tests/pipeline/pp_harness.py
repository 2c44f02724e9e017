"""Helpers for pipeline tests: build GPT stages on a framework, run a schedule, build the oracle.

The oracle is always a non-pipelined computation with the framework's own public autograd
(``torch.autograd.grad`` / ``mindspore.value_and_grad``) on the whole batch.
"""

from __future__ import annotations

import functools

import importlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hyper_parallel.core.pipeline_parallel.schedule import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
from hyper_parallel.platform import get_platform
from hyper_parallel.demo.gpt import TIED_PARAMS, GPTConfig, init_gpt_weights

SCHEDULES = {  # name -> (class, chunks per rank)
    "gpipe": (ScheduleGPipe, 1),
    "1f1b": (Schedule1F1B, 1),
    "interleaved": (ScheduleInterleaved1F1B, 2),
    "looped_bfs": (ScheduleLoopedBFS, 2),
}
TOL = {"torch": dict(rtol=0.0, atol=1e-5), "mindspore": dict(rtol=1e-5, atol=1e-6)}  # the mean loss
GRAD_RTOL, GRAD_ATOL_OF_SCALE = 1e-5, 1e-6  # every gradient element, atol relative to max |reference|


def models(framework: str) -> Any:
    return importlib.import_module(f"hyper_parallel.demo.gpt_{framework}")


def small_config(**kw: Any) -> GPTConfig:
    base = dict(vocab_size=24, max_seq_len=8, d_model=16, n_heads=2, n_layers=3)
    base.update(kw)
    return GPTConfig(**base)


def batch(config: GPTConfig, size: int, seq: int | None = None, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    seq = seq or config.max_seq_len
    return (rng.integers(0, config.vocab_size, (size, seq)).astype(np.int64),
            rng.integers(0, config.vocab_size, (size, seq)).astype(np.int64))


@dataclass
class Job:
    """What every rank runs: which schedule, on what model, with which options."""

    schedule: str
    micro: int
    config: GPTConfig
    tokens: np.ndarray
    targets: np.ndarray | None
    options: dict[str, Any] = field(default_factory=dict)
    stage_options: dict[str, Any] = field(default_factory=dict)
    run_kwargs: dict[str, Any] = field(default_factory=dict)
    wrap_first: Any = None  # fn(module) -> module for stage 0
    wrap_last: Any = None  # fn(module) -> module for the last stage
    use_loss_fn: bool = True
    runs: int = 1
    seed: int = 0


def run_job(job: Job) -> dict[str, Any]:
    """Body of one rank: returns its losses (floats, per run) and gradients (numpy, by name)."""
    p = get_platform()
    mod = models(p.name)
    weights = init_gpt_weights(job.config, job.seed)
    cls, chunks = SCHEDULES[job.schedule]
    placement = cls.stage_placement(p.world_size, chunks)  # looped, or V for the V schedules
    num_stages = len(placement)
    stages = []
    for s in sorted(st for st, r in placement.items() if r == p.rank):
        module = mod.GPTStage(job.config, s, num_stages, weights)
        if s == 0 and job.wrap_first is not None:
            module = job.wrap_first(module)
        if s == num_stages - 1 and job.wrap_last is not None:
            module = job.wrap_last(module)
        ties = {}
        if job.config.tie_embeddings:
            ties = {"emb": TIED_PARAMS[0]} if s == 0 else {"emb": TIED_PARAMS[1]} if s == num_stages - 1 else {}
        stages.append(PipelineStage(module, s, num_stages, shared_parameters=ties, **job.stage_options))
    loss_fn = mod.cross_entropy_loss if job.use_loss_fn else None
    schedule = cls(stages if chunks > 1 else stages[0], job.micro, loss_fn=loss_fn, **job.options)
    all_losses = []
    for run in range(job.runs):
        tokens = job.tokens[run] if job.runs > 1 else job.tokens
        targets = None
        if job.targets is not None:
            targets = job.targets[run] if job.runs > 1 else job.targets
        target = p.from_numpy(targets) if targets is not None and stages[-1].is_last else None
        kwargs = {k: (p.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in job.run_kwargs.items()}
        losses = schedule.run(p.from_numpy(tokens), target=target, **kwargs)
        all_losses.append([float(p.to_numpy(x)) for x in losses])
    grads = {name: p.to_numpy(g).copy() for st in stages for name, g in st.named_gradients().items()}
    kinds = sorted({st.meta_type.name for st in schedule.compute_schedule[schedule.pp_rank] if st is not None})
    return {"losses": all_losses, "grads": grads, "peak": schedule.peak_activations, "step_kinds": kinds,
            "outputs": None if schedule.outputs is None else p.to_numpy(schedule.outputs)}


def merged(results: list[dict[str, Any]]) -> tuple[list[list[float]], dict[str, np.ndarray]]:
    losses = next((r["losses"] for r in results if r["losses"] and r["losses"][0]), [])
    grads: dict[str, np.ndarray] = {}
    for r in results:
        for name, g in r["grads"].items():
            assert name not in grads, f"gradient {name} reported by two ranks"
            grads[name] = g
    return losses, grads


def full_model_oracle(framework: str, config: GPTConfig, tokens, targets, seed: int = 0):
    """Loss and gradients of the non-pipelined model (tied weights really shared)."""
    mod = models(framework)
    return mod.full_batch_grads(mod.GPTFull(config, init_gpt_weights(config, seed)), tokens, targets)


def check_against_oracle(framework: str, losses: list[float], grads: dict[str, np.ndarray],
                         ref_loss: float, ref_grads: dict[str, np.ndarray], tie: bool = False) -> float:
    """Assert the pipeline matches the oracle; returns the max abs gradient difference."""
    np.testing.assert_allclose(np.mean(losses), ref_loss, **TOL[framework], err_msg="mean micro-batch loss")
    alias = {TIED_PARAMS[1]: TIED_PARAMS[0]} if tie else {}
    expected_names = set(ref_grads) | ({TIED_PARAMS[1]} if tie else set())
    assert set(grads) == expected_names, f"gradient names differ: {set(grads) ^ expected_names}"
    worst = 0.0
    for name, g in grads.items():
        ref = ref_grads[alias.get(name, name)]
        # each gradient against its own scale: a small gradient wrong by 1e-6 is not hidden by a fixed atol
        scale = float(np.abs(ref).max())
        np.testing.assert_allclose(g, ref, rtol=GRAD_RTOL, atol=GRAD_ATOL_OF_SCALE * scale + 1e-12,
                                   err_msg=f"gradient of {name} (scale {scale:.3g})")
        worst = max(worst, float(np.abs(g - ref).max()))
    return worst


# ---------------------------------------------------------------- wrappers for special cases
@functools.cache  # one class per framework for the whole session, as a user's module would define it
def _torch_wrappers():
    import torch

    class MeanSquareLoss(torch.nn.Module):
        """Last stage that returns its own scalar loss (no loss_fn)."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *x):
            return self.inner(*x).pow(2).mean()

    class OffsetFirst(torch.nn.Module):
        """First stage with keyword inputs: a per-sample tensor, a whole tensor and a float."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, tokens, *, offset, bias_vec, attn_scale=None):
            return self.inner(tokens, attn_scale=attn_scale) + offset[..., None] + bias_vec

    return MeanSquareLoss, OffsetFirst


@functools.cache
def _mindspore_wrappers():
    from mindspore import nn

    class MeanSquareLoss(nn.Cell):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def construct(self, *x):
            y = self.inner(*x)
            return (y * y).mean()

    class OffsetFirst(nn.Cell):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def construct(self, tokens, offset=None, bias_vec=None, attn_scale=None):
            return self.inner(tokens, attn_scale=attn_scale) + offset.expand_dims(-1) + bias_vec

    return MeanSquareLoss, OffsetFirst


def wrappers(framework: str):
    """``(MeanSquareLoss, OffsetFirst)`` module classes of ``framework``."""
    return _torch_wrappers() if framework == "torch" else _mindspore_wrappers()


def chained_oracle(framework: str, job: Job, num_stages: int, kwargs: dict[str, Any]):
    """Non-pipelined: the same stage modules chained in one process, one backward on the whole batch
    with the framework's public autograd. Returns (loss, {parameter name: gradient})."""
    mod = models(framework)
    weights = init_gpt_weights(job.config, job.seed)
    modules = []
    for s in range(num_stages):
        module = mod.GPTStage(job.config, s, num_stages, weights)
        if s == 0 and job.wrap_first is not None:
            module = job.wrap_first(module)
        if s == num_stages - 1 and job.wrap_last is not None:
            module = job.wrap_last(module)
        modules.append(module)

    def whole(tokens, target, **kw):
        x = modules[0](tokens, **kw)
        for m in modules[1:]:
            x = m(*x) if isinstance(x, tuple) else m(x)
        return mod.cross_entropy_loss(x, target) if job.use_loss_fn else x

    if framework == "torch":
        import torch

        named = [(n, prm) for m in modules for n, prm in m.named_parameters()]
        kw = {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in kwargs.items()}
        target = torch.from_numpy(job.targets) if job.targets is not None else None
        loss = whole(torch.from_numpy(job.tokens), target, **kw)
        grads = torch.autograd.grad(loss, [prm for _, prm in named])
        return float(loss.detach()), {n: g.numpy() for (n, _), g in zip(named, grads)}
    import mindspore as ms

    params = [prm for m in modules for prm in m.trainable_params()]
    kw = {k: (ms.Tensor(v) if isinstance(v, np.ndarray) else v) for k, v in kwargs.items()}
    target = ms.Tensor(job.targets) if job.targets is not None else None
    loss, grads = ms.value_and_grad(lambda t: whole(t, target, **kw), None, weights=params)(ms.Tensor(job.tokens))
    return float(loss.asnumpy()), {prm.name: g.asnumpy() for prm, g in zip(params, grads)}
