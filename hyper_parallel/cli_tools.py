"""The schedule tools of the ``hyper-parallel`` command: simulate, visualize, profile, tune,
partition, dryrun, calibrate. None of them needs a framework except ``profile``, ``dryrun`` and
``calibrate``."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Any

from hyper_parallel.cli_paths import output_path, picture_path

TOOLS = ("simulate", "visualize", "profile", "tune", "partition", "dryrun", "calibrate")


def _int_at_least(low: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    return parse


_BYTE_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20,
               "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> float:
    """``17179869184``, ``16GiB``, ``16e9``, ``512 MB`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).lower() not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"must be a byte count such as 17179869184, 16GiB or 512MB, got {text!r}")
    value = float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 bytes, got {text!r}")
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must list integers >= 1, got {text!r}")
    return values


def _float_from(low: float, inclusive: bool) -> Any:
    """An argparse ``type`` for finite numbers above ``low`` (or from it, when ``inclusive``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>=' if inclusive else '>'} {low:g}, "
                                             f"got {text!r}")
        return value

    return parse


_positive_float = _float_from(0.0, inclusive=False)


def _float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a comma-separated list of numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("must list at least one number")
    return values


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def _load_costs(parser: argparse.ArgumentParser, path: str | None) -> Any:
    from hyper_parallel.core.pipeline_parallel.simulation.costs import load_costs

    if path is None:
        return None
    try:
        return load_costs(path)
    except (OSError, ValueError) as exc:
        parser.error(f"argument --costs: {exc}")


def _load_machine(parser: argparse.ArgumentParser, path: str | None) -> Any:
    from hyper_parallel.core.pipeline_parallel.simulation.machine import load_machine

    if path is None:
        return None
    try:
        return load_machine(path)
    except ValueError as exc:
        parser.error(f"argument --machine: {exc}")


def _machine_transport(args: argparse.Namespace, machine: Any) -> str:
    """``--transport`` as given; without it ``batch`` for a machine calibrated on NCCL or HCCL
    (what ``p2p_transport="auto"`` picks there), else ``plain``. Warns (stderr) when the machine
    file was calibrated with another number of processes than ``-p``."""
    info = machine.info if machine is not None and isinstance(machine.info, dict) else {}
    nproc = info.get("nproc")
    if isinstance(nproc, int) and not isinstance(nproc, bool) and nproc != args.ranks:
        print(f"warning: {args.machine} was calibrated with {nproc} processes, not {args.ranks}: its per-step "
              f"costs may differ with {args.ranks} (calibrate with --nproc {args.ranks})", file=sys.stderr)
    if args.transport is not None:
        return args.transport
    return "batch" if info.get("backend") in ("nccl", "hccl") else "plain"


# ---------------------------------------------------------------------- simulate


def _simulate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from hyper_parallel.core.pipeline_parallel.tools.catalog import chunk_range, default_chunks, resolve_schedule
    from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel
    from hyper_parallel.core.pipeline_parallel.simulation.runtime_costs import run_lowering
    from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate_schedule
    from hyper_parallel.core.pipeline_parallel.lowering.validate import ScheduleError
    from hyper_parallel.core.pipeline_parallel.tools.visualize import ascii_chart

    try:
        name, cls = resolve_schedule(args.schedule)
    except ValueError as exc:
        parser.error(f"argument --schedule: {exc}")
    chunks = default_chunks(cls) if args.chunks is None else args.chunks
    low, high = chunk_range(cls)
    if not low <= chunks <= high:
        parser.error(f"argument -v/--chunks: {name} runs {low}..{high} chunks per rank, got {chunks}")
    if args.machine is not None and args.compute_only:
        parser.error("argument --compute-only: not allowed with --machine (a machine file predicts the lowered "
                     "lists run() executes; give the runtime costs in a costs file to simulate compute-only lists)")
    if args.compute_only and args.no_overlap_p2p:
        parser.error("argument --no-overlap-p2p: not allowed with --compute-only (it chooses lowered lists)")
    costs = _load_costs(parser, args.costs)
    machine = _load_machine(parser, args.machine)
    stages = len(cls.stage_placement(args.ranks, chunks))
    if costs is None:
        costs = CostModel.per_rank_share(args.ranks, stages // args.ranks, activation_bytes=1.0)
        where = "uniform costs: F = 1 ms, B = 2 ms per rank's share of the model"
        memory_note = ("peak act mem: in units of one micro-batch's activations of a rank's share of the model "
                       "(uniform costs)")
    else:
        memory_note = "peak act mem: bytes"
    if args.costs is not None:
        try:
            costs = costs.for_stages(stages)
        except ValueError as exc:
            parser.error(f"argument --costs: {args.costs}: {exc}")
        where = f"costs from {args.costs}"
    if machine is not None:
        costs = machine.apply(costs)
        where += f", machine {args.machine}"
    transport = _machine_transport(args, machine)
    like_run = run_lowering(transport, costs.runtime is not None, not args.no_overlap_p2p)
    try:
        plan, result = simulate_schedule(cls, args.ranks, chunks, args.micro_batches, costs,
                                         lowered=not args.compute_only, transport=transport, **like_run)
    except (ValueError, ScheduleError) as exc:
        print(f"hyper-parallel simulate: {exc}", file=sys.stderr)
        return 1
    measured, measured_facts = None, None
    if args.measured:
        measured, measured_facts = _read_trace(parser, args.measured, "--measured", with_facts=True)
    if args.trace:
        from hyper_parallel.core.pipeline_parallel.tools.visualize import write_chrome_trace

        write_chrome_trace(args.trace, result, measured, measured_facts=measured_facts)
    if args.png:
        _plot(parser, args.png, [("plan", result.records, "ms")] + ([("run", measured, "s")] if measured else []),
              f"{plan.name}: p={args.ranks}, v={plan.num_chunks}, m={args.micro_batches}")
    summary = {"schedule": name, "class": plan.name, "ranks": args.ranks, "chunks": plan.num_chunks,
               "micro_batches": args.micro_batches, "costs": args.costs, **result.summary()}
    if machine is not None:
        summary["machine"] = args.machine
    if measured is not None:
        from hyper_parallel.core.pipeline_parallel.tools.trace import compare

        summary["compare"] = compare(measured, result.records)
    if args.json:
        _print_json(summary)
        return 0
    print(f"{plan.name}: {args.ranks} ranks x {plan.num_chunks} stage(s) per rank, {args.micro_batches} "
          f"micro-batches ({where})")
    print(ascii_chart(result, width=args.width, mode=args.chart))
    print()
    print(_rank_table(result))
    print(memory_note)
    if measured is not None:
        print()
        print(_compare_text(summary["compare"]))
    for path in (args.trace, args.png):
        if path:
            print(f"wrote {path}")
    return 0


def _rank_table(result: Any) -> str:
    lines = [f"{'rank':>4} {'busy ms':>10} {'bubble':>8} {'bubble %':>9} {'peak act':>9} {'peak act mem':>15}"]
    for row in result.summary()["ranks"]:
        lines.append(f"{row['rank']:>4} {row['busy_ms']:>10.4g} {row['bubble_fraction']:>8.4f} "
                     f"{100 * row['bubble_fraction']:>8.2f}% {row['peak_activations']:>9} "
                     f"{row['peak_activation_bytes']:>15.6g}")
    lines.append(f"makespan {result.makespan:.6g} ms; overall bubble {result.bubble_fraction:.4f} "
                 f"({100 * result.bubble_fraction:.2f}%)")
    return "\n".join(lines)


def _compare_text(report: dict[str, Any]) -> str:
    ratio = report["makespan_ratio"]
    lines = [f"measured makespan {report['measured_makespan_ms']:.4g} ms vs planned "
             f"{report['planned_makespan_ms']:.4g} ms" + (f" (x{ratio:.3g})" if ratio else ""),
             f"bubble: measured {report['measured_bubble_fraction']:.1%}, planned "
             f"{report['planned_bubble_fraction']:.1%}"]
    for rank, where in report["order_mismatch"].items():
        if where is not None:
            lines.append(f"rank {rank}: step order differs from the plan at compute step {where['index']}: "
                         f"ran {where['measured']}, planned {where['planned']}")
    return "\n".join(lines)


def _read_trace(parser: argparse.ArgumentParser, path: str, option: str, with_facts: bool = False) -> Any:
    """The run (else the only part, else the first) of a trace file; with ``with_facts`` also what
    its ``otherData`` says of that part (`trace.load_trace_facts`)."""
    from hyper_parallel.core.pipeline_parallel.tools.trace import load_trace, load_trace_facts

    try:
        parts = load_trace(path)
        facts = load_trace_facts(path) if with_facts else {}
    except (OSError, ValueError) as exc:
        parser.error(f"argument {option}: {exc}")
    label = next((k for k in ("run", "") if parts.get(k)), next(iter(parts), ""))
    records = parts.get(label, [])
    return (records, facts.get(label)) if with_facts else records


def _plot(parser: argparse.ArgumentParser, path: str, panels: list, title: str) -> None:
    from hyper_parallel.core.pipeline_parallel.tools.visualize import plot_timelines

    try:
        plot_timelines(path, panels, title)
    except ImportError as exc:
        parser.error(str(exc))
    except ValueError as exc:
        parser.error(f"argument --png: {exc}")


# ---------------------------------------------------------------------- visualize


def _visualize(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from hyper_parallel.core.pipeline_parallel.tools.trace import compare, load_trace, load_trace_facts
    from hyper_parallel.core.pipeline_parallel.tools.visualize import ascii_chart, result_from_records

    try:
        parts = load_trace(args.trace)
        facts = load_trace_facts(args.trace)
    except (OSError, ValueError) as exc:
        parser.error(f"argument TRACE: {exc}")
    if not any(parts.values()):
        parser.error(f"argument TRACE: {args.trace} holds no step records")
    plan, plan_facts = _read_trace(parser, args.plan, "--plan", with_facts=True) if args.plan else (parts.get("plan"),
                                                                                                   None)
    run = parts.get("run") or parts.get("")
    shown = [(label or "trace", records, facts.get(label)) for label, records in sorted(parts.items())]
    if args.plan:
        shown.insert(0, ("plan", plan, plan_facts))
    report = compare(run, plan, "s", "s") if run and plan else None
    if args.png:
        _plot(parser, args.png, [(label, records, "s") for label, records, _ in shown], os.path.basename(args.trace))
    if args.json:
        data = {"trace": args.trace}
        for label, records, known in shown:
            result = result_from_records(records, "s", known)
            data[label] = result.summary()
        if report is not None:
            data["compare"] = report
        _print_json(data)
        return 0
    for label, records, known in shown:
        result = result_from_records(records, "s", known)
        print(f"{label}: {len({r['rank'] for r in records})} ranks, {len(records)} records (times in ms)")
        print(ascii_chart(result, width=args.width, mode=args.chart))
        print()
        print(_rank_table(result))
        print()
    if report is not None:
        print(_compare_text(report))
    if args.png:
        print(f"wrote {args.png}")
    return 0


# ---------------------------------------------------------------------- profile


def load_profile_script(path: str, entry: str, num_stages: int | None) -> dict[str, Any]:
    """Run the user's profile function and normalise what it returns (see docs/tools.md)."""
    import runpy

    if not os.path.isfile(path):
        raise ValueError(f"no such script: {path}")
    namespace = runpy.run_path(path, run_name="hyper_parallel_profile")
    fn = namespace.get(entry)
    if not callable(fn):
        raise ValueError(f"{path} defines no function {entry!r} (the profile convention: {entry}(num_stages) "
                         "returning the stage modules and one sample micro-batch)")
    out = fn(num_stages) if num_stages is not None else fn()
    if isinstance(out, tuple) and len(out) == 2:
        out = {"stages": out[0], "inputs": out[1]}
    if not isinstance(out, dict) or "stages" not in out or "inputs" not in out:
        raise ValueError(f"{entry}() must return (stages, sample) or a dict with 'stages' and 'inputs' "
                         f"(optional 'loss_fn', 'target'), got {type(out).__name__}")
    bad = sorted(set(out) - {"stages", "inputs", "loss_fn", "target"})
    if bad:
        raise ValueError(f"{entry}() returned unknown key(s) {', '.join(bad)}")
    return out


def _profile(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel, save_costs
    from hyper_parallel.core.pipeline_parallel.tools.profile import profile_stages
    from hyper_parallel.platform import platform_class

    try:
        platform = platform_class(args.backend)()
    except ImportError as exc:
        parser.error(str(exc))
    try:
        spec = load_profile_script(args.script, args.entry, args.stages)
    except ValueError as exc:
        parser.error(f"argument SCRIPT: {exc}")
    result = profile_stages(spec["stages"], spec["inputs"], platform=platform, loss_fn=spec.get("loss_fn"),
                            target=spec.get("target"), warmup=args.warmup, repeats=args.repeats,
                            fit_overhead=not args.no_overhead, threads=args.threads, max_spread=args.max_spread)
    costs = result.costs
    if args.as_layers:
        costs = CostModel(stages=costs.stages, layers=costs.stages, micro_batch_size=costs.micro_batch_size)
    save_costs(costs, args.output)
    if args.json:
        _print_json({"output": args.output, "threads": result.threads, "repeats": args.repeats,
                     "max_spread": args.max_spread, "spread": result.spread, "warnings": result.warnings,
                     "notes": result.notes, "costs": costs.to_json()})
        return 0
    threads = "an unknown number of" if result.threads is None else result.threads
    print(f"profiled {len(costs.stages)} stage(s) of {args.script} on {args.backend}, micro-batch size "
          f"{costs.micro_batch_size}, {threads} CPU thread(s) (median of {args.repeats} after {args.warmup} "
          "warm-up round(s))")
    print(f"{'stage':>5} {'F ms':>9} {'B ms':>9} {'I ms':>9} {'W ms':>9} {'spread':>7} {'act bytes':>11} "
          f"{'out bytes':>10} {'param bytes':>12} {'overhead':>9}")
    for k, s in enumerate(costs.stages):
        spread = max(result.spread[k].values())
        print(f"{k:>5} {s.F:>9.4g} {s.B:>9.4g} {s.I:>9.4g} {s.W:>9.4g} {spread:>7.0%} {s.activation_bytes:>11.0f} "
              f"{s.output_bytes:>10.0f} {s.param_bytes:>12.0f} {s.overhead_ms:>9.3g}")
    print(f"spread: the largest median absolute deviation of the stage's F/B/I/W repeats, relative to the median "
          f"(warned above {args.max_spread:.0%})")
    for note in result.notes:
        print(f"note: {note}")
    for warning in result.warnings:
        print(f"warning: {warning}")
    print(f"wrote {args.output}")
    return 0


# ---------------------------------------------------------------------- tune


def _tune(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from hyper_parallel.core.pipeline_parallel.tools.catalog import available_schedules, resolve_schedule
    from hyper_parallel.core.pipeline_parallel.tools.tune import default_jobs, format_table, tune

    if args.no_overlap_p2p and not (args.lowered or args.machine):
        parser.error("argument --no-overlap-p2p: needs --lowered or --machine (it chooses lowered lists)")
    costs = _load_costs(parser, args.costs)
    machine = _load_machine(parser, args.machine)
    if machine is not None:
        costs = machine.apply(costs)
    schedules = available_schedules()
    if args.schedules:
        try:
            schedules = dict(resolve_schedule(n.strip()) for n in args.schedules.split(",") if n.strip())
        except ValueError as exc:
            parser.error(f"argument --schedules: {exc}")
    micro = None
    if args.micro_batches:
        bad = [m for m in args.micro_batches if args.global_batch % m]
        if bad:
            parser.error(f"argument --micro-batches: {bad[0]} does not divide --global-batch {args.global_batch}")
        micro = args.micro_batches
    result = tune(costs, args.memory_limit, args.global_batch, args.ranks, schedules=schedules,
                  chunk_options=args.chunks, micro_batches=micro, state_factor=args.state_factor,
                  lowered=args.lowered or machine is not None, transport=_machine_transport(args, machine),
                  search=args.search, jobs=args.jobs or default_jobs(), overlap_p2p=not args.no_overlap_p2p)
    if args.save_order:
        if result.best is None or result.best.order is None:
            print("hyper-parallel tune: --save-order: the choice is a library schedule, not a searched order "
                  "(nothing written)", file=sys.stderr)
        else:
            from hyper_parallel.core.pipeline_parallel.ir.schedule_csv import save_schedule_csv

            save_schedule_csv(args.save_order, result.best.order)
    if args.json:
        _print_json(result.to_json())
        return 0 if result.best else 1
    print(f"{len(result.candidates)} candidates for {args.ranks} ranks, global batch {args.global_batch}, "
          f"memory limit {args.memory_limit:.6g} bytes per rank")
    print(format_table(result, args.top))
    if result.best is None:
        print("nothing fits: raise --memory-limit, or allow more micro-batches or chunks")
        return 1
    b = result.best
    print(f"\nchoice: {b.schedule} with {b.num_chunks} chunk(s) per rank and {b.num_microbatches} micro-batches "
          f"of {b.micro_batch_size}: makespan {b.makespan_ms:.4g} ms, bubble {b.bubble_fraction:.1%}, "
          f"peak memory {b.peak_memory_bytes:.6g} bytes per rank")
    return 0


# ---------------------------------------------------------------------- partition


def _partition(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from hyper_parallel.core.pipeline_parallel.simulation.partition import balanced_ranges, rank_ranges

    if (args.costs is None) == (args.layer_costs is None):
        parser.error("give exactly one of --costs and --layer-costs")
    if args.costs is not None:
        costs = _load_costs(parser, args.costs)
        units = costs.layers or costs.stages
        values = [u.F + u.B for u in units]
    else:
        values = args.layer_costs
    try:
        if args.chunks == 1 and args.placement == "looped":
            part = balanced_ranges(values, args.ranks)
        else:
            part = rank_ranges(values, args.ranks, args.chunks, args.placement)
    except ValueError as exc:
        parser.error(str(exc))
    from hyper_parallel.core.pipeline_parallel.simulation.partition import stage_owners

    owners = stage_owners(args.ranks, args.chunks, args.placement)
    data = {"ranges": [list(r) for r in part.ranges], "layers_per_stage": part.layer_counts(),
            "stage_costs": list(part.stage_costs), "stage_to_rank": owners,
            "rank_loads": list(part.rank_loads) or list(part.stage_costs), "bottleneck": part.bottleneck,
            "busiest_rank": part.busiest_rank, "optimal": part.optimal}
    if args.json:
        _print_json(data)
        return 0
    print(f"{len(values)} layers into {len(part.ranges)} stages on {args.ranks} ranks ({args.placement} placement)")
    print(f"{'stage':>5} {'rank':>4} {'layers':>12} {'cost':>10}")
    for s, ((a, b), c) in enumerate(zip(part.ranges, part.stage_costs)):
        print(f"{s:>5} {owners[s]:>4} {f'[{a}, {b})':>12} {c:>10.4g}")
    print(f"slowest stage {part.bottleneck:.4g}, busiest rank {part.busiest_rank:.4g}"
          + ("" if part.optimal else " (search stopped at its node budget: best found)"))
    return 0


# ---------------------------------------------------------------------- dryrun


def _dryrun(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from hyper_parallel.dryrun import dry_run
    from hyper_parallel.platform import platform_class

    try:
        platform_class(args.backend)
    except ImportError as exc:
        parser.error(str(exc))
    if not os.path.isfile(args.script):
        parser.error(f"argument SCRIPT: no such script: {args.script}")
    script_args = list(args.script_args)
    report = dry_run(args.script, args.ranks, args.backend, script_args)
    plan = report.check.get("plan")
    traced = [r for rank in report.ranks for r in rank.trace]
    if args.trace:
        from hyper_parallel.core.pipeline_parallel.tools.visualize import write_chrome_trace

        if traced:
            write_chrome_trace(args.trace, plan, traced, measured_facts=report.trace_facts())
        elif plan is not None:
            write_chrome_trace(args.trace, plan)
    if args.json:
        data = report.to_json()
        data["trace"] = {"runtime_records": len(traced), "written": args.trace if (traced or plan) else None}
        _print_json(data)
        return 0 if report.check.get("status") in ("ok", "no pipeline schedule ran") else 1
    print(f"dry run of {args.script} on {args.ranks} {args.backend} LocalCluster rank(s)\n")
    print("stage boundaries (point-to-point messages):")
    for row in report.boundaries():
        print(f"  rank {row['src']} -> rank {row['dst']}: {row['dtype']}{row['shape']} x {row['count']} "
              f"({row['bytes']} bytes each)")
    if not report.boundaries():
        print("  none")
    print("\nactivations held per rank (forwards waiting for their backward):")
    for r in report.ranks:
        held = "not measured on this backend" if r.peak_bytes is None else f"{r.peak_bytes} bytes"
        print(f"  rank {r.rank}: peak {r.peak_forwards} forward(s), {held}")
    check = report.check
    print(f"\nschedule check: {check.get('status')}"
          + (f" ({check['class']}, {check.get('micro_batch_num')} micro-batches, {check.get('transport')})"
             if "class" in check else ""))
    if check.get("status") == "invalid":
        print(check["error"])
    if plan is not None:
        print(f"planned with uniform costs: makespan {plan.makespan:g} ms, bubble {plan.bubble_fraction:.1%}, "
              f"peak activations " + " ".join(f"r{k}={v}" for k, v in sorted(plan.peak_activations.items())))
    if args.trace:
        what = "measured step trace" if traced else "planned trace (the runtime records no step trace yet)"
        print(f"wrote {args.trace}: {what}")
    return 0 if check.get("status") in ("ok", "no pipeline schedule ran") else 1


# ---------------------------------------------------------------------- calibrate


def _calibrate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from hyper_parallel.measure.calibration_job import calibrate, check_backend

    try:
        check_backend(args.backend, args.nproc)
    except ValueError as exc:
        parser.error(f"argument --backend: {exc}")
    try:  # a file that is there, opened as it will be but not truncated (root passes os.access)
        if os.path.exists(args.out):
            os.close(os.open(args.out, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
    except OSError as exc:
        parser.error(f"argument --out: cannot write {args.out}: {exc.strerror or exc}")
    data = calibrate(args.nproc, args.backend)
    try:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
    except OSError as exc:  # found only by writing (a file of /proc, a full disk): after the calibration
        if args.json:
            _print_json(data)
        parser.error(f"argument --out: cannot write {args.out}: {exc.strerror or exc} (the calibration was "
                     "not saved; with --json it was printed)")
    if args.json:
        _print_json(data)
        return 0
    rt, link, info = data["runtime"], data["p2p"], data["machine"]
    bandwidth = link["bandwidth_gb_per_s"]
    print(f"calibrated {args.nproc} {args.backend} processes of {info['host']} (workload: "
          f"{', '.join(info['workload']['schedules'])}; m = {info['workload']['micro_batches']}, "
          f"F = {info['workload']['fwd_ms']:g} ms, B = {info['workload']['bwd_ms']:g} ms)")
    print(f"link: one-way {link['latency_ms']:.3f} ms in the runtime (ping-pong {info['ping_pong_one_way_ms']:.3f} ms), "
          + (f"{bandwidth:.3g} GB/s" if bandwidth else "bandwidth not measurable"))
    print("per compute step beyond its compute (ms):   " + "  ".join(
        f"{k} {rt['compute_ms'][k]:.3f} / {rt['received_ms'][k]:.3f}" for k in ("F", "B", "I", "W"))
        + "   (input local / just received)")
    print("posting: send {send_ms:.3f}, receive {recv_ms:.3f}, metadata {meta_ms:.3f}, batched group {batch_ms:.3f}; "
          "wait on arrived data {wait_ms:.3f}; per run {run_ms:.3f} ms".format(**rt))
    print(f"wrote {args.out}")
    return 0


# ---------------------------------------------------------------------- parser


def add_tool_commands(sub: Any, formatter: Any) -> None:
    """Add the tool subcommands to the ``hyper-parallel`` parser's subparsers."""
    from hyper_parallel.core.pipeline_parallel.lowering.p2p import TRANSPORTS  # no framework import

    p = sub.add_parser("simulate", formatter_class=formatter,
                       help="simulate a schedule: chart, makespan, bubbles, peak activations",
                       description="Generate, lower and simulate a schedule with all ranks together (deadlocks "
                                   "are found), then print its chart, makespan, bubble fraction per rank and "
                                   "overall, and peak activations per rank. Without --costs every rank's share "
                                   "of the model costs F = 1 ms and B = 2 ms, split over its chunks.")
    p.add_argument("--schedule", default="1f1b",
                   help="schedule name (gpipe, 1f1b, interleaved-1f1b, looped-bfs, interleaved-zb, zbv, dualpipev), "
                        "a class name, or module:Class")
    p.add_argument("-p", "--ranks", type=_int_at_least(1), default=4, help="pipeline ranks")
    p.add_argument("-m", "--micro-batches", type=_int_at_least(1), default=8, help="micro-batches")
    p.add_argument("-v", "--chunks", type=_int_at_least(1), default=None,
                   help="stages per rank (default: 2 for multi-chunk schedules, else 1)")
    p.add_argument("--costs", default=None, help="costs file (JSON, see docs/tools.md)")
    p.add_argument("--transport", choices=TRANSPORTS, default=None,
                   help="P2P transport: plain (eager sends, gloo) or batch (one stream, NCCL/HCCL); default: "
                        "batch for a --machine file calibrated on nccl or hccl, else plain")
    p.add_argument("--compute-only", action="store_true", help="simulate the compute lists without lowering")
    p.add_argument("--no-overlap-p2p", action="store_true",
                   help="simulate the lists of schedule.run() with overlap_p2p=False (receives posted where they "
                        "are waited for; default: the lists of overlap_p2p=True, receives posted ahead)")
    p.add_argument("--chart", choices=("auto", "full", "wrap", "compact"), default="auto", help="chart layout")
    p.add_argument("--width", type=_int_at_least(20), default=None, help="chart width (default: the terminal's)")
    p.add_argument("--trace", type=output_path, default=None, help="write a Chrome/Perfetto trace JSON here")
    p.add_argument("--png", type=picture_path, default=None,
                   help="write a PNG or SVG timeline here (needs matplotlib)")
    p.add_argument("--measured", default=None,
                   help="a measured trace to compare with and draw beside the plan")
    p.add_argument("--machine", default=None,
                   help="machine file of 'hyper-parallel calibrate': its link and the runtime's own cost per step "
                        "replace the costs file's link, and the lists are lowered as schedule.run() lowers them "
                        "(--compute-only is refused with it); about 1.5x the CPU time of a plain simulation")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON instead of the chart")
    p.set_defaults(handler=_simulate, sub_parser=p)

    p = sub.add_parser("visualize", formatter_class=formatter, help="chart a trace file (planned or measured)",
                       description="Print the chart and per-rank numbers of a trace: a records file, or a "
                                   "Chrome trace written by 'simulate --trace'; draw it as PNG/SVG.")
    p.add_argument("trace", metavar="TRACE", help="trace file (JSON)")
    p.add_argument("--plan", default=None, help="a planned trace to compare the measured one with")
    p.add_argument("--png", type=picture_path, default=None,
                   help="write a PNG or SVG timeline here (needs matplotlib)")
    p.add_argument("--chart", choices=("auto", "full", "wrap", "compact"), default="auto", help="chart layout")
    p.add_argument("--width", type=_int_at_least(20), default=None, help="chart width (default: the terminal's)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    p.set_defaults(handler=_visualize, sub_parser=p)

    p = sub.add_parser("profile", formatter_class=formatter,
                       help="measure F/B/I/W times and memory of a model's stages -> costs.json",
                       description="Import SCRIPT, call its profile function (default build_stages(num_stages)), "
                                   "which returns the stage modules and one sample micro-batch, and time every "
                                   "stage's forward and backward steps through the platform.")
    p.add_argument("script", metavar="SCRIPT", help="the model script")
    p.add_argument("--entry", default="build_stages", help="name of the profile function in SCRIPT")
    p.add_argument("--stages", type=_int_at_least(1), default=None,
                   help="number of stages passed to the profile function (default: call it without arguments)")
    p.add_argument("--backend", choices=("torch", "mindspore"), default="torch", help="framework")
    p.add_argument("--warmup", type=_int_at_least(0), default=1, help="untimed rounds over all stages")
    p.add_argument("--repeats", type=_int_at_least(1), default=5,
                   help="timed rounds over all stages (each stage once per round; the median is kept)")
    p.add_argument("--threads", type=_int_at_least(1), default=1,
                   help="CPU threads the framework measures with (1: what torchrun gives each process)")
    p.add_argument("--max-spread", type=_positive_float, default=0.25,
                   help="warn when a stage's repeats, or identical stages, differ by more than this fraction")
    p.add_argument("--no-overhead", action="store_true", help="skip the half-batch runs that fit overhead_ms")
    p.add_argument("--as-layers", action="store_true",
                   help="also write the entries as 'layers' so tune and simulate can regroup them")
    p.add_argument("-o", "--output", type=output_path, default="costs.json", help="costs file to write")
    p.add_argument("--json", action="store_true", help="print the costs as JSON")
    p.set_defaults(handler=_profile, sub_parser=p)

    p = sub.add_parser("tune", formatter_class=formatter,
                       help="choose schedule, chunks and micro-batches for a memory limit",
                       description="Simulate every available schedule, chunk count and micro-batch count that "
                                   "divides the global batch; choose the smallest makespan whose per-rank memory "
                                   "(state-factor x parameter bytes + peak activation bytes) fits the limit.")
    p.add_argument("--costs", required=True, help="costs file (JSON)")
    p.add_argument("--memory-limit", type=parse_bytes, required=True, help="bytes per rank, e.g. 16GiB")
    p.add_argument("--global-batch", type=_int_at_least(1), required=True, help="samples per training step")
    p.add_argument("-p", "--ranks", type=_int_at_least(1), required=True, help="pipeline ranks")
    p.add_argument("--schedules", default=None, help="comma-separated schedule names (default: all available)")
    p.add_argument("--chunks", type=_int_list, default=[1, 2, 3, 4], help="chunk counts to try")
    p.add_argument("--micro-batches", type=_int_list, default=None,
                   help="micro-batch counts to try (default: every divisor of the global batch)")
    p.add_argument("--state-factor", type=_float_from(0.0, inclusive=True), default=4.0,
                   help="bytes of weights, gradients and optimizer state per parameter byte")
    p.add_argument("--lowered", action="store_true", help="simulate lowered lists (slower)")
    p.add_argument("--transport", choices=TRANSPORTS, default=None,
                   help="P2P transport (with --lowered); default: batch for a --machine file calibrated on nccl "
                        "or hccl, else plain")
    p.add_argument("--machine", default=None,
                   help="machine file of 'hyper-parallel calibrate' (implies --lowered, so every candidate is "
                        "lowered: several times slower at scale; see simulate --machine)")
    p.add_argument("--no-overlap-p2p", action="store_true",
                   help="with --lowered: simulate the lists of schedule.run() with overlap_p2p=False (see simulate)")
    p.add_argument("--search", action="store_true",
                   help="also build custom step orders within the memory limit (search-* candidates)")
    p.add_argument("--save-order", type=output_path, default=None, help="write the chosen searched order here as a schedule CSV")
    p.add_argument("--top", type=_int_at_least(1), default=20, help="table rows to print")
    p.add_argument("--jobs", type=_int_at_least(1), default=None,
                   help="worker processes simulating candidates side by side (default: the usable CPUs, at most 8)")
    p.add_argument("--json", action="store_true", help="print the choice and every candidate as JSON")
    p.set_defaults(handler=_tune, sub_parser=p)

    p = sub.add_parser("partition", formatter_class=formatter, help="split layers into balanced stages",
                       description="Split consecutive layers into stages minimizing the slowest stage (one "
                                   "chunk per rank) or the busiest rank (several chunks, looped or V placement).")
    p.add_argument("--costs", default=None, help="costs file: its layers (or stages) weighed by F + B")
    p.add_argument("--layer-costs", type=_float_list, default=None, help="comma-separated cost of each layer")
    p.add_argument("-p", "--ranks", type=_int_at_least(1), default=4, help="pipeline ranks")
    p.add_argument("-v", "--chunks", type=_int_at_least(1), default=1, help="stages per rank")
    p.add_argument("--placement", choices=("looped", "v"), default="looped", help="stage placement")
    p.add_argument("--json", action="store_true", help="print the ranges as JSON")
    p.set_defaults(handler=_partition, sub_parser=p)

    p = sub.add_parser("dryrun", formatter_class=formatter,
                       help="run a training script with all ranks in this process and report",
                       description="Run SCRIPT once per rank on LocalCluster (threads of this process) and "
                                   "report the stage boundary shapes, activations held per rank, the schedule "
                                   "check and a trace. Arguments after -- go to the script: "
                                   "hyper-parallel dryrun train.py --ranks 4 -- --steps 2")
    p.add_argument("script", metavar="SCRIPT", help="the training script")
    p.add_argument("--ranks", type=_int_at_least(1), default=2, help="world size")
    p.add_argument("--backend", choices=("torch", "mindspore"), default="torch", help="framework")
    p.add_argument("--trace", type=output_path, default=None, help="write a Chrome trace here")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(handler=_dryrun, sub_parser=p, script_args=[])

    p = sub.add_parser("calibrate", formatter_class=formatter,
                       help="measure this machine's link and the runtime's own cost per step -> machine.json",
                       description="Start NPROC processes of this machine and measure, with the library's own "
                                   "runtime on sleep-cost stages of its own, the one-way latency and bandwidth "
                                   "between neighbours and what the runtime costs per lowered step; write them "
                                   "as a machine file for 'simulate --machine' and 'tune --machine'.")
    p.add_argument("--nproc", type=_int_at_least(2), default=2, help="processes (pipeline ranks) to measure with")
    p.add_argument("--backend", choices=("gloo", "nccl", "hccl"), default="gloo",
                   help="communication backend (gloo: CPU processes; nccl: CUDA; hccl: Ascend)")
    p.add_argument("--out", type=output_path, default="machine.json", help="machine file to write")
    p.add_argument("--json", action="store_true", help="print the machine file as JSON")
    p.set_defaults(handler=_calibrate, sub_parser=p)
