"""Reference GPT in torch, built from :func:`hyper_parallel.demo.gpt.init_gpt_weights`.

Mirrors ``hyper_parallel.demo.gpt_mindspore`` op for op. ``named_parameters()`` of a stage
yields the spec names directly (``tok_emb``, ``blocks.3.attn.qkv.weight``, ``head.weight`` ...).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel.demo.gpt import LN_EPS, GPTConfig, split_layers

Weights = Mapping[str, np.ndarray]


def _param(weights: Weights, name: str) -> nn.Parameter:
    return nn.Parameter(torch.tensor(np.asarray(weights[name], dtype=np.float32)))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (written out so both frameworks compute the same formula)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` with weight (out, in)."""

    def __init__(self, weights: Weights, prefix: str, bias: bool = True) -> None:
        super().__init__()
        self.weight = _param(weights, f"{prefix}.weight")
        self.bias = _param(weights, f"{prefix}.bias") if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.weight.t())
        return y if self.bias is None else y + self.bias


class LayerNorm(nn.Module):
    """Layer norm over the last dim (biased variance, eps=1e-5), written out."""

    def __init__(self, weights: Weights, prefix: str) -> None:
        super().__init__()
        self.weight = _param(weights, f"{prefix}.weight")
        self.bias = _param(weights, f"{prefix}.bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=-1, keepdim=True)
        centered = x - mean
        var = (centered * centered).mean(dim=-1, keepdim=True)
        return centered / torch.sqrt(var + LN_EPS) * self.weight + self.bias


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, weights: Weights, prefix: str) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.qkv = Linear(weights, f"{prefix}.qkv")
        self.proj = Linear(weights, f"{prefix}.proj")

    def forward(self, x: torch.Tensor, attn_scale: float | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = torch.split(self.qkv(x), d, dim=-1)
        q, k, v = (z.reshape(b, t, self.n_heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        scale = 1.0 / math.sqrt(self.head_dim) * (1.0 if attn_scale is None else attn_scale)
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, weights: Weights, prefix: str) -> None:
        super().__init__()
        self.fc = Linear(weights, f"{prefix}.fc")
        self.proj = Linear(weights, f"{prefix}.proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(gelu_tanh(self.fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block."""

    def __init__(self, config: GPTConfig, weights: Weights, index: int) -> None:
        super().__init__()
        prefix = f"blocks.{index}"
        self.ln1 = LayerNorm(weights, f"{prefix}.ln1")
        self.attn = CausalSelfAttention(config, weights, f"{prefix}.attn")
        self.ln2 = LayerNorm(weights, f"{prefix}.ln2")
        self.mlp = MLP(weights, f"{prefix}.mlp")

    def forward(self, x: torch.Tensor, attn_scale: float | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), attn_scale)
        return x + self.mlp(self.ln2(x))


class GPTStage(nn.Module):
    """The layers of pipeline stage ``stage_index`` of ``num_stages`` (see ``split_layers``).

    First stage: ``forward(tokens)`` with int ids (batch, seq). Other stages: ``forward(hidden)`` or,
    with ``two_tensor_boundary``, ``forward(hidden, x0)``. Non-last stages return ``hidden`` (or
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
        self.blocks = nn.ModuleDict({str(i): Block(config, weights, i) for i in self.layer_range})
        # A stage holding both ends of a tied pair really shares tok_emb.
        self.shares_head = self.is_last and config.tie_embeddings and self.is_first
        if self.is_last:
            self.ln_f = LayerNorm(weights, "ln_f")
            if not self.shares_head:
                self.head = Linear(weights, "head", bias=False)

    def forward(
        self, *inputs: torch.Tensor, attn_scale: float | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        two = self.config.two_tensor_boundary
        if self.is_first:
            (tokens,) = inputs
            seq = tokens.shape[1]
            if seq > self.config.max_seq_len:
                raise ValueError(f"sequence length {seq} exceeds max_seq_len {self.config.max_seq_len}")
            hidden = self.tok_emb[tokens.long()] + self.pos_emb[:seq]
            x0 = hidden
        elif two:
            hidden, x0 = inputs
        else:
            (hidden,) = inputs
            x0 = None
        for block in self.blocks.values():
            hidden = block(hidden, attn_scale)
        if not self.is_last:
            # Outputs never alias an input or each other (the pipeline may free sent outputs).
            if len(self.blocks) == 0 and (two or not self.is_first):
                hidden = hidden.clone()
            if not two:
                return hidden
            return hidden, (x0 if self.is_first else x0.clone())
        if two:
            hidden = hidden + x0
        hidden = self.ln_f(hidden)
        head_weight = self.tok_emb if self.shares_head else self.head.weight
        return torch.matmul(hidden, head_weight.t())


class GPTFull(GPTStage):
    """The whole model in one module (the test oracle); with ``tie_embeddings`` the head uses ``tok_emb``."""

    def __init__(self, config: GPTConfig, weights: Weights) -> None:
        super().__init__(config, 0, 1, weights)


def spec_name_map(stage: nn.Module) -> dict[str, str]:
    """``{torch parameter name: spec name}`` -- the identity, names are spec names already."""
    return {name: name for name, _ in stage.named_parameters()}


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over every token of ``logits`` (..., vocab) against int ``targets`` (...)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long())


def full_batch_grads(
    model: nn.Module, tokens: np.ndarray | torch.Tensor, targets: np.ndarray | torch.Tensor, **kwargs
) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and gradients (by spec name) of ``model`` (a ``GPTFull`` or a single-stage ``GPTStage``)
    on the whole batch; ``.grad`` of the parameters is left untouched. ``kwargs`` go to forward."""
    tokens, targets = torch.as_tensor(tokens), torch.as_tensor(targets)
    names = spec_name_map(model)
    params = dict(model.named_parameters())
    loss = cross_entropy_loss(model(tokens, **kwargs), targets)
    grads = torch.autograd.grad(loss, list(params.values()))
    return float(loss.detach()), {names[n]: g.detach().numpy().copy() for n, g in zip(params, grads)}
