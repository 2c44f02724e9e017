"""examples/mindspore_decoder.py with short settings on a 2-rank MindSpore LocalCluster: the pipelined
loss of the first step equals the loss of the same decoder run whole (not pipelined) on the same batch."""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import pytest
from conftest import REPO_ROOT

pytest.importorskip("mindspore")

SHORT = ["--steps", "2", "--layers", "2", "--dim", "16", "--seq", "8", "--vocab", "32", "--batch", "4",
         "--micro-batches", "2"]


def _example():
    sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))
    try:
        import mindspore_decoder
    finally:
        sys.path.pop(0)
    return mindspore_decoder


def test_mindspore_decoder_matches_the_whole_model(tmp_path):
    from mindspore import nn

    ex = _example()
    report = tmp_path / "report.json"
    losses = ex.main([*SHORT, "--report", str(report)])
    assert len(losses) == 2 and report.exists()

    args = argparse.Namespace(layers=2, dim=16, seq=8, vocab=32, batch=4, seed=0)
    whole = nn.SequentialCell(ex.build_layers(args))  # the same weights, one Cell, the whole batch
    tokens, target = ex.batch(0, args)
    reference = float(ex.next_token_loss(whole(tokens), target).asnumpy())
    # 2 equal micro-batches: the mean of their mean losses is the whole batch's mean loss
    np.testing.assert_allclose(losses[0], reference, rtol=1e-5, atol=1e-6)
