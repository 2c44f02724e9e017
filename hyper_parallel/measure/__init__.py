"""Jobs that measure this machine with real processes: ``hyper-parallel calibrate`` and
``benchmarks/fidelity.py``.

``calibration_job`` launches the calibration on local processes (a neighbour ping-pong, then the
library's own runtime training a pipeline of sleep-cost stages with tracing on) and turns what it
measured into a machine file; ``sleep_pipeline`` builds and times such a pipeline on one rank.
Like ``demo/``, this is user-level code: it picks a framework backend (torch: gloo, NCCL, HCCL)
and launches its processes, so it lives outside ``core/``. It may import the core, its tools and
``hyper_parallel.platform``.
"""
