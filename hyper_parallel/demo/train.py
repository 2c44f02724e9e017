"""The main job: pipeline-parallel training of a small GPT on the text shipped with the package.

``train_worker`` runs on every rank (a torch gloo process, or a LocalCluster rank for
MindSpore). It trains for a few steps, and on the last step compares every parameter
gradient of the pipeline with one non-pipelined step of the same model on the same batch.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
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
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
from hyper_parallel.core.pipeline_parallel.zero_bubble_schedules import (
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.base import Platform
from hyper_parallel.demo.gpt import (
    TIED_PARAMS,
    CharTokenizer,
    GPTConfig,
    init_gpt_weights,
    load_tiny_corpus,
    sample_batch,
)

# name -> (schedule class, default stages per rank)
SCHEDULES: dict[str, tuple[type[PipelineSchedule], int]] = {
    "gpipe": (ScheduleGPipe, 1),
    "1f1b": (Schedule1F1B, 1),
    "interleaved-1f1b": (ScheduleInterleaved1F1B, 2),
    "looped-bfs": (ScheduleLoopedBFS, 2),
    "interleaved-zb": (ScheduleInterleavedZeroBubble, 2),
    "zbv": (ScheduleZBVZeroBubble, 2),
    "dualpipev": (ScheduleDualPipeV, 2),
}


def check_chunks(schedule: str, chunks: int) -> None:
    """Raise ValueError unless ``schedule`` can run ``chunks`` stages per rank."""
    schedule_class = SCHEDULES[schedule][0]
    low, high = schedule_class.min_chunks, schedule_class.max_chunks
    if high == 1 and chunks != 1:
        several = ", ".join(name for name, (cls, _) in SCHEDULES.items() if cls.max_chunks > 1)
        raise ValueError(f"the {schedule} schedule runs one stage per rank, so chunks must be 1, got {chunks} "
                         f"(several stages per rank: {several})")
    if low == high and chunks != low:
        raise ValueError(f"the {schedule} schedule runs exactly {low} stages per rank, got chunks={chunks}")
    if not low <= chunks <= high:
        raise ValueError(f"the {schedule} schedule runs between {low} and {high} stages per rank, got chunks={chunks}")


N_LAYERS = 6  # transformer blocks of the demo's GPT (model_config)


def check_ranks(ranks: int) -> None:
    """Raise ValueError if the demo's GPT has fewer transformer blocks than ``ranks`` (a rank would get none)."""
    if ranks > N_LAYERS:
        raise ValueError(f"the demo's GPT has {N_LAYERS} transformer blocks, so it runs on at most {N_LAYERS} "
                         f"pipeline ranks, got {ranks}")


def check_micro_batches(schedule: str, ranks: int, chunks: int, micro_batches: int) -> None:
    """Raise ValueError if ``schedule`` needs more than ``micro_batches`` micro-batches."""
    minimum = SCHEDULES[schedule][0].min_microbatches(ranks, chunks)
    if micro_batches < minimum:
        raise ValueError(f"the {schedule} schedule needs at least {minimum} micro-batches with {ranks} ranks, "
                         f"got {micro_batches}")


@dataclass(frozen=True)
class DemoOptions:
    """What the demo runs; ``chunks`` (stages per rank) defaults to the schedule's own default."""

    schedule: str = "1f1b"
    ranks: int = 4
    steps: int = 8
    micro_batches: int = 8
    batch_size: int = 16
    seq_len: int = 32
    lr: float = 3e-3
    seed: int = 0
    chunks: int | None = None
    graph_mode: bool = False  # MindSpore only: train under GRAPH_MODE (see run_on_local_cluster)

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose from {', '.join(SCHEDULES)}")
        if self.chunks is None:
            object.__setattr__(self, "chunks", SCHEDULES[self.schedule][1])
        for name, low in (("ranks", 2), ("steps", 1), ("micro_batches", 1), ("batch_size", 1), ("seq_len", 1),
                          ("chunks", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        check_ranks(self.ranks)
        check_chunks(self.schedule, self.chunks)
        check_micro_batches(self.schedule, self.ranks, self.chunks, self.micro_batches)
        if self.batch_size % self.micro_batches:
            raise ValueError(f"batch_size {self.batch_size} must divide into {self.micro_batches} micro-batches")


def model_config(vocab_size: int, seq_len: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab_size, max_seq_len=seq_len, d_model=64, n_heads=4, n_layers=N_LAYERS,
                     tie_embeddings=True)


def _models(platform: Platform) -> Any:
    return importlib.import_module(f"hyper_parallel.demo.gpt_{platform.name}")


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
    schedule_class, chunks = SCHEDULES[opts.schedule][0], opts.chunks
    assert chunks is not None  # DemoOptions resolved it
    placement = schedule_class.stage_placement(platform.world_size, chunks)  # looped, or V (zbv, dualpipev)
    num_stages = len(placement)
    stages = []
    for s in sorted(st for st, rank in placement.items() if rank == platform.rank):
        ties = {}
        if s == 0:
            ties = {"embedding": TIED_PARAMS[0]}
        elif s == num_stages - 1:
            ties = {"embedding": TIED_PARAMS[1]}
        stages.append(PipelineStage(models.GPTStage(config, s, num_stages, weights), s, num_stages,
                                    shared_parameters=ties))
    schedule = schedule_class(stages if schedule_class.max_chunks > 1 else stages[0], opts.micro_batches,
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


@contextlib.contextmanager
def mindspore_mode(graph: bool) -> Iterator[None]:
    """MindSpore's ``GRAPH_MODE`` (or ``PYNATIVE_MODE``) for the body, the previous mode after it.

    The mode is process-wide, so it is set around the whole LocalCluster job, not in a rank.
    """
    import mindspore as ms

    old = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE if graph else ms.PYNATIVE_MODE)
    try:
        yield
    finally:
        ms.set_context(mode=old)


def run_on_local_cluster(opts: DemoOptions, verbose: bool = True) -> list[dict[str, Any]]:
    """The MindSpore demo: every rank of ``opts`` on one LocalCluster, in GRAPH_MODE if asked.

    In GRAPH_MODE the platform runs each stage step as compiled graphs (``ms.jit``) recorded by
    MindSpore's autograd engine, so the gradient check at the end covers the compiled stages.
    """
    from hyper_parallel.platform.local import LocalCluster

    with mindspore_mode(opts.graph_mode):
        return LocalCluster(opts.ranks, platform="mindspore").run(train_worker, opts, verbose)
