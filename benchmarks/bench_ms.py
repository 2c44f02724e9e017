"""Section 6 of ``make bench``: MindSpore on LocalCluster (MindSpore has no CPU point-to-point).

* The demo's GPT (d_model 64, 6 blocks, 4 stages, micro-batch 2 x 32 tokens), 1F1B on 4
  LocalCluster ranks: stage Cells in PyNative (``HYPER_PARALLEL_MS_COMPILE=eager``) against stage
  Cells compiled with ``ms.jit`` (``=jit``), the two alternating round by round, one untimed step
  per round first (the compilation). Wall time of one schedule step; LocalCluster ranks are
  threads of one process taking turns, so a step is the sum of all ranks' work.
* The turn-taking itself: two LocalCluster ranks passing a 4-byte tensor back and forth
  (``isend``/``irecv`` + ``wait``), per one-way message, and on a torch LocalCluster for scale.

Runs in a child process (``python bench_ms.py --child``) so MindSpore's process-wide context does
not touch the torch sections.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
P, MICRO, MB, SEQ = 4, 4, 2, 32
PINGS = 200


def _gpt_body(config: Any, batch: Any, steps: int, warm: bool) -> list[float]:
    import importlib

    from hyper_parallel import PipelineStage, Schedule1F1B
    from hyper_parallel.demo.gpt import init_gpt_weights
    from hyper_parallel.platform import get_platform

    p = get_platform()
    mod = importlib.import_module(f"hyper_parallel.demo.gpt_{p.name}")
    stage = PipelineStage(mod.GPTStage(config, p.rank, P, init_gpt_weights(config)), p.rank, P)
    schedule = Schedule1F1B(stage, MICRO, loss_fn=mod.cross_entropy_loss)
    tokens = p.from_numpy(batch[0])
    target = p.from_numpy(batch[1]) if stage.is_last else None
    times = []
    for step in range(steps + int(warm)):
        start = time.perf_counter()
        schedule.run(tokens, target=target)
        if step or not warm:
            times.append(time.perf_counter() - start)
    return times


def _ping_body(n: int) -> float:
    from hyper_parallel.platform import get_platform

    p = get_platform()
    buf = p.zeros((1,))
    p.barrier()
    start = time.perf_counter()
    for _ in range(n):
        if p.rank == 0:
            p.isend(buf, 1).wait()
            p.irecv(buf, 1).wait()
        else:
            p.irecv(buf, 0).wait()
            p.isend(buf, 0).wait()
    return (time.perf_counter() - start) / (2 * n)


def child(rounds: int, steps: int, small: bool = False) -> dict:
    import numpy as np

    from hyper_parallel.demo.gpt import GPTConfig
    from hyper_parallel.platform.local import LocalCluster

    seq = 8 if small else SEQ
    config = GPTConfig(vocab_size=64, max_seq_len=seq, d_model=16 if small else 64, n_heads=4, n_layers=4 if small else 6)
    rng = np.random.default_rng(0)
    batch = tuple(rng.integers(0, 64, (MICRO * MB, seq)).astype(np.int64) for _ in range(2))
    times: dict[str, list[float]] = {"eager": [], "jit": []}
    for r in range(rounds):
        for mode in (("eager", "jit") if r % 2 == 0 else ("jit", "eager")):
            os.environ["HYPER_PARALLEL_MS_COMPILE"] = mode
            times[mode] += LocalCluster(P, platform="mindspore").run(_gpt_body, config, batch, steps, not small)[0]
    ping = {fw: [] for fw in ("mindspore", "torch")}
    for _ in range(3):
        for fw in ping:
            ping[fw].append(LocalCluster(2, platform=fw).run(_ping_body, 20 if small else PINGS)[0])
    return {"gpt": times, "ping": ping, "config": {"d_model": config.d_model, "n_layers": config.n_layers,
                                                    "seq": seq, "micro_batch": MB, "m": MICRO}}


def measure(rounds: int, steps: int, small: bool = False, timeout: float = 600) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(rounds), str(steps),
                           "small" if small else "full"],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_ms child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(result: dict) -> list[dict]:
    eager, jit = (statistics.median(result["gpt"][m]) for m in ("eager", "jit"))
    c = result["config"]
    model = f"d_model {c['d_model']}, {c['n_layers']} blocks, m={c['m']} x {c['micro_batch']} x {c['seq']} tokens"
    ping = {fw: statistics.median(v) for fw, v in result["ping"].items()}
    return [
        {"what": f"GPT 1F1B step ({model}), PyNative stage Cells", "ms": eager * 1e3, "vs_pynative": 1.0},
        {"what": f"GPT 1F1B step ({model}), ms.jit stage Cells", "ms": jit * 1e3, "vs_pynative": jit / eager},
        {"what": "LocalCluster turn (one message), MindSpore", "ms": ping["mindspore"] * 1e3,
         "vs_pynative": ping["mindspore"] / eager},
        {"what": "LocalCluster turn (one message), torch", "ms": ping["torch"] * 1e3,
         "vs_pynative": ping["torch"] / eager},
    ]


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        sys.path[:0] = [ROOT, HERE]
        print(json.dumps(child(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "small")), flush=True)
    else:
        sys.exit("usage: bench_ms.py --child ROUNDS STEPS small|full (started by bench.py)")
