"""DTensor and DeviceMesh in a real 4-process torch.distributed (gloo) job, with torch interop."""

from __future__ import annotations

import json
import os

from conftest import run_torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 4


def test_dtensor_and_mesh_on_gloo(tmp_path):
    run_torchrun(os.path.join(HERE, "dtensor_gloo_worker.py"), WORLD, str(tmp_path), timeout=300)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r, out in enumerate(results):
        assert out["platform"] == "torch" and out["native_available"]
        assert out["native_calls"] > 300 and out["native_calls_when_off"] == 0
        assert out["native"] == [], f"rank {r}, through torch's DTensor:\n" + "\n".join(out["native"])
        assert out["generic"] == [], f"rank {r}, through the library's collectives:\n" + "\n".join(out["generic"])
        io = out["interop"]
        dp_coord, tp_coord = divmod(r, 2)
        assert io["dp_native_is_pg"] and io["torch_group_is_native"] and io["group_cached"]
        assert io["dp_sum"] == tp_coord + (tp_coord + 2)  # the dp line through rank r is {tp, tp + 2}
        assert io["world_sum"] == 0 + 1 + 2 + 3
        assert io["torch_mesh"] == [[[0, 1], [2, 3]], ["dp", "tp"]]
        assert io["torch_mesh_groups_shared"] and io["same_pieces_as_torch"]
        assert io["to_torch"] == [True, ["Shard(dim=0)", "Shard(dim=1)"], [4, 8], True]
        assert io["to_torch_grad_ones"]
        assert io["from_torch"] == [True, True, True, True]
        assert io["from_torch_partial"] == [[float(2 * tp_coord + 2)] * 2] * 2
        assert io["from_torch_mesh"] == [[[0, 1], [2, 3]], ["a", "b"], True, True]
        assert io["wrapped_mesh_full"]
        assert io["fsdp2"][0] == ["Shard(dim=0)"] and io["fsdp2"][1] < 1e-5
        assert io["flat"] == [["dp_tp"], [0, 1, 2, 3], 4.0]
