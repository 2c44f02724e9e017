"""Reference GPT in MindSpore (PyNative), built from
:func:`hyper_parallel.demo.gpt.init_gpt_weights`.

Mirrors ``hyper_parallel.demo.gpt_torch`` op for op. MindSpore names a Cell's parameters by
attribute path, and the attributes are laid out so that those names are the spec names
(``tok_emb``, ``blocks.3.attn.qkv.weight``, ``head.weight`` ...); :func:`spec_name_map` checks it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from hyper_parallel.demo.gpt import LN_EPS, GPTConfig, split_layers

Weights = Mapping[str, np.ndarray]


def _param(weights: Weights, name: str) -> Parameter:
    return Parameter(Tensor(np.array(weights[name], dtype=np.float32)), name=name)


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU, tanh approximation (written out so both frameworks compute the same formula)."""
    return 0.5 * x * (1.0 + ops.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


class Linear(nn.Cell):
    """``y = x @ weight.T + bias`` with weight (out, in)."""

    def __init__(self, weights: Weights, prefix: str, bias: bool = True) -> None:
        super().__init__()
        self.weight = _param(weights, f"{prefix}.weight")
        self.bias = _param(weights, f"{prefix}.bias") if bias else None

    def construct(self, x: Tensor) -> Tensor:
        y = ops.matmul(x, self.weight.T)
        return y if self.bias is None else y + self.bias


class LayerNorm(nn.Cell):
    """Layer norm over the last dim (biased variance, eps=1e-5), written out."""

    def __init__(self, weights: Weights, prefix: str) -> None:
        super().__init__()
        self.weight = _param(weights, f"{prefix}.weight")
        self.bias = _param(weights, f"{prefix}.bias")

    def construct(self, x: Tensor) -> Tensor:
        mean = x.mean(axis=-1, keep_dims=True)
        centered = x - mean
        var = (centered * centered).mean(axis=-1, keep_dims=True)
        return centered / ops.sqrt(var + LN_EPS) * self.weight + self.bias


class CausalSelfAttention(nn.Cell):
    def __init__(self, config: GPTConfig, weights: Weights, prefix: str) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.qkv = Linear(weights, f"{prefix}.qkv")
        self.proj = Linear(weights, f"{prefix}.proj")

    def construct(self, x: Tensor, attn_scale: float | None = None) -> Tensor:
        b, t, d = x.shape
        q, k, v = ops.split(self.qkv(x), d, axis=-1)
        q, k, v = (z.reshape(b, t, self.n_heads, self.head_dim).swapaxes(1, 2) for z in (q, k, v))
        scale = 1.0 / math.sqrt(self.head_dim) * (1.0 if attn_scale is None else attn_scale)
        scores = ops.matmul(q, k.swapaxes(-2, -1)) * scale
        causal = Tensor(np.tril(np.ones((t, t), dtype=np.bool_)))
        scores = ops.masked_fill(scores, ops.logical_not(causal), float("-inf"))
        out = ops.matmul(ops.softmax(scores, axis=-1), v)
        return self.proj(out.swapaxes(1, 2).reshape(b, t, d))


class MLP(nn.Cell):
    def __init__(self, weights: Weights, prefix: str) -> None:
        super().__init__()
        self.fc = Linear(weights, f"{prefix}.fc")
        self.proj = Linear(weights, f"{prefix}.proj")

    def construct(self, x: Tensor) -> Tensor:
        return self.proj(gelu_tanh(self.fc(x)))


class Block(nn.Cell):
    """Pre-LN transformer block."""

    def __init__(self, config: GPTConfig, weights: Weights, index: int) -> None:
        super().__init__()
        prefix = f"blocks.{index}"
        self.ln1 = LayerNorm(weights, f"{prefix}.ln1")
        self.attn = CausalSelfAttention(config, weights, f"{prefix}.attn")
        self.ln2 = LayerNorm(weights, f"{prefix}.ln2")
        self.mlp = MLP(weights, f"{prefix}.mlp")

    def construct(self, x: Tensor, attn_scale: float | None = None) -> Tensor:
        x = x + self.attn(self.ln1(x), attn_scale)
        return x + self.mlp(self.ln2(x))


class GPTStage(nn.Cell):
    """The layers of pipeline stage ``stage_index`` of ``num_stages`` (see ``split_layers``).

    First stage: ``stage(tokens)`` with int ids (batch, seq). Other stages: ``stage(hidden)`` or,
    with ``two_tensor_boundary``, ``stage(hidden, x0)``. Non-last stages return ``hidden`` (or
    ``(hidden, x0)``), always new tensors; the last stage returns logits (batch, seq, vocab).
    ``attn_scale`` multiplies the default 1/sqrt(head_dim) attention scale.
    """

    def __init__(self, config: GPTConfig, stage_index: int, num_stages: int, weights: Weights) -> None:
        super().__init__()
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index {stage_index} out of range for {num_stages} stages")
        self.config = config
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.layer_range = split_layers(config.n_layers, num_stages)[stage_index]
        if self.is_first:
            self.tok_emb = _param(weights, "tok_emb")
            self.pos_emb = _param(weights, "pos_emb")
        self.blocks = nn.CellDict({str(i): Block(config, weights, i) for i in self.layer_range})
        # A stage holding both ends of a tied pair really shares tok_emb.
        self.shares_head = self.is_last and config.tie_embeddings and self.is_first
        if self.is_last:
            self.ln_f = LayerNorm(weights, "ln_f")
            if not self.shares_head:
                self.head = Linear(weights, "head", bias=False)

    def construct(self, *inputs: Tensor, attn_scale: float | None = None) -> Tensor | tuple[Tensor, Tensor]:
        two = self.config.two_tensor_boundary
        x0 = None
        if self.is_first:
            (tokens,) = inputs
            seq = tokens.shape[1]
            if seq > self.config.max_seq_len:
                raise ValueError(f"sequence length {seq} exceeds max_seq_len {self.config.max_seq_len}")
            hidden = ops.gather(self.tok_emb, tokens, 0) + self.pos_emb[:seq]
            x0 = hidden
        elif two:
            hidden, x0 = inputs
        else:
            (hidden,) = inputs
        for block in self.blocks.values():
            hidden = block(hidden, attn_scale)
        if not self.is_last:
            # Outputs never alias an input or each other (the pipeline may free sent outputs).
            if len(self.blocks) == 0 and (two or not self.is_first):
                hidden = hidden * 1.0
            if not two:
                return hidden
            return hidden, (x0 if self.is_first else x0 * 1.0)
        if two:
            hidden = hidden + x0
        hidden = self.ln_f(hidden)
        head_weight = self.tok_emb if self.shares_head else self.head.weight
        return ops.matmul(hidden, head_weight.T)


class GPTFull(GPTStage):
    """The whole model in one Cell (the test oracle); with ``tie_embeddings`` the head uses ``tok_emb``."""

    def __init__(self, config: GPTConfig, weights: Weights) -> None:
        super().__init__(config, 0, 1, weights)


def spec_name_map(stage: nn.Cell) -> dict[str, str]:
    """``{MindSpore parameter name: spec name}`` for the trainable parameters of ``stage``."""
    mapping = {}
    for path, param in stage.parameters_and_names():
        if param.name != path:
            raise RuntimeError(f"parameter {param.name!r} at {path!r}: names drifted from the spec")
        mapping[param.name] = path
    return mapping


def cross_entropy_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross entropy over every token of ``logits`` (..., vocab) against int ``targets`` (...)."""
    logp = ops.log_softmax(logits.reshape(-1, logits.shape[-1]), axis=-1)
    index = targets.reshape(-1, 1).astype(ms.int64)
    return -ops.gather_elements(logp, 1, index).mean()


def _as_tensor(x: np.ndarray | Tensor) -> Tensor:
    return x if isinstance(x, Tensor) else Tensor(np.asarray(x))


def full_batch_grads(
    model: nn.Cell, tokens: np.ndarray | Tensor, targets: np.ndarray | Tensor, **kwargs
) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and gradients (by spec name) of ``model`` (a ``GPTFull`` or a single-stage ``GPTStage``)
    on the whole batch, via ``ms.value_and_grad``. ``kwargs`` go to the forward."""
    tokens, targets = _as_tensor(tokens), _as_tensor(targets)
    names = spec_name_map(model)
    params = model.trainable_params()

    def loss_fn(tok: Tensor, tgt: Tensor) -> Tensor:
        return cross_entropy_loss(model(tok, **kwargs), tgt)

    loss, grads = ms.value_and_grad(loss_fn, grad_position=None, weights=params)(tokens, targets)
    return float(loss.asnumpy()), {names[p.name]: g.asnumpy().copy() for p, g in zip(params, grads)}
