"""A small model split into pipeline stages with whole-model parameter names, trained with PP x DP/FSDP.

The model: ``embed`` (no bias), ``layers.<g>`` (``Linear`` + tanh, global layer index ``g``), then
``head`` (no bias) times a ``gain`` row of shape ``(1, WIDTH)`` (dimension 0 of size 1 cannot be
split evenly: torch's FSDP pads it, this library's implementation keeps it whole). With ``tie`` the
head uses the embedding's weight (``shared_parameters`` across the first and the last stage).
Each stage module keeps the names the whole model gives its parameters, so checkpoints reshard
between pipeline splits. Both frameworks; the oracle is the whole model on one rank.

``Config(extra={"unused": True})`` (torch) gives the last stage parameters that no rank uses
(``never``: shardable, ``never_row``: kept whole by this library's FSDP) and two that only the first
replica's micro-batches use (``sometimes``, ``sometimes_row``) — ``"unused": "never"`` only the
first two (torch's FSDP2 cannot reduce a gradient only some replicas have); ``extra={"adamw": wd}``
trains with AdamW and that weight decay instead of Adam; ``extra={"dp_mesh_only": True}`` gives
``data_parallel`` the 1-D ``dp`` sub-mesh instead of the whole mesh.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

WIDTH = 8
LAYERS = 4
TOL = {"torch": dict(rtol=1e-5, atol=1e-6), "mindspore": dict(rtol=1e-5, atol=1e-6)}


@dataclass
class Config:
    framework: str = "torch"
    mode: str = "fsdp"  # "fsdp" | "dp" | "none"
    schedule: str = "1f1b"  # "1f1b" | "interleaved" | "gpipe" | "zb-h1" | "zbv"
    pp: int = 2
    dp: int = 2
    micro: int = 4
    steps: int = 3
    tie: bool = False
    batch: int = 16  # global batch: every dp replica gets batch // dp rows
    lr: float = 0.02
    lookahead: int = 2
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def chunks(self) -> int:
        return 2 if self.schedule in ("interleaved", "zb-h1", "zbv") else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {"embed.weight": (rng.standard_normal((WIDTH, WIDTH)) * 0.4).astype(np.float32)}
    for g in range(LAYERS):
        out[f"layers.{g}.weight"] = (rng.standard_normal((WIDTH, WIDTH)) * 0.4).astype(np.float32)
        out[f"layers.{g}.bias"] = (rng.standard_normal(WIDTH) * 0.1).astype(np.float32)
    out["head.weight"] = (rng.standard_normal((WIDTH, WIDTH)) * 0.4).astype(np.float32)
    out["gain"] = (1.0 + 0.1 * rng.standard_normal((1, WIDTH))).astype(np.float32)
    return out


def data(step: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return (rng.standard_normal((batch, WIDTH)).astype(np.float32),
            rng.standard_normal((batch, WIDTH)).astype(np.float32))


def layer_range(stage: int, num_stages: int) -> range:
    per = LAYERS // num_stages
    return range(stage * per, (stage + 1) * per)


def stage_parts(stage: int, num_stages: int) -> tuple[bool, list[int], bool]:
    return stage == 0, list(layer_range(stage, num_stages)), stage == num_stages - 1


# --------------------------------------------------------------------------------------------- torch
UNUSED = {"never": (WIDTH, WIDTH), "never_row": (1, WIDTH), "sometimes": (WIDTH,), "sometimes_row": (1, WIDTH)}


def torch_module(stage: int, num_stages: int, w: dict[str, np.ndarray], tie: bool, unused: bool | str = False) -> Any:
    import torch
    from torch import nn

    first, layers, last = stage_parts(stage, num_stages)
    extra = {k: v for k, v in UNUSED.items() if unused is True or k.startswith("never")} if unused and last else {}

    class StageNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if first:
                self.embed = nn.Linear(WIDTH, WIDTH, bias=False)
            self.layers = nn.ModuleDict({str(g): nn.Linear(WIDTH, WIDTH) for g in layers})
            if last:
                self.head = nn.Linear(WIDTH, WIDTH, bias=False)
                self.gain = nn.Parameter(torch.ones(1, WIDTH))
            if first and last and tie:
                self.head.weight = self.embed.weight
            for name, shape in extra.items():
                setattr(self, name, nn.Parameter(torch.full(shape, 0.5)))
            self.replica = 0  # the data-parallel replica this copy runs (only the first uses "sometimes")
            with torch.no_grad():
                for name, param in self.named_parameters():
                    source = "embed.weight" if tie and name == "head.weight" else name
                    if name not in extra:
                        param.copy_(torch.from_numpy(w[source]))

        def forward(self, x: Any) -> Any:
            if first:
                x = self.embed(x)
            for g in layers:
                x = torch.tanh(self.layers[str(g)](x))
            if last:
                x = self.head(x) * self.gain
            if "sometimes" in extra and self.replica == 0:
                x = x + self.sometimes + self.sometimes_row
            return x

    return StageNet()


def torch_optimizer(cfg: Config, params: Any) -> Any:
    import torch

    if "adamw" in cfg.extra:
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.extra["adamw"])
    return torch.optim.Adam(params, lr=cfg.lr)


def torch_mse(out: Any, target: Any) -> Any:
    return ((out - target) ** 2).mean()


def torch_oracle(cfg: Config) -> tuple[list[list[float]], dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """Per step: the per-micro-batch losses of every replica (replica-major), and the parameters after
    the last step; the gradients of every step (before its optimizer step)."""
    import torch

    model = torch_module(0, 1, weights(), cfg.tie, unused=cfg.extra.get("unused", False))
    opt = torch_optimizer(cfg, model.parameters())
    per_replica = cfg.batch // cfg.dp
    per_micro = per_replica // cfg.micro
    losses, grads = [], []
    for step in range(cfg.steps):
        x, y = (torch.from_numpy(a) for a in data(step, cfg.batch))
        opt.zero_grad()
        step_losses, total = [], 0.0
        for d in range(cfg.dp):
            model.replica = d
            for i in range(cfg.micro):
                rows = slice(d * per_replica + i * per_micro, d * per_replica + (i + 1) * per_micro)
                loss = torch_mse(model(x[rows]), y[rows])
                step_losses.append(float(loss.detach()))
                total = total + loss / (cfg.dp * cfg.micro)
        total.backward()
        grads.append({n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        losses.append(step_losses)
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    if cfg.tie:
        params["head.weight"] = params["embed.weight"]
        for g in grads:
            g["head.weight"] = g["embed.weight"]
    return losses, params, grads


# ----------------------------------------------------------------------------------------- MindSpore
def ms_module(stage: int, num_stages: int, w: dict[str, np.ndarray], tie: bool) -> Any:
    import mindspore as ms
    from mindspore import nn, ops

    first, layers, last = stage_parts(stage, num_stages)

    def param(name: str) -> Any:
        source = "embed.weight" if tie and name == "head.weight" else name
        return ms.Parameter(ms.Tensor(w[source].copy()), name=name)

    class StageNet(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.layers, self.last = first, layers, last
            if first:
                self.embed_w = param("embed.weight")
            self.layer_w = ms.ParameterTuple([param(f"layers.{g}.weight") for g in layers])
            self.layer_b = ms.ParameterTuple([param(f"layers.{g}.bias") for g in layers])
            if last:
                self.head_w = self.embed_w if (first and tie) else param("head.weight")
                self.gain = param("gain")

        def construct(self, x: Any) -> Any:
            if self.first:
                x = ops.matmul(x, self.embed_w.T)
            for k in range(len(self.layers)):
                x = ops.tanh(ops.matmul(x, self.layer_w[k].T) + self.layer_b[k])
            if self.last:
                x = ops.matmul(x, self.head_w.T) * self.gain
            return x

    return StageNet()


def ms_mse(out: Any, target: Any) -> Any:
    return ((out - target) ** 2).mean()


def ms_oracle(cfg: Config) -> tuple[list[list[float]], dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """:func:`torch_oracle` on MindSpore (``ms.value_and_grad`` of the mean loss, ``nn.Adam``)."""
    import mindspore as ms
    from mindspore import nn

    model = ms_module(0, 1, weights(), cfg.tie)
    params = model.trainable_params()
    opt = nn.Adam(params, learning_rate=cfg.lr)
    per_replica = cfg.batch // cfg.dp
    per_micro = per_replica // cfg.micro
    losses, grads = [], []

    for step in range(cfg.steps):
        x, y = data(step, cfg.batch)
        chunks = []
        for d in range(cfg.dp):
            for i in range(cfg.micro):
                start = d * per_replica + i * per_micro
                chunks.append((ms.Tensor(x[start:start + per_micro]), ms.Tensor(y[start:start + per_micro])))
        step_losses = [float(ms_mse(model(a), b).asnumpy()) for a, b in chunks]

        def total(*_: Any) -> Any:
            out = 0.0
            for a, b in chunks:
                out = out + ms_mse(model(a), b) / len(chunks)
            return out

        _, g = ms.value_and_grad(total, None, params)()
        grads.append({q.name: gq.asnumpy().copy() for q, gq in zip(params, g)})
        opt(g)
        losses.append(step_losses)
    out = {q.name: q.asnumpy().copy() for q in params}
    if cfg.tie:
        out["head.weight"] = out["embed.weight"]
        for gr in grads:
            gr["head.weight"] = gr["embed.weight"]
    return losses, out, grads


def oracle(cfg: Config) -> tuple[list[list[float]], dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    return torch_oracle(cfg) if cfg.framework == "torch" else ms_oracle(cfg)

# ------------------------------------------------------------------------------- one replica's run
def _mesh(cfg: Config) -> Any:
    import hyper_parallel as hp

    return hp.init_device_mesh("cpu", (cfg.pp, cfg.dp), mesh_dim_names=("pp", "dp"))


def full_value(param: Any, value: Any) -> np.ndarray:
    """The whole tensor of which ``value`` (``param``'s data or gradient) is this rank's piece (a collective
    over the data-parallel ranks for sharded parameters)."""
    from hyper_parallel.core.fully_shard.sharded import state_of
    from hyper_parallel.platform import get_platform

    p = get_platform()
    if hasattr(value, "full_tensor"):  # torch's DTensor (FSDP2)
        return value.full_tensor().detach().numpy().copy()
    state = state_of(param)
    if state is not None and any(e.param is param for e in state.sharded):
        value = p.cat(p.all_gather(p.clone(value), state.group), 0)
    return np.array(p.to_numpy(value), copy=True)


def schedule_class(name: str) -> Any:
    import hyper_parallel as hp

    return {"1f1b": hp.Schedule1F1B, "interleaved": hp.ScheduleInterleaved1F1B, "gpipe": hp.ScheduleGPipe,
            "zb-h1": hp.ScheduleInterleavedZeroBubble, "zbv": hp.ScheduleZBVZeroBubble}[name]


def build(cfg: Config, mesh: Any, stage_indices: list[int]) -> tuple[list[Any], Any]:
    """The stage objects of this rank (fully sharded for ``mode="fsdp"``) and the schedule."""
    import hyper_parallel as hp

    w = weights()
    make = torch_module if cfg.framework == "torch" else ms_module
    stages = []
    for s in stage_indices:
        module = (make(s, cfg.num_stages, w, cfg.tie, unused=cfg.extra["unused"]) if cfg.extra.get("unused")
                  else make(s, cfg.num_stages, w, cfg.tie))
        module.replica = mesh.get_local_rank("dp")
        if cfg.mode == "fsdp":
            hp.fully_shard(module, mesh)
        ties = {}
        if cfg.tie and s == 0:
            ties = {"tie": "embed.weight"}
        elif cfg.tie and s == cfg.num_stages - 1:
            ties = {"tie": "head.weight"}
        stages.append(hp.PipelineStage(module, s, cfg.num_stages, mesh=mesh, shared_parameters=ties))
    cls = schedule_class(cfg.schedule)
    loss = torch_mse if cfg.framework == "torch" else ms_mse
    schedule = cls(stages if len(stages) > 1 else stages[0], cfg.micro, loss_fn=loss)
    if cfg.mode != "none":
        dp_mesh = mesh["dp"] if cfg.extra.get("dp_mesh_only") else mesh  # a 1-D mesh of the replicas
        hp.data_parallel(schedule, dp_mesh, lookahead=cfg.lookahead)
    return stages, schedule


class Trainer:
    """One replica of the PP x DP job: its stages, schedule, optimizer and data."""

    def __init__(self, cfg: Config, mesh: Any = None) -> None:
        self.cfg = cfg
        self.mesh = mesh if mesh is not None else _mesh(cfg)
        self.pp = self.mesh.get_local_rank("pp")
        self.dp_index = self.mesh.get_local_rank("dp")
        placement = schedule_class(cfg.schedule).stage_placement(cfg.pp, cfg.chunks)
        self.stage_indices = sorted(s for s, r in placement.items() if r == self.pp)
        self.stages, self.schedule = build(cfg, self.mesh, self.stage_indices)
        self.params = self.schedule.parameters()
        if cfg.framework == "torch":
            self.optimizer = torch_optimizer(cfg, self.params)
        else:
            from mindspore import nn

            self.optimizer = nn.Adam(self.params, learning_rate=cfg.lr)

    def tensor(self, array: np.ndarray) -> Any:
        from hyper_parallel.platform import get_platform

        return get_platform().from_numpy(array)

    def run(self, step: int) -> list[float]:
        """Forward and backward of step ``step`` (gradients zeroed first); per-micro-batch losses."""
        cfg = self.cfg
        x, y = data(step, cfg.batch)
        per = cfg.batch // cfg.dp
        rows = slice(self.dp_index * per, (self.dp_index + 1) * per)
        self.schedule.zero_grad()
        target = self.tensor(y[rows]) if self.stages[-1].is_last else None
        return [float(v) for v in self.schedule.run(self.tensor(x[rows]), target=target)]

    def update(self) -> None:
        if self.cfg.framework == "torch":
            self.optimizer.step()
        else:
            from hyper_parallel.platform import get_platform

            p = get_platform()
            self.optimizer(tuple(p.get_grad(q) for q in self.params))

    def train(self, steps: range) -> list[list[float]]:
        out = []
        for step in steps:
            out.append(self.run(step))
            self.update()
        return out

    def full_params(self) -> dict[str, np.ndarray]:
        from hyper_parallel.platform import get_platform

        p = get_platform()
        out = {}
        for stage in self.stages:
            for name, param in p.named_parameters(stage.submodule):
                out[name] = full_value(param, p.param_data(param))
        return out

    def full_grads(self) -> dict[str, np.ndarray]:
        from hyper_parallel.platform import get_platform

        p = get_platform()
        out = {}
        for stage in self.stages:
            for name, param in p.named_parameters(stage.submodule):
                grad = p.get_grad(param)
                if grad is not None:
                    out[name] = full_value(param, grad)
        return out


def replica_losses(results: list[dict[str, Any]], cfg: Config, step: int) -> list[float]:
    """The per-micro-batch losses of one step, replica after replica (from the last stage's ranks)."""
    out: list[float] = []
    for d in range(cfg.dp):
        out += next(r["losses"][step] for r in results if r["dp"] == d and r["losses"][step])
    return out


def merged_params(results: list[dict[str, Any]], key: str = "params") -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for r in results:
        for name, value in r[key].items():
            if name in out:  # every replica (and every holder of a tie) has the same whole value
                np.testing.assert_array_equal(out[name], value, err_msg=f"replicas disagree on {name}")
            out[name] = value
    return out


def arm_failure(trainer: Trainer) -> dict[str, bool]:
    """Make the next runs fail on every rank (1F1B, pp=2, 4 micro-batches) while ``armed["on"]``: stage 1
    raises inside its forward of micro-batch 2, stage 0 inside its forward of micro-batch 3, after a
    barrier of the two. By then every message either stage sent was received (stage 1 got F2; stage 0
    received B1 before reaching F3, and stage 1 waits for that in the barrier), so no message of the
    failed run is left in flight and the next run starts clean.
    """
    from hyper_parallel.platform import get_platform

    armed = {"on": True}
    counts: dict[int, int] = {}
    raise_at = {0: 4, 1: 3}  # the n-th forward of a run
    pipeline = trainer.schedule.group

    for stage in trainer.stages:
        index = stage.stage_index

        def hook(index: int = index) -> None:
            if not armed["on"]:
                return
            counts[index] = counts.get(index, 0) + 1
            if counts[index] == raise_at[index]:
                counts.clear()
                get_platform().barrier(pipeline)
                raise RuntimeError(f"injected failure in stage {index}")

        get_platform().register_forward_pre_hook(stage.submodule, hook)
    return armed


# ------------------------------------------------------------------------------------ clipping
NORM_TYPES = (2.0, 1.0, 3.0, float("inf"))


def clip_checks(trainer: Trainer, bad_rank: int = 3) -> dict[str, Any]:
    """After a run (torch): ``clip_grad_norm_(schedule, 0.05, norm_type)`` *without* ``mesh=`` for each of
    :data:`NORM_TYPES` (the norm, the clipped whole gradients), each from the run's gradients; then, with
    one element of one gradient of ``bad_rank`` set to ``nan`` or ``inf``, the norm (without and with
    ``mesh=``) and ``grads_are_finite`` on every rank. The gradients are those of the run again at the end."""
    import hyper_parallel as hp
    from hyper_parallel.platform import get_platform

    p = get_platform()
    params = trainer.params
    saved = [None if p.get_grad(q) is None else p.clone(p.get_grad(q)) for q in params]

    def restore() -> None:
        for q, g in zip(params, saved, strict=True):
            p.set_grad(q, None if g is None else p.clone(g))

    out: dict[str, Any] = {"norms": {}, "clipped": {}, "bad": {}, "bad_mesh": {}, "finite": {}, "dp": trainer.dp_index,
                           "pp": trainer.pp}
    for norm_type in NORM_TYPES:
        restore()
        out["norms"][norm_type] = hp.clip_grad_norm_(trainer.schedule, 0.05, norm_type)
        out["clipped"][norm_type] = trainer.full_grads()
    for bad in ("nan", "inf"):
        for norm_type in NORM_TYPES:
            restore()
            if p.rank == bad_rank:
                local = next(p.local_tensor(p.get_grad(q)) for q in params
                             if p.get_grad(q) is not None and p.local_tensor(p.get_grad(q)).numel())
                local.view(-1)[0] = float(bad)
            out["finite"][(bad, norm_type)] = hp.grads_are_finite(trainer.schedule)
            out["bad"][(bad, norm_type)] = hp.clip_grad_norm_(trainer.schedule, 0.05, norm_type)
            out["bad_mesh"][(bad, norm_type)] = hp.clip_grad_norm_(trainer.schedule, 0.05, norm_type, mesh=trainer.mesh)
    restore()
    return out


def check_clip(results: list[dict[str, Any]], ref_grads: dict[str, np.ndarray], tol: dict[str, float]) -> None:
    """``clip_checks`` of every rank against ``torch.nn.utils.clip_grad_norm_`` on the whole model's gradients."""
    import torch

    names = sorted(ref_grads)
    for norm_type in NORM_TYPES:
        tensors = [torch.nn.Parameter(torch.zeros(ref_grads[n].shape)) for n in names]
        for t, n in zip(tensors, names, strict=True):
            t.grad = torch.from_numpy(ref_grads[n].copy())
        ref = float(torch.nn.utils.clip_grad_norm_(tensors, 0.05, norm_type))
        norms = [r["norms"][norm_type] for r in results]
        assert len(set(norms)) == 1, f"norm_type {norm_type}: the ranks disagree: {norms}"
        np.testing.assert_allclose(norms[0], ref, rtol=1e-5, err_msg=f"norm_type {norm_type}")
        clipped = merged_params([{"c": r["clipped"][norm_type]} for r in results], "c")
        assert set(clipped) == set(names)
        for t, n in zip(tensors, names, strict=True):
            np.testing.assert_allclose(clipped[n], t.grad.numpy(), **tol, err_msg=f"norm_type {norm_type}: {n}")
        for bad in ("nan", "inf"):
            tensors = [torch.nn.Parameter(torch.zeros(ref_grads[n].shape)) for n in names]
            for t, n in zip(tensors, names, strict=True):
                t.grad = torch.from_numpy(ref_grads[n].copy())
            tensors[0].grad.view(-1)[0] = float(bad)  # where it sits does not change the norm
            want = float(torch.nn.utils.clip_grad_norm_(tensors, 0.05, norm_type))
            for key in ("bad", "bad_mesh"):
                got = [r[key][(bad, norm_type)] for r in results]
                where = f"{bad} on one rank, norm_type {norm_type}{', mesh=' if key == 'bad_mesh' else ''}"
                if np.isnan(want):
                    assert all(np.isnan(g) for g in got), f"{where}: {got} (torch: nan)"
                else:
                    assert got == [want] * len(results), f"{where}: {got} (torch: {want})"
            assert [r["finite"][(bad, norm_type)] for r in results] == [False] * len(results)
