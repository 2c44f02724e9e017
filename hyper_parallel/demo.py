"""The main job: pipeline-parallel training of a small GPT on the text shipped with the package.

``train_worker`` runs on every rank (a torch gloo process, or a LocalCluster rank for
MindSpore). It trains for a few steps, and on the last step compares every parameter
gradient of the pipeline with one non-pipelined step of the same model on the same batch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.core.pipeline_parallel.schedule import (
    PipelineSchedule,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from hyper_parallel.core.pipeline_parallel.stage import PipelineStage
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.base import Platform
from hyper_parallel.platform.model_spec import (
    TIED_PARAMS,
    CharTokenizer,
    GPTConfig,
    init_gpt_weights,
    load_tiny_corpus,
    sample_batch,
)

# name -> (schedule class, stages per rank)
SCHEDULES: dict[str, tuple[type[PipelineSchedule], int]] = {
    "gpipe": (ScheduleGPipe, 1),
    "1f1b": (Schedule1F1B, 1),
    "interleaved-1f1b": (ScheduleInterleaved1F1B, 2),
    "looped-bfs": (ScheduleLoopedBFS, 2),
}


@dataclass(frozen=True)
class DemoOptions:
    schedule: str = "1f1b"
    ranks: int = 4
    steps: int = 8
    micro_batches: int = 8
    batch_size: int = 16
    seq_len: int = 32
    lr: float = 3e-3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose from {', '.join(SCHEDULES)}")
        if self.batch_size % self.micro_batches:
            raise ValueError(f"batch_size {self.batch_size} must divide into {self.micro_batches} micro-batches")


def model_config(vocab_size: int, seq_len: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab_size, max_seq_len=seq_len, d_model=64, n_heads=4, n_layers=6,
                     tie_embeddings=True)


def _models(platform: Platform) -> Any:
    return importlib.import_module(f"hyper_parallel.platform.{platform.name}.models")


class Adam:
    """A small framework-neutral Adam over the platform's parameters and gradients."""

    def __init__(self, platform: Platform, params: list[Any], lr: float, betas=(0.9, 0.95), eps: float = 1e-8):
        self.p, self.params, self.lr, self.betas, self.eps = platform, params, lr, betas, eps
        self.state: dict[int, tuple[Any, Any]] = {}
        self.t = 0

    def step(self) -> None:
        b1, b2 = self.betas
        self.t += 1
        for i, param in enumerate(self.params):
            g = self.p.get_grad(param)
            if g is None:
                continue
            m, v = self.state.get(i, (g * 0.0, g * 0.0))
            m = m * b1 + g * (1 - b1)
            v = v * b2 + g * g * (1 - b2)
            self.state[i] = (m, v)
            m_hat, v_hat = m / (1 - b1**self.t), v / (1 - b2**self.t)
            update = m_hat / (v_hat**0.5 + self.eps) * self.lr
            self.p.assign_param(param, self.p.param_data(param) - update)


def build_pipeline(opts: DemoOptions, platform: Platform) -> tuple[list[PipelineStage], PipelineSchedule, Any]:
    models = _models(platform)
    text = load_tiny_corpus()
    tokenizer = CharTokenizer.from_text(text)
    config = model_config(tokenizer.vocab_size, opts.seq_len)
    weights = init_gpt_weights(config, seed=opts.seed)
    schedule_class, chunks = SCHEDULES[opts.schedule]
    n, r = platform.world_size, platform.rank
    num_stages = n * chunks
    stages = []
    for c in range(chunks):
        s = c * n + r
        ties = {}
        if s == 0:
            ties = {"embedding": TIED_PARAMS[0]}
        elif s == num_stages - 1:
            ties = {"embedding": TIED_PARAMS[1]}
        stages.append(PipelineStage(models.GPTStage(config, s, num_stages, weights), s, num_stages,
                                    shared_parameters=ties))
    schedule = schedule_class(stages if chunks > 1 else stages[0], opts.micro_batches,
                              loss_fn=models.cross_entropy_loss)
    return stages, schedule, (config, np.asarray(tokenizer.encode(text), dtype=np.int64))


def _max_grad_diff(platform: Platform, stages: list[PipelineStage], config: GPTConfig, tokens, targets) -> float:
    """Max |pipeline gradient - non-pipelined gradient| over every parameter (on rank 0)."""
    p = platform
    mine = {name: (p.to_numpy(p.param_data(param)), p.to_numpy(p.get_grad(param)))
            for st in stages for name, param in st.named_params}
    everyone = p.all_gather_object(mine)
    if p.rank != 0:
        return float("nan")
    values = {name: value for part in everyone for name, (value, _) in part.items()}
    grads = {name: grad for part in everyone for name, (_, grad) in part.items()}
    models = _models(p)
    _, reference = models.full_batch_grads(models.GPTFull(config, values), tokens, targets)
    tie_to = dict([TIED_PARAMS[::-1]]) if config.tie_embeddings else {}
    return max(float(np.abs(grad - reference[tie_to.get(name, name)]).max()) for name, grad in grads.items())


def train_worker(opts: DemoOptions, verbose: bool = True) -> dict[str, Any]:
    """One rank of the demo; returns this rank's losses per step and the gradient check."""
    p = get_platform()
    stages, schedule, (config, ids) = build_pipeline(opts, p)
    params = [param for st in stages for param in st.params]
    optimizer = Adam(p, params, opts.lr)
    rng = np.random.default_rng(opts.seed)
    step_losses, grad_diff = [], float("nan")
    for step in range(opts.steps):
        tokens, targets = sample_batch(ids, opts.batch_size, opts.seq_len, rng)
        losses = schedule.run(p.from_numpy(tokens), target=p.from_numpy(targets))
        if losses:
            loss = float(np.mean([p.to_numpy(x) for x in losses]))
            step_losses.append(loss)
            if verbose:
                print(f"step {step + 1}/{opts.steps}  loss {loss:.4f}", flush=True)
        if step == opts.steps - 1:
            grad_diff = _max_grad_diff(p, stages, config, tokens, targets)
        optimizer.step()
        for st in stages:
            st.zero_grad()
    return {"rank": p.rank, "losses": step_losses, "max_grad_diff": grad_diff,
            "peak_activations": schedule.peak_activations}
