"""The profiler on both frameworks: times, bytes, gradients left as they were."""

from __future__ import annotations

import pytest

from hyper_parallel.core.pipeline_parallel.tools.profile import profile_stages, timing_caveat

BATCH, WIDTH = 8, 64


def test_torch_times_and_bytes():
    torch = pytest.importorskip("torch")
    from hyper_parallel.platform.torch import TorchPlatform

    torch.manual_seed(0)
    stages = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(2)]
    before = [p.grad for s in stages for p in s.parameters()]
    result = profile_stages(stages, torch.randn(BATCH, WIDTH), platform=TorchPlatform(), warmup=0, repeats=2)
    assert [p.grad for s in stages for p in s.parameters()] == before
    costs = result.costs
    assert costs.micro_batch_size == BATCH and len(costs.stages) == 2 and result.notes == []
    one = BATCH * WIDTH * 4  # one float32 activation of the micro-batch
    first, last = costs.stages
    # the forward saves the Linear's input (for dW) and the Tanh's output (for its own backward)
    assert first.activation_bytes == last.activation_bytes == 2 * one
    # after the input backward of stage 1 only the Linear's input (needed for dW) is left
    assert last.activation_bytes_after_input == one
    assert first.output_bytes == one and last.output_bytes == 0
    assert first.param_bytes == (WIDTH * WIDTH + WIDTH) * 4
    for stage in costs.stages:
        assert min(stage.F, stage.B, stage.I, stage.W) > 0
        assert 0 <= stage.overhead_ms <= min(stage.F, stage.B, stage.I, stage.W)
    assert [len(t["F"]) for t in result.raw_ms] == [4, 4]  # two forwards per repetition


def test_argument_checks():
    with pytest.raises(ValueError, match="at least one stage module"):
        profile_stages([], None)
    with pytest.raises(ValueError, match="repeats must be an int >= 1, got 0"):
        profile_stages([object()], None, repeats=0)
    with pytest.raises(ValueError, match="loss_fn needs a target"):
        profile_stages([object()], None, loss_fn=lambda o, t: o)


@pytest.mark.timeout(240)
def test_mindspore_times_and_what_it_cannot_measure():
    ms = pytest.importorskip("mindspore")
    import numpy as np

    from hyper_parallel.platform.mindspore import MindSporePlatform

    platform = MindSporePlatform()
    stages = [ms.nn.SequentialCell([ms.nn.Dense(8, 8), ms.nn.Tanh()]) for _ in range(2)]
    sample = ms.Tensor(np.ones((4, 8), np.float32))
    result = profile_stages(stages, sample, platform=platform, warmup=0, repeats=1, fit_overhead=False)
    assert result.notes == ["activation bytes are not measured on the mindspore platform (left at 0)"]
    first, last = result.costs.stages
    assert first.param_bytes == (8 * 8 + 8) * 4 and first.output_bytes == 4 * 8 * 4
    assert min(first.F, first.B, first.I, first.W, last.F, last.B) > 0
    assert first.activation_bytes == 0
    for cell in stages:
        for _, param in platform.named_parameters(cell):
            assert platform.get_grad(param) is None


def test_rounds_run_every_stage_in_turn_so_a_burst_of_load_hits_all_alike():
    torch = pytest.importorskip("torch")
    from hyper_parallel.platform.torch import TorchPlatform

    calls = []

    class Logged(torch.nn.Linear):
        def __init__(self, index):
            super().__init__(4, 4)
            self.index = index

        def forward(self, x):
            calls.append(self.index)
            return super().forward(x)

    result = profile_stages([Logged(0), Logged(1)], torch.ones(2, 4), platform=TorchPlatform(), warmup=1, repeats=3,
                            fit_overhead=False)
    # one untimed chaining pass, then 1 + 3 rounds; each run of a stage is two forwards (before B, before I/W)
    assert calls == [0, 0, 1, 1] + [0, 0, 1, 1] * 4
    assert [len(t["F"]) for t in result.raw_ms] == [6, 6] and [len(t["W"]) for t in result.raw_ms] == [3, 3]
    assert [set(s) for s in result.spread] == [{"F", "B", "I", "W"}] * 2
    assert all(v >= 0 for s in result.spread for v in s.values())


def test_threads_are_set_for_the_measurement_and_restored():
    torch = pytest.importorskip("torch")
    from hyper_parallel.platform.torch import TorchPlatform

    before = torch.get_num_threads()
    seen = []

    class Probe(torch.nn.Linear):
        def forward(self, x):
            seen.append(torch.get_num_threads())
            return super().forward(x)

    want = 2 if before != 2 else 1
    result = profile_stages([Probe(4, 4)], torch.ones(2, 4), platform=TorchPlatform(), warmup=0, repeats=1,
                            fit_overhead=False, threads=want)
    assert result.threads == want and set(seen) == {want}
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads must be an int >= 1 or None, got 0"):
        profile_stages([Probe(4, 4)], torch.ones(2, 4), platform=TorchPlatform(), threads=0)


def test_warnings_name_spread_repeats_and_identical_stages_that_disagree():
    from hyper_parallel.core.pipeline_parallel.tools.profile import _warnings

    flat = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    calm = dict.fromkeys(flat, 0.05)
    # the issue's numbers: identical stages 1 and 2, forwards of 0.1 ms and 97 ms
    medians = [flat, {**flat, "F": 0.1}, {**flat, "F": 97.0}, flat]
    signatures = ["first", "middle", "middle", "last"]
    found = _warnings(medians, [calm, calm, {**calm, "B": 0.6}, calm], signatures, 0.25, 5)
    assert found == [
        "stage 2: the 5 repeats spread beyond 25% of their median (B 60%): the machine is busy or the thread count "
        "too high; these times cannot be trusted",
        "identical stages 1 and 2 differ beyond 25% in F: 0.1 ms vs 97 ms; these times cannot be trusted"]
    assert _warnings([flat, {**flat, "F": 1.2}], [calm, calm], ["middle", "middle"], 0.25, 5) == []
    assert _warnings([flat, {**flat, "F": 9.0}], [calm, calm], ["first", "last"], 0.25, 5) == []  # not identical


def test_identical_stages_are_those_of_one_module_type_shapes_and_role():
    torch = pytest.importorskip("torch")
    from hyper_parallel.core.pipeline_parallel.tools.profile import _signature
    from hyper_parallel.platform.torch import TorchPlatform

    p = TorchPlatform()
    x = torch.ones(8, 16)
    same = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(2)]
    other = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    sig = [_signature(p, m, (x,), False, False) for m in (*same, other)]
    assert sig[0] == sig[1] != sig[2]
    assert _signature(p, same[0], (x,), True, False) != sig[0]  # the first stage computes no input gradient
    assert _signature(p, same[0], (torch.ones(4, 16),), False, False) != sig[0]
    # the same parameters around different parameter-free work are not the same stage
    relu = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
    dropout = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5))
    assert len({_signature(p, m, (x,), False, False) for m in (same[0], relu, dropout)}) == 3
    assert _signature(p, dropout, (x,), False, False) != _signature(
        p, torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.1)), (x,), False, False)


def test_timing_caveat_names_why_times_mean_little():
    quiet = {"processes": 2, "cores": 4, "load": 1.0}
    assert timing_caveat([1.0, 1.1, 0.9, 1.0], **quiet) is None
    tail = ": these times say more about this machine's load than about the pipeline"
    assert timing_caveat(processes=4, cores=2, load=1.0) == "caveat: 4 processes share 2 CPU core(s)" + tail
    assert timing_caveat(processes=1, cores=2, load=3.5) == "caveat: the load average is 3.5 on 2 core(s)" + tail
    # one series of repeats whose median absolute deviation is over 25% of its median is enough
    assert timing_caveat([1.0, 1.0, 1.0], [1.0, 2.0, 1.5, 3.0, 0.5], **quiet) == (
        "caveat: repeats spread 33% around their median" + tail)
    assert timing_caveat([1.0, 5.0], **quiet) is None  # two values are not a spread
    assert timing_caveat(processes=3, cores=2, load=2.5).startswith(
        "caveat: 3 processes share 2 CPU core(s), the load average is 2.5 on 2 core(s): ")


def test_timing_caveat_reads_the_launchers_process_count(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert timing_caveat(cores=4, load=0.0).startswith("caveat: 8 processes share 4 CPU core(s)")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert timing_caveat(cores=4, load=0.0) is None
