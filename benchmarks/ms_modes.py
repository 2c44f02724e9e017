"""MindSpore stage step time in PyNative, PyNative with compiled (jit) stages, and GRAPH_MODE.

One stage step is the forward and the backward of one micro-batch of the demo model
(``hyper_parallel.demo`` GPT, its 4-stage split; micro-batch = the demo's 2 sequences of 32
tokens), run through the platform API (``MindSporePlatform.stage_forward`` / ``stage_backward``,
or ``stage_backward_input`` + ``stage_backward_weight`` for the dx/dW split), exactly as the
pipeline runtime calls it. Two stages: a middle one (2 blocks, hidden in and out) and the last
one (1 block, final norm, head and the cross-entropy loss, called through a loss closure like
the runtime's). Then the same two stages of a larger model (d_model 256, micro-batch 8 x 128
tokens), compiled variants only, where compute outweighs the fixed cost of each call.

Variants, each on its own stage Cells built from the same weights:

* ``PyNative``            eager ops, ``HYPER_PARALLEL_MS_COMPILE=eager`` (the engine path);
* ``PyNative + jit``      the platform compiles the stage Cell with ``ms.jit`` (``=jit``);
* ``GRAPH_MODE``          ``ms.set_context(mode=ms.GRAPH_MODE)``, default ``=auto``;
* ``... @ms.jit loss_fn`` (last stage) the user's loss function compiled too;
* ``... recompute``       the same with ``HYPER_PARALLEL_MS_AUTOGRAD=recompute`` (public APIs);
* ``GRAPH_MODE, GradOperation`` the design the library does not use: the forward as the Cell's
  graph, the backward as one compiled ``GradOperation(sens_param=True)`` graph (forward again +
  backward; the split as a dx-only graph and a dW-only graph, each with its own forward).

Every round runs each variant once (full step, then split step), the order alternating, so
load on the shared machine hits all alike; the table gives the median over the rounds, and the
first step of each variant (compilation included). The whole measurement runs twice from this
one invocation, in two child processes: with MindSpore's default asynchronous kernel dispatch,
and with ``ms.runtime.launch_blocking()`` (synchronous; cannot be undone in a process).
Wall time, each step ended by reading a result back (``asnumpy``). Writes
benchmarks/results/ms_modes.md.

    .venv/bin/python benchmarks/ms_modes.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

NUM_STAGES = 4
STAGES = {"middle (stage 1 of 4)": 1, "last (stage 3 of 4, with loss)": 3}
KEYS = ("full step", "forward", "backward", "split step", "dx", "dW")


@dataclass
class Variant:
    label: str
    graph_mode: bool
    compile: str = "eager"
    autograd: str = "engine"
    grad_operation: bool = False
    jit_loss: bool = False  # the user's loss_fn decorated with @ms.jit (last stage only)
    first: dict[str, float] = field(default_factory=dict)


def _config() -> Any:
    from hyper_parallel.demo.gpt import CharTokenizer, load_tiny_corpus
    from hyper_parallel.demo.train import DemoOptions, model_config

    opts = DemoOptions()
    return model_config(CharTokenizer.from_text(load_tiny_corpus()).vocab_size, opts.seq_len)


def _sync(value: Any) -> None:
    while isinstance(value, (tuple, list)):
        value = next(v for v in value if v is not None)
    value.asnumpy()


class StageCase:
    """One stage of the demo model and its micro-batch, with the runtime's way of calling it."""

    def __init__(self, stage_index: int, config: Any, micro_batch: int, jit_loss: bool = False) -> None:
        from mindspore import ops

        from hyper_parallel.demo import gpt_mindspore as models
        from hyper_parallel.demo.gpt import init_gpt_weights

        self.module = models.GPTStage(config, stage_index, NUM_STAGES, init_gpt_weights(config, 0))
        self.params = tuple(self.module.trainable_params())
        rng = np.random.default_rng(stage_index)
        seq = config.max_seq_len
        import mindspore as ms

        self.x = ms.Tensor(rng.standard_normal((micro_batch, seq, config.d_model)).astype(np.float32))
        self.last = self.module.is_last
        if self.last:
            target = ms.Tensor(rng.integers(0, config.vocab_size, (micro_batch, seq)).astype(np.int64))
            module, loss_fn = self.module, models.cross_entropy_loss
            if jit_loss:
                loss_fn = ms.jit(loss_fn)

            def with_loss(*a: Any) -> Any:  # as the pipeline runtime wraps its last stage
                out = module(*a)
                return loss_fn(out, target), out

            with_loss.__wrapped__ = module  # type: ignore[attr-defined]
            self.fn: Callable[..., Any] = with_loss
            self.target = target
            self.grads = lambda outs: (ops.ones_like(outs[0]), None)
        else:
            self.fn = self.module
            dy = ms.Tensor(rng.standard_normal((micro_batch, seq, config.d_model)).astype(np.float32))
            self.grads = lambda outs: (dy,)


class PlatformRunner:
    """A variant that goes through ``MindSporePlatform``."""

    def __init__(self, variant: Variant, case: StageCase) -> None:
        from hyper_parallel.platform.mindspore import MindSporePlatform

        self.p = MindSporePlatform(autograd=variant.autograd, compile=variant.compile)
        self.case = case

    def full(self) -> tuple[float, float]:
        c, p = self.case, self.p
        t0 = time.perf_counter()
        rec = p.stage_forward(c.fn, (c.x,), {}, c.params, (True,))
        _sync(rec.outputs[0])
        t1 = time.perf_counter()
        dx = p.stage_backward(rec, c.grads(rec.outputs))
        _sync((dx, p.get_grad(c.params[-1])))
        t2 = time.perf_counter()
        p.zero_grads(c.params)
        return t1 - t0, t2 - t1

    def split(self) -> tuple[float, float, float]:
        c, p = self.case, self.p
        t0 = time.perf_counter()
        rec = p.stage_forward(c.fn, (c.x,), {}, c.params, (True,))
        _sync(rec.outputs[0])
        t1 = time.perf_counter()
        dx = p.stage_backward_input(rec, c.grads(rec.outputs))
        _sync(dx)
        t2 = time.perf_counter()
        p.stage_backward_weight(rec)
        _sync(p.get_grad(c.params[-1]))
        t3 = time.perf_counter()
        p.zero_grads(c.params)
        return t1 - t0, t2 - t1, t3 - t2


class GradOperationRunner:
    """Forward: the Cell's graph. Backward: compiled GradOperation graphs taking the output
    gradient as ``sens`` (they run the forward again). Not a library path: for comparison."""

    def __init__(self, variant: Variant, case: StageCase) -> None:
        import mindspore as ms
        from mindspore import nn, ops

        from hyper_parallel.demo import gpt_mindspore as models

        self.case = case
        weights = ms.ParameterTuple(case.params)
        if case.last:
            class LossCell(nn.Cell):
                def __init__(self, inner: Any) -> None:
                    super().__init__(auto_prefix=False)  # keeps the stage's parameter names
                    self.inner = inner

                def construct(self, x: Any, target: Any) -> Any:
                    return models.cross_entropy_loss(self.inner(x), target)

            net: Any = LossCell(case.module)
            self.args = (case.x, case.target)
            self.sens = ops.ones((), ms.float32)
        else:
            net = case.module
            self.args = (case.x,)
            self.sens = case.grads(None)[0]
        self.net = net
        self.all = ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)(net, weights)
        self.dx = ops.GradOperation(get_all=True, sens_param=True)(net)
        self.dw = ops.GradOperation(get_by_list=True, sens_param=True)(net, weights)

    def full(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        _sync(self.net(*self.args))
        t1 = time.perf_counter()
        _sync(self.all(*self.args, self.sens))
        return t1 - t0, time.perf_counter() - t1

    def split(self) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        _sync(self.net(*self.args))
        t1 = time.perf_counter()
        _sync(self.dx(*self.args, self.sens))
        t2 = time.perf_counter()
        _sync(self.dw(*self.args, self.sens))
        return t1 - t0, t2 - t1, time.perf_counter() - t2


VARIANTS = [
    Variant("PyNative", graph_mode=False),
    Variant("PyNative + jit", graph_mode=False, compile="jit"),
    Variant("GRAPH_MODE", graph_mode=True, compile="auto"),
    Variant("GRAPH_MODE, @ms.jit loss_fn", graph_mode=True, compile="auto", jit_loss=True),
    Variant("PyNative, recompute", graph_mode=False, autograd="recompute"),
    Variant("PyNative + jit, recompute", graph_mode=False, compile="jit", autograd="recompute"),
    Variant("GRAPH_MODE, recompute", graph_mode=True, compile="auto", autograd="recompute"),
    Variant("GRAPH_MODE, GradOperation (not used)", graph_mode=True, grad_operation=True),
]


def _cases() -> list[tuple[str, Any, int, list[Variant]]]:
    """(name, model config, micro-batch size, variants): the demo's, and a larger stage where
    compute outweighs fixed per-call costs (only the compiled variants: eager is too slow)."""
    from hyper_parallel.demo.gpt import GPTConfig

    large = GPTConfig(vocab_size=64, max_seq_len=128, d_model=256, n_heads=4, n_layers=6)
    compiled = [v for v in VARIANTS if v.graph_mode]
    return [("demo, 2 x 32 tokens", _config(), 2, VARIANTS),  # the demo: batch 16 in 8 micro-batches
            ("d_model 256, 8 x 128 tokens", large, 8, compiled)]


def _measure(stage_index: int, config: Any, micro_batch: int, variants: list[Variant],
             repeats: int) -> dict[str, dict[str, float]]:
    import mindspore as ms

    runners = []
    last = stage_index == NUM_STAGES - 1
    variants = [v for v in variants if last or not v.jit_loss]
    for v in variants:
        ms.set_context(mode=ms.GRAPH_MODE if v.graph_mode else ms.PYNATIVE_MODE)
        case = StageCase(stage_index, config, micro_batch, v.jit_loss)
        runner = (GradOperationRunner if v.grad_operation else PlatformRunner)(v, case)
        t = time.perf_counter()
        runner.full()
        runner.split()
        runners.append((v, runner, time.perf_counter() - t))
    samples: dict[str, dict[str, list[float]]] = {v.label: {k: [] for k in KEYS} for v in variants}
    for i in range(repeats):
        for v, runner, _ in runners if i % 2 == 0 else runners[::-1]:
            ms.set_context(mode=ms.GRAPH_MODE if v.graph_mode else ms.PYNATIVE_MODE)
            gc.collect()
            fwd, bwd = runner.full()
            sfwd, dx, dw = runner.split()
            for key, value in zip(KEYS, (fwd + bwd, fwd, bwd, sfwd + dx + dw, dx, dw)):
                samples[v.label][key].append(value * 1e3)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    out = {}
    for v, _, first in runners:
        got = samples[v.label]
        q1, _, q3 = statistics.quantiles(got["full step"], n=4)
        out[v.label] = {**{k: statistics.median(got[k]) for k in KEYS}, "first": first * 1e3, "q1": q1, "q3": q3}
    return out


def child(repeats: int, dispatch: str) -> dict[str, Any]:
    import mindspore as ms

    ms.set_device("CPU")
    if dispatch == "blocking":
        ms.runtime.launch_blocking()
    results: dict[str, Any] = {}
    for case_name, config, micro_batch, variants in _cases():
        for stage_name, stage_index in STAGES.items():
            results[f"{case_name} | {stage_name}"] = _measure(stage_index, config, micro_batch, variants, repeats)
    return results


def table(results: dict[str, dict[str, Any]], repeats: int) -> list[str]:
    lines = [
        "MindSpore 2.10 on this project's CPU machine (2 shared cores): one stage step (forward + backward "
        "of one micro-batch) of the demo GPT (d_model 64, 4 heads, 6 blocks in "
        f"{NUM_STAGES} stages; micro-batch of 2 x 32 tokens as in the demo) and of a larger one (d_model 256, "
        "micro-batch 8 x 128 tokens, compiled variants only) through MindSporePlatform. "
        f"Milliseconds of wall time, median of {repeats} "
        "rounds (all variants alternating in one process); 'full step' = forward + stage_backward, its "
        "quartiles show the noise; 'split step' = forward + stage_backward_input (dx) + "
        "stage_backward_weight (dW); 'first' = the first full + split step, compilation included. "
        "'async' is MindSpore's default kernel dispatch, 'blocking' is ms.runtime.launch_blocking().",
        "",
        "| dispatch | model, micro-batch | stage | variant | full step | (quartiles) | forward | backward "
        "| split step | dx | dW | first |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dispatch, by_stage in results.items():
        for stage_name, by_variant in by_stage.items():
            for label, t in by_variant.items():
                lines.append(
                    f"| {dispatch} | {stage_name} | {label} | {t['full step']:.1f} | {t['q1']:.1f}-{t['q3']:.1f} "
                    f"| {t['forward']:.1f} | {t['backward']:.1f} | {t['split step']:.1f} | {t['dx']:.1f} "
                    f"| {t['dW']:.1f} | {t['first']:.0f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--child", choices=("async", "blocking"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.repeats, args.child)), flush=True)
        return
    results = {}
    for dispatch in ("async", "blocking"):
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--repeats", str(args.repeats),
                               "--child", dispatch], capture_output=True, text=True, cwd=os.getcwd(),
                              env=dict(os.environ, PYTHONPATH=ROOT), check=False)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            raise SystemExit(f"the {dispatch} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
        results[dispatch] = json.loads(line[len("RESULT "):])
        print("\n".join(table({dispatch: results[dispatch]}, args.repeats)[4:]), flush=True)
    lines = table(results, args.repeats)
    out_dir = os.path.join(ROOT, "benchmarks", "results")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "ms_modes.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
