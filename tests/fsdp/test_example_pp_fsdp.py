"""examples/pp_fsdp_checkpoint.py on 4 torchrun gloo processes with short settings: trained 3 steps with
a checkpoint after step 2, then resumed from it in new processes."""

from __future__ import annotations

import json
import os

from conftest import REPO_ROOT, run_torchrun

EXAMPLE = os.path.join(REPO_ROOT, "examples", "pp_fsdp_checkpoint.py")
STAGE_BYTES = 4 * (256 * 256 + 256) * 4  # 4 Linear(256, 256) layers of float32 per pipeline stage


def _reports(prefix: str) -> list[dict]:
    out = []
    for rank in range(4):
        with open(f"{prefix}.rank{rank}.json") as f:
            out.append(json.load(f))
    return out


def test_example_trains_saves_and_resumes(tmp_path):
    ckpt, first, second = str(tmp_path / "ckpt"), str(tmp_path / "first"), str(tmp_path / "second")
    common = ["--steps", "3", "--save-at", "2", "--batch", "8", "--micro-batches", "2", "--ckpt", ckpt]
    logs = run_torchrun(EXAMPLE, 4, *common, "--report", first, timeout=240)
    logs += run_torchrun(EXAMPLE, 4, *common, "--resume", "--report", second, timeout=240)
    assert "Warning" not in logs, logs  # neither the library nor the example's own hooks make torch warn
    a, b = _reports(first), _reports(second)
    for ra, rb in zip(a, b):
        assert len(ra["norms"]) == 3 and len(rb["norms"]) == 1
        assert rb["norms"] == ra["norms"][2:]  # the resumed step 3 is the uninterrupted one, bit for bit
        if ra["pp"] == 1:
            assert rb["losses"] == ra["losses"][2:] and len(ra["losses"]) == 3
        # each stage is sharded in halves over dp=2; a step gathers the whole stage beside the shards
        assert ra["param_bytes_at_rest"] == STAGE_BYTES // 2
        assert ra["param_bytes_peak"] == STAGE_BYTES // 2 + STAGE_BYTES
        assert ra["optimizer_bytes"] > 0
