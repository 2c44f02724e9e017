"""examples/hf_llama_pipeline.py on 4 torchrun gloo processes with short settings: the pipelined loss
of the first step equals the loss of the whole Hugging Face model (its own forward) on the same batch,
and the checkpoint is keyed by the Hugging Face parameter names."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT, run_torchrun

pytest.importorskip("transformers")
pytest.importorskip("tqdm")

EXAMPLE = os.path.join(REPO_ROOT, "examples", "hf_llama_pipeline.py")
SHORT = ["--steps", "2", "--layers", "8", "--hidden", "32", "--seq", "16", "--vocab", "128", "--batch", "8",
         "--micro-batches", "4"]


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def test_help_says_steps_is_the_total():
    proc = subprocess.run([sys.executable, EXAMPLE, "--help"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "--steps STEPS total training steps, counted from step 0: with --resume, training goes on from the " \
           "checkpoint's step up to this one" in text
    assert "--resume continue from the checkpoint in --ckpt" in text and "--steps stays the total" in text
    proc = subprocess.run([sys.executable, EXAMPLE, "--resume"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    assert proc.returncode == 2 and "error: --resume needs --ckpt" in proc.stderr, proc.stderr


def _example():
    sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))
    try:
        import hf_llama_pipeline
    finally:
        sys.path.pop(0)
    return hf_llama_pipeline


def test_llama_interleaved_matches_the_whole_model(tmp_path):
    ckpt, report = tmp_path / "ckpt", tmp_path / "report.json"
    logs = run_torchrun(EXAMPLE, 4, *SHORT, "--ckpt", str(ckpt), "--report", str(report), timeout=240)
    losses = json.loads(report.read_text())["losses"]
    assert len(losses) == 2
    assert "Warning" not in logs, logs
    if _cores() < 4:  # 4 ranks on fewer cores: the tokens/s of the bar come with the caveat
        assert "caveat: 4 processes share" in logs, logs

    # --steps is the total: resumed from the checkpoint at step 2, --steps 3 trains step 2 only
    resumed = tmp_path / "resumed.json"
    run_torchrun(EXAMPLE, 4, *SHORT[2:], "--steps", "3", "--ckpt", str(ckpt), "--resume", "--report", str(resumed),
                 timeout=240)
    after = json.loads(resumed.read_text())
    assert after["start"] == 2 and len(after["losses"]) == 1

    ex = _example()
    args = argparse.Namespace(layers=8, hidden=32, seq=16, vocab=128, batch=8, seed=0)
    model = ex.make_model(args)  # the same config and seed as every rank used
    tokens, target = ex.batch(0, args)
    with torch.no_grad():
        logits = model(input_ids=tokens).logits  # the Hugging Face forward, not the example's stages
        whole = torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), target.reshape(-1))
    # 4 equal micro-batches: the mean of their mean losses is the whole batch's mean loss
    torch.testing.assert_close(torch.tensor(losses[0]), whole, rtol=1e-5, atol=1e-6)

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt), str(tmp_path / "whole.pt"))
    saved = torch.load(tmp_path / "whole.pt", weights_only=False)
    names = {k[len("model."):] for k in saved if k.startswith("model.")}
    assert names == {n for n, _ in model.named_parameters()}
