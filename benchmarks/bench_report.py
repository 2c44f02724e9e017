"""The tables of ``make bench``: ``results.md`` from the results that also go to ``results.json``."""

from __future__ import annotations

from typing import Any

TARGETS = {
    "efficiency": "efficiency >= 0.97 (GPipe, 1F1B), >= 0.95 (interleaved); ours / torch <= 0.95",
    "overhead": "ours / torch per lowered step <= 0.5",
    "memory": "ours saved = theory and ours total <= torch's",
    "gpt": "tokens/s ours / torch >= 1.0",
    "planning": "ours <= max(torch, 1 s) per rank, time at 2m <= 2.2 x time at m, peak < 1 GiB",
}
TITLES = {
    "efficiency": "1. Schedule efficiency (sleep-cost stages, 4 gloo processes)",
    "overhead": "2. Runtime overhead per lowered step (Linear(16, 16) per stage, 4 gloo processes)",
    "p2p": "3. Exposed P2P time (1F1B sleep workload, large activations vs 64 bytes)",
    "memory": "4. Peak live activations per rank (counted)",
    "gpt": "5. Tiny GPT (the demo model), tokens/s",
    "ms": "6. MindSpore on LocalCluster",
    "profile": "7. Profile of one step (rank 1, cProfile tottime per step)",
    "planning": "8. Planning at scale (one rank's schedule construction, ours vs torch)",
}


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    def cell(v: Any) -> str:
        if isinstance(v, bool):
            return "yes" if v else "**no**"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return lines


def _section(name: str, res: Any, params: dict[str, Any]) -> list[str]:
    p = params.get(name, {})
    out = [f"## {TITLES[name]}", ""]
    if name == "planning":
        import planning_scale

        out += planning_scale.lines(res, p.get("smoke", False))[2:]
    if name == "efficiency":
        out += [f"m={p['m']}; per rank F={10 * p['scale']:g} ms, B={20 * p['scale']:g} ms (I=W={10 * p['scale']:g} ms "
                f"for the split-backward schedules), a rank's v chunks share it; median of {p['rounds']} alternating "
                "rounds. Efficiency = ideal makespan (simulated, free communication) / measured.", ""]
        out += _table(["schedule", "v", "ideal (ms)", "ours (ms)", "torch (ms)", "ours eff.", "torch eff.",
                       "ours / torch"],
                      [[r["schedule"], r["chunks"], r["ideal_ms"], r["ours_ms"], r["torch_ms"], r["ours_eff"],
                        r["torch_eff"], r["ours_over_torch"]] for r in res])
        if res and "machine_bound_ms" in res[0]:
            out += ["", f"Machine bound: the same simulation with this machine's measured one-way message latency "
                    f"({res[0]['latency_ms']:.3f} ms between neighbours) on every hop and each sleep's measured "
                    f"overshoot ({res[0]['sleep_extra_ms']:.3f} ms per call): no runtime can beat it here. The "
                    "efficiency against it is the share of the makespan the runtime itself does not lose.", ""]
            out += _table(["schedule", "machine bound (ms)", "ours eff. of bound", "torch eff. of bound"],
                          [[r["schedule"], r["machine_bound_ms"], r["ours_eff_of_bound"], r["torch_eff_of_bound"]]
                           for r in res])
    elif name == "overhead":
        out += [f"m={p['m']}, median of {p['rounds']} alternating rounds; per lowered step = step time / the busiest "
                "rank's lowered steps in our lists (same divisor for both).", ""]
        out += _table(["schedule", "lowered steps", "ours step (ms)", "torch step (ms)", "ours us/step",
                       "torch us/step", "ours / torch"],
                      [[r["schedule"], r["lowered_steps"], r["ours_step_ms"], r["torch_step_ms"],
                        r["ours_us_per_step"], r["torch_us_per_step"], r["ours_over_torch"]] for r in res])
    elif name == "p2p":
        out += [f"m={p['m']}, median of {p['rounds']} alternating rounds. delta = makespan(large) - makespan(small); "
                "compute on path = (m + p - 1) x the extra local forward+backward time of the large tensors; "
                "exposed = delta - compute on path; in messages = exposed / one measured one-way message.", ""]
        out += _table(["variant", "activation (KiB)", "small (ms)", "large (ms)", "delta (ms)",
                       "compute on path (ms)", "exposed (ms)", "one message (ms)", "exposed, in messages"],
                      [[r["variant"], r["activation_kib"], r["small_ms"], r["big_ms"], r["delta_ms"],
                        r["compute_on_path_ms"], r["exposed_ms"], r["message_ms"], r["exposed_messages"]] for r in res])
    elif name == "memory":
        out += [f"m={p['m']}, 4 ranks. saved = peak stage micro-batches of saved activations held by autograd graphs; "
                "outputs = peak stage outputs still holding data; total = both, by distinct tensor, in KiB.", ""]
        out += _table(["schedule", "rank", "theory", "ours saved", "torch saved", "ours outputs", "torch outputs",
                       "ours total (KiB)", "torch total (KiB)", "ours = theory", "ours <= torch"],
                      [[r["schedule"], r["rank"], r["theory"], r["ours_saved"], r["torch_saved"], r["ours_outputs"],
                        r["torch_outputs"], r["ours_total_kib"], r["torch_total_kib"], r["ours_eq_theory"],
                        r["ours_le_torch"]] for r in res])
    elif name == "gpt":
        out += [f"d_model 64, 8 blocks, micro-batch 2 x 32 tokens, m={p['m']}, median of {p['rounds']} alternating "
                "rounds.", ""]
        out += _table(["processes", "schedule", "tokens/step", "ours tok/s", "torch tok/s", "ours / torch"],
                      [[r["processes"], r["schedule"], r["tokens_per_step"], r["ours_tok_s"], r["torch_tok_s"],
                        r["ours_over_torch"]] for r in res])
    elif name == "ms":
        out += [f"Median of {p['rounds']} alternating rounds x {p['steps']} step(s), the first (compiling) step of "
                "each round untimed. Ranks take turns in one process, so a step is the sum of all ranks' work.", ""]
        out += _table(["what", "ms", "vs PyNative step"], [[r["what"], r["ms"], r["vs_pynative"]] for r in res])
    elif name == "profile":
        out += [f"1F1B, m={p['m']}, Linear(16, 16) per stage, {p['steps']} step(s) profiled on rank 1; own time per step.",
                ""]
        out += _table(["category", "ours (ms)", "ours share", "torch (ms)", "torch share"],
                      [[r["category"], r["ours_ms"], r["ours_share"], r["torch_ms"], r["torch_share"]]
                       for r in res["rows"]])
        calls = res["calls_per_step"]
        out += ["", f"Python function calls per step: ours {calls['ours']:.0f}, torch {calls['torch']:.0f}.", ""]
        for lib in ("ours", "torch"):
            out += [f"Top functions, {lib}:", ""]
            out += _table(["own ms/step", "calls/step", "function"], [[t, n, f"`{f}`"] for t, n, f in res["top"][lib]])
            out.append("")
    if name in TARGETS:
        out += ["", f"Target: {TARGETS[name]}."]
    return out + [""]


def markdown(results: dict[str, Any]) -> str:
    kind = "smoke run (figures mean nothing)" if results.get("smoke") else "full run"
    lines = ["# Benchmark results: hyper_parallel vs torch.distributed.pipelining", "",
             f"Written by `benchmarks/bench.py` ({kind}); {results.get('total_seconds', 0):.0f} s in all. "
             "Ours and torch's alternate within one invocation; times are medians, compare the ratios (the machine "
             "is a shared, noisy 2-core CPU box).", ""]
    for name in TITLES:
        if name in results:
            lines += _section(name, results[name], results["params"])
    secs = results.get("seconds", {})
    if secs:
        lines += ["Section wall times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in secs.items()) + ".", ""]
    return "\n".join(lines)
