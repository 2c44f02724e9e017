"""Real multi-process torch: 4 gloo processes through the platform layer, launched by torchrun."""

import json
import os

import pytest
from conftest import run_torchrun

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(300)
def test_four_gloo_ranks_p2p_collectives_and_mesh_groups(tmp_path):
    n = 4
    run_torchrun(os.path.join(HERE, "torch_dist_worker.py"), n, str(tmp_path))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]
    for r, out in enumerate(results):
        left, right = (r - 1) % n, (r + 1) % n
        assert (out["rank"], out["world"], out["platform"]) == (r, n, "torch")
        assert out["ring"] == [left, left * 10, left * 100]
        expected_t = [[10 * left + 0.0, 10 * left + 3.0], [10 * left + 1.0, 10 * left + 4.0],
                      [10 * left + 2.0, 10 * left + 5.0]]
        assert out["transposed"] == expected_t and out["transposed_plain"] == expected_t
        assert out["batch"] == [[left, -left], [right + 0.5, 1]]
        assert out["sum"] == [sum(range(1, n + 1)), 2 * sum(range(n))]
        assert out["max"] == [n - 1]
        assert out["avg"] == [sum(range(n)) / n]
        assert out["gather"] == [[k, k] for k in range(n)]
        assert out["bcast"] == [2, 2]
        assert out["rs"] == [sum(k * 10 + r for k in range(n))]
        assert out["a2a"] == [[k * 10 + r] for k in range(n)]
        assert out["gobj"] == [["rank", k] for k in range(n)]
        dp, pp = divmod(r, 2)
        assert out["coord"] == [dp, pp]
        assert out["pp_ranks"] == [2 * dp, 2 * dp + 1]
        assert out["pp_local"] == pp
        assert out["pp_sum"] == [4 * dp + 1]
        assert out["dp_gather"] == [[pp], [pp + 2]]
        assert out["pp_peer"] == [r ^ 1]
    assert results[1]["obj"] == {"shapes": [[2, 3]], "from": 0}
