"""Every schedule on 4 real gloo processes (one torchrun job) against the non-pipelined model.

The job (gloo_pipeline_worker.py) runs every schedule x micro-batch count in four P2P variants
(overlap_p2p off/on x p2p_transport plain/batch). Here we check that the plain variant matches
the oracle, that all four variants give bitwise the same losses and gradients, and that the
losses come back only on the rank holding the last stage.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from conftest import load_rank_results, run_torchrun
from gloo_pipeline_worker import MICRO, P, VARIANTS, config_for
from pp_harness import SCHEDULES, TOL, batch, check_against_oracle, full_model_oracle, merged

HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE = "plain"
CASES = [pytest.param(s, m, id=f"{s}-m{m}") for s in SCHEDULES for m in MICRO]
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each of the P ranks pickled: {"rank", "world", "results": {(schedule, m, variant): ...}}."""
    out = tmp_path_factory.mktemp("gloo_pp")
    run_torchrun(os.path.join(HERE, "gloo_pipeline_worker.py"), P, str(out), timeout=540)
    loaded = load_rank_results(out, P)
    assert [(d["rank"], d["world"]) for d in loaded] == [(r, P) for r in range(P)]
    return loaded


def case_results(ranks: list[dict[str, Any]], schedule: str, micro: int, variant: str) -> list[dict[str, Any]]:
    key = (schedule, micro, variant)
    missing = [d["rank"] for d in ranks if key not in d["results"]]
    assert not missing, f"case {key} missing on ranks {missing}"
    return [d["results"][key] for d in ranks]


@pytest.mark.parametrize(("schedule", "micro"), CASES)
def test_plain_variant_matches_non_pipelined(ranks, schedule, micro):
    config = config_for(schedule)
    tokens, targets = batch(config, 2 * micro)
    ref_loss, ref_grads = full_model_oracle("torch", config, tokens, targets)
    losses, grads = merged(case_results(ranks, schedule, micro, REFERENCE))
    where = f"{schedule}, m={micro}, variant={REFERENCE}"
    assert len(losses) == 1 and len(losses[0]) == micro, f"{where}: losses {losses}"
    try:
        worst = check_against_oracle("torch", losses[0], grads, ref_loss, ref_grads)
    except AssertionError as exc:
        raise AssertionError(f"{where} differs from the non-pipelined oracle: {exc}") from None
    assert worst <= TOL["torch"]["atol"], f"{where}: max abs gradient difference {worst:.3g}"


@pytest.mark.parametrize(("schedule", "micro"), CASES)
def test_all_p2p_variants_are_bitwise_identical(ranks, schedule, micro):
    reference = case_results(ranks, schedule, micro, REFERENCE)
    problems = []
    for variant in VARIANTS:
        if variant == REFERENCE:
            continue
        for r, (ref, got) in enumerate(zip(reference, case_results(ranks, schedule, micro, variant), strict=True)):
            where = f"{schedule}, m={micro}, variant={variant} vs {REFERENCE}, rank {r}"
            ref_l, got_l = np.asarray(ref["losses"], np.float64), np.asarray(got["losses"], np.float64)
            if ref_l.shape != got_l.shape or not np.array_equal(ref_l, got_l):
                problems.append(f"{where}: losses {got['losses']} != {ref['losses']}")
            if set(ref["grads"]) != set(got["grads"]):
                problems.append(f"{where}: gradient names differ: {sorted(set(ref['grads']) ^ set(got['grads']))}")
            for name in sorted(set(ref["grads"]) & set(got["grads"])):
                a, b = ref["grads"][name], got["grads"][name]
                if a.shape != b.shape or a.dtype != b.dtype:
                    problems.append(f"{where}: gradient {name} is {b.dtype}{b.shape}, expected {a.dtype}{a.shape}")
                elif not np.array_equal(a, b):
                    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
                    problems.append(f"{where}: gradient {name} differs in {int((diff > 0).sum())}/{a.size} "
                                    f"elements, max abs diff {diff.max():.3g}")
    assert not problems, "variants are not bitwise identical:\n" + "\n".join(problems)


@pytest.mark.parametrize(("schedule", "micro"), CASES)
def test_losses_only_on_last_rank(ranks, schedule, micro):
    last = P - 1  # stage num_stages-1 lives on pipeline rank P-1 for every placement used here
    for variant in VARIANTS:
        results = case_results(ranks, schedule, micro, variant)
        got = [len(r["losses"][0]) if r["losses"] and r["losses"][0] else 0 for r in results]
        expected = [micro if r == last else 0 for r in range(P)]
        assert got == expected, f"{schedule}, m={micro}, variant={variant}: losses per rank {got}, expected {expected}"


@pytest.mark.timeout(400)
def test_torch_pipelining_pattern_runs_unchanged_with_the_same_gradients(tmp_path):
    # torch.distributed.pipelining's documented usage, once with its classes and once with ours
    # (only the import differs), on 4 gloo processes: losses, merged outputs and every gradient, for
    # every schedule both libraries have (the zero-bubble ones included: V placement for ZBV and
    # DualPipeV, as torch's classes require).
    import json

    run_torchrun(os.path.join(HERE, "torch_pipelining_parity_worker.py"), 4, str(tmp_path), timeout=300)
    for rank in range(4):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(results) == sorted(["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
                                          "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"])
        for name, by_lib in results.items():
            theirs, ours = by_lib["torch.distributed.pipelining"], by_lib["hyper_parallel"]
            np.testing.assert_allclose(ours["losses"], theirs["losses"], rtol=1e-6, atol=1e-7, err_msg=name)
            assert (ours["output"] is None) == (theirs["output"] is None), name
            if theirs["output"] is not None:
                np.testing.assert_allclose(ours["output"], theirs["output"], rtol=1e-6, atol=1e-7, err_msg=name)
            assert ours["grads"].keys() == theirs["grads"].keys()
            for param, grad in theirs["grads"].items():
                np.testing.assert_allclose(ours["grads"][param], grad, rtol=1e-5, atol=1e-7, err_msg=f"{name} {param}")
        for name, by_lib in results.items():  # the rank holding the last stage (rank 0 in a V) has every loss
            for lib, got in by_lib.items():
                assert len(got["losses"]) == (8 if got["last"] else 0), (rank, name, lib)
                assert got["last"] == (rank == (0 if name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV") else 3))
