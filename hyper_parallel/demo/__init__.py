"""The shipped demo: a small GPT (framework-neutral spec, torch and MindSpore versions) and its training job.

This package is user-level code, like ``examples/``: the GPT modules import torch or MindSpore
directly. The library itself (``hyper_parallel.core``) never does; only ``hyper_parallel.platform``
and this demo touch a framework.
"""

from hyper_parallel.demo.train import SCHEDULES, Adam, DemoOptions, train_worker

__all__ = ["SCHEDULES", "Adam", "DemoOptions", "train_worker"]
