"""The ``hyper-parallel`` command: ``demo`` (the main job), ``chart`` (see a schedule) and the
schedule tools of ``cli_tools.py`` (simulate, visualize, profile, tune, partition, dryrun, calibrate)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

DESCRIPTION = (
    "Pipeline-parallel training with one schedule code on PyTorch and MindSpore. "
    "'demo' trains a small GPT on several pipeline ranks and checks its gradients against one "
    "non-pipelined step; 'chart' prints a schedule as an ASCII chart with its bubble fraction; "
    "simulate, visualize, profile, tune, partition and dryrun plan and inspect schedules."
)


def _version() -> str:
    from hyper_parallel import __version__

    return __version__


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none (the help text then says what applies)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def _int_at_least(low: int) -> Any:
    """An argparse ``type`` for integers >= ``low`` (the error names the value)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    return parse


def _chart_text(schedule: str, ranks: int, chunks: int, micro_batches: int) -> str:
    from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel
    from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate
    from hyper_parallel.core.pipeline_parallel.tools.visualize import ascii_chart
    from hyper_parallel.demo import SCHEDULES

    schedule_class = SCHEDULES[schedule][0]
    compute = schedule_class.generate(ranks, chunks, micro_batches)
    placement = schedule_class.stage_placement(ranks, chunks)
    result = simulate(compute, placement, CostModel.per_rank_share(ranks, len(placement) // ranks))
    header = (f"{schedule_class.__name__}: {ranks} ranks x {chunks} stage(s) per rank, {micro_batches} micro-batches "
              f"(F=1, B=2 ms per rank's share of the model)")
    return f"{header}\n{ascii_chart(result)}"


def _check_backend(parser: argparse.ArgumentParser, backend: str) -> None:
    """Fail with the extra to install when the backend's framework cannot be imported."""
    from hyper_parallel.platform import platform_class

    try:
        platform_class(backend)
    except ImportError as exc:
        parser.error(str(exc))


def _resolve_chunks(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from hyper_parallel.demo import SCHEDULES
    from hyper_parallel.demo.train import check_chunks

    chunks = SCHEDULES[args.schedule][1] if args.chunks is None else args.chunks
    try:
        check_chunks(args.schedule, chunks)
    except ValueError as exc:
        parser.error(f"argument --chunks: {exc}")
    return chunks


def _check_micro_batches(parser: argparse.ArgumentParser, args: argparse.Namespace, chunks: int) -> None:
    from hyper_parallel.demo.train import check_micro_batches

    try:
        check_micro_batches(args.schedule, args.ranks, chunks, args.micro_batches)
    except ValueError as exc:
        parser.error(f"argument --micro-batches: {exc}")


def _demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from hyper_parallel.demo.train import check_ranks

    try:
        check_ranks(args.ranks)
    except ValueError as exc:
        parser.error(f"argument --ranks: {exc}")
    chunks = _resolve_chunks(parser, args)
    _check_micro_batches(parser, args, chunks)
    if args.batch_size % args.micro_batches:
        parser.error(f"--batch-size {args.batch_size} does not split into --micro-batches {args.micro_batches} "
                     "equal micro-batches; choose a batch size that is a multiple of the micro-batch count")
    if args.graph_mode and args.backend != "mindspore":
        parser.error("--graph-mode is MindSpore's GRAPH_MODE: it needs --backend mindspore")
    _check_backend(parser, args.backend)

    import numpy as np

    from hyper_parallel.demo import DemoOptions, train_worker

    opts = DemoOptions(schedule=args.schedule, ranks=args.ranks, steps=args.steps, micro_batches=args.micro_batches,
                       batch_size=args.batch_size, chunks=chunks, graph_mode=args.graph_mode)
    where = "torch gloo processes" if args.backend == "torch" else "MindSpore LocalCluster ranks"
    if args.graph_mode:
        where += " in GRAPH_MODE (each stage step runs as compiled graphs)"
    print(f"hyper-parallel demo: a small GPT (tied embeddings) on the shipped text, {opts.ranks} pipeline ranks "
          f"as {where}\n")
    print(_chart_text(opts.schedule, opts.ranks, chunks, opts.micro_batches) + "\n", flush=True)
    results: list[Any]
    if args.backend == "torch":
        from hyper_parallel.platform.torch.launch import launch_local

        results = launch_local(train_worker, opts.ranks, opts)
    else:
        from hyper_parallel.demo.train import run_on_local_cluster

        results = run_on_local_cluster(opts)
    losses = next(r["losses"] for r in results if r["losses"])
    diff = results[0]["max_grad_diff"]
    print(f"\nloss: {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
    print("peak in-flight activations per rank:", [r["peak_activations"] for r in results])
    tolerance = 1e-5 if args.backend == "torch" else 1e-4
    verdict = "OK" if np.isfinite(diff) and diff <= tolerance else "MISMATCH"
    print(f"max |gradient difference| vs the same step without a pipeline: {diff:.3e} ({verdict}, "
          f"tolerance {tolerance:g})")
    return 0 if verdict == "OK" else 1


def _chart(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    chunks = _resolve_chunks(parser, args)
    _check_micro_batches(parser, args, chunks)
    print(_chart_text(args.schedule, args.ranks, chunks, args.micro_batches))
    return 0


def _add_schedule_options(parser: argparse.ArgumentParser, schedules: list[str]) -> None:
    parser.add_argument("--schedule", choices=schedules, default="1f1b", help="pipeline schedule")
    parser.add_argument("--ranks", type=_int_at_least(2), default=4, help="pipeline ranks, at least 2")
    parser.add_argument("--micro-batches", type=_int_at_least(1), default=8,
                        help="micro-batches per training step")
    parser.add_argument("--chunks", type=_int_at_least(1), default=None,
                        help="stages per rank: interleaved-1f1b 2 or more, looped-bfs and interleaved-zb 1 or "
                             "more, zbv and dualpipev exactly 2 (V placement), gpipe and 1f1b exactly 1 (default: "
                             "2 for the multi-stage schedules, else 1)")


def build_parser() -> argparse.ArgumentParser:
    from hyper_parallel.demo import SCHEDULES

    schedules = sorted(SCHEDULES)
    formatter = _HelpFormatter
    parser = argparse.ArgumentParser(prog="hyper-parallel", description=DESCRIPTION, formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"hyper-parallel {_version()}")
    from hyper_parallel.cli_tools import TOOLS, add_tool_commands

    sub = parser.add_subparsers(dest="command", title="commands", metavar="{" + ",".join(("demo", "chart", *TOOLS)) + "}")
    demo = sub.add_parser(
        "demo", formatter_class=formatter,
        help="train a small GPT with pipeline parallelism and check its gradients",
        description="Train a small GPT on the text shipped with the package on several pipeline ranks "
                    "(torch: gloo processes started by torch's launcher; mindspore: LocalCluster ranks in "
                    "this process), then compare every gradient of the last step with one non-pipelined step.",
    )
    demo.add_argument("--backend", choices=("torch", "mindspore"), default="torch", help="framework to train with")
    _add_schedule_options(demo, schedules)
    demo.add_argument("--steps", type=_int_at_least(1), default=8, help="training steps")
    demo.add_argument("--batch-size", type=_int_at_least(1), default=16,
                      help="sequences per step; a multiple of --micro-batches")
    demo.add_argument("--graph-mode", action="store_true",
                      help="with --backend mindspore: train under MindSpore's GRAPH_MODE (each stage's forward "
                           "and backward run as compiled graphs)")
    demo.set_defaults(handler=_demo, sub_parser=demo)
    chart = sub.add_parser(
        "chart", formatter_class=formatter,
        help="print a schedule as an ASCII chart with its bubble fraction",
        description="Print which step each rank runs at each time unit (forward 1, backward 2), "
                    "with the schedule's bubble fraction. Nothing is trained.",
    )
    _add_schedule_options(chart, schedules)
    chart.set_defaults(handler=_chart, sub_parser=chart)
    add_tool_commands(sub, formatter)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if argv[:1] == ["dryrun"] and "--" in argv:  # what follows -- belongs to the user's script
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    if script_args:
        args.script_args = script_args
    if args.command is None:
        parser.print_help()
        return 0
    if args.command in _PLANNING_COMMANDS:
        from hyper_parallel.core.pipeline_parallel.lowering import plan_cache
        from hyper_parallel.core.pipeline_parallel.lowering.gc_pause import paused_gc

        # millions of small objects that all live until the command ends: the cyclic collector would
        # scan them again and again (about 1.2 s of 7 for simulate at p = 64, v = 4, m = 1024)
        with paused_gc():
            try:
                return args.handler(args.sub_parser, args)
            finally:
                # the kept schedules would only be torn down at exit, where that costs about ten times
                # more (1.2 s for tune's last four candidates at p = 64, m = 1024)
                plan_cache.clear()
    return args.handler(args.sub_parser, args)


_PLANNING_COMMANDS = ("simulate", "tune", "chart")


if __name__ == "__main__":
    sys.exit(main())
