"""Framework-neutral description of the reference GPT used by tests and demos.

Only numpy and the standard library are imported here. The torch and MindSpore versions of the
model (``hyper_parallel.demo.gpt_{torch,mindspore}``) build their parameters from
:func:`init_gpt_weights`, so both frameworks start from exactly the same values.

Parameter names ("spec names"):

* ``tok_emb`` (vocab_size, d_model), ``pos_emb`` (max_seq_len, d_model)            -- first stage
* ``blocks.{i}.ln1.weight|bias``, ``blocks.{i}.attn.qkv.weight|bias`` (3*d_model, d_model),
  ``blocks.{i}.attn.proj.weight|bias``, ``blocks.{i}.ln2.weight|bias``,
  ``blocks.{i}.mlp.fc.weight|bias`` (hidden, d_model), ``blocks.{i}.mlp.proj.weight|bias``
* ``ln_f.weight|bias``, ``head.weight`` (vocab_size, d_model), no head bias             -- last stage

Linear weights are stored as (out_features, in_features). With ``tie_embeddings`` the dict still
holds ``head.weight`` (a copy of ``tok_emb``): a stage that has the head but not the embedding owns
it as a separate parameter whose gradient must be summed with ``tok_emb``'s; a stage (or the full
model) holding both uses ``tok_emb`` for the head and has no ``head.weight``.
"""

from __future__ import annotations

import importlib.resources
import math
from dataclasses import dataclass

import numpy as np

LN_EPS = 1e-5
INIT_STD = 0.02
TIED_PARAMS = ("tok_emb", "head.weight")
BLOCK_PARAM_SUFFIXES = (
    "ln1.weight",
    "ln1.bias",
    "attn.qkv.weight",
    "attn.qkv.bias",
    "attn.proj.weight",
    "attn.proj.bias",
    "ln2.weight",
    "ln2.bias",
    "mlp.fc.weight",
    "mlp.fc.bias",
    "mlp.proj.weight",
    "mlp.proj.bias",
)


@dataclass(frozen=True)
class GPTConfig:
    """Sizes and options of the reference GPT."""

    vocab_size: int
    max_seq_len: int
    d_model: int
    n_heads: int
    n_layers: int
    mlp_ratio: int = 4
    tie_embeddings: bool = False
    two_tensor_boundary: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "d_model", "n_heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_layers < 0:
            raise ValueError(f"GPTConfig.n_layers must be >= 0, got {self.n_layers}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def mlp_hidden(self) -> int:
        return self.mlp_ratio * self.d_model


def param_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every spec name of the model with its shape, in a fixed order (``head.weight`` included)."""
    d, h = config.d_model, config.mlp_hidden
    shapes: dict[str, tuple[int, ...]] = {
        "tok_emb": (config.vocab_size, d),
        "pos_emb": (config.max_seq_len, d),
    }
    block_shapes = {
        "ln1.weight": (d,),
        "ln1.bias": (d,),
        "attn.qkv.weight": (3 * d, d),
        "attn.qkv.bias": (3 * d,),
        "attn.proj.weight": (d, d),
        "attn.proj.bias": (d,),
        "ln2.weight": (d,),
        "ln2.bias": (d,),
        "mlp.fc.weight": (h, d),
        "mlp.fc.bias": (h,),
        "mlp.proj.weight": (d, h),
        "mlp.proj.bias": (d,),
    }
    for i in range(config.n_layers):
        for suffix in BLOCK_PARAM_SUFFIXES:
            shapes[f"blocks.{i}.{suffix}"] = block_shapes[suffix]
    shapes["ln_f.weight"] = (d,)
    shapes["ln_f.bias"] = (d,)
    shapes["head.weight"] = (config.vocab_size, d)
    return shapes


def init_gpt_weights(config: GPTConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic float32 initial values for every spec name.

    Matrices and embeddings ~ N(0, 0.02) (residual projections scaled by 1/sqrt(2 * n_layers)),
    biases 0, layer-norm weights 1. With ``tie_embeddings`` ``head.weight`` is a copy of ``tok_emb``.
    """
    rng = np.random.default_rng(seed)
    proj_std = INIT_STD / math.sqrt(2 * max(config.n_layers, 1))
    weights: dict[str, np.ndarray] = {}
    for name, shape in param_shapes(config).items():
        if name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")):
            value = np.ones(shape)
        elif name.endswith(".bias"):
            value = np.zeros(shape)
        elif name == "head.weight" and config.tie_embeddings:
            value = weights["tok_emb"]
        else:
            std = proj_std if name.endswith("proj.weight") else INIT_STD
            value = rng.normal(0.0, std, size=shape)
        weights[name] = np.array(value, dtype=np.float32)
    return weights


def split_layers(n_layers: int, num_stages: int) -> list[range]:
    """Global block indices of each stage: contiguous, sizes differ by at most one (earlier stages
    get the extra blocks), and a stage may hold none when ``num_stages > n_layers``."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if n_layers < 0:
        raise ValueError(f"n_layers must be >= 0, got {n_layers}")
    base, extra = divmod(n_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        stop = start + base + (1 if stage < extra else 0)
        ranges.append(range(start, stop))
        start = stop
    return ranges


def stage_param_names(config: GPTConfig, stage_index: int, num_stages: int) -> list[str]:
    """Spec names of the parameters :class:`GPTStage` owns for ``stage_index`` (in creation order)."""
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index {stage_index} out of range for {num_stages} stages")
    first, last = stage_index == 0, stage_index == num_stages - 1
    names = ["tok_emb", "pos_emb"] if first else []
    for i in split_layers(config.n_layers, num_stages)[stage_index]:
        names += [f"blocks.{i}.{suffix}" for suffix in BLOCK_PARAM_SUFFIXES]
    if last:
        names += ["ln_f.weight", "ln_f.bias"]
        if not (config.tie_embeddings and first):
            names.append("head.weight")
    return names


class CharTokenizer:
    """Maps each distinct character of a text to an id (ids follow sorted character order)."""

    def __init__(self, chars: str | list[str]) -> None:
        self.chars: tuple[str, ...] = tuple(chars)
        if len(set(self.chars)) != len(self.chars):
            raise ValueError("CharTokenizer characters must be distinct")
        self._ids = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the tokenizer's vocabulary") from None

    def decode(self, ids: list[int] | np.ndarray) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def load_tiny_corpus() -> str:
    """The small ASCII English text shipped in ``hyper_parallel/data/tiny_corpus.txt``."""
    return importlib.resources.files("hyper_parallel.data").joinpath("tiny_corpus.txt").read_text("ascii")


def sample_batch(
    ids: np.ndarray, batch_size: int, seq_len: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Random windows of a 1-D id array: ``(tokens, targets)`` int64 (batch, seq), targets shifted by 1."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 1 or len(ids) <= seq_len:
        raise ValueError(f"need a 1-D id array longer than seq_len={seq_len}, got shape {ids.shape}")
    starts = rng.integers(0, len(ids) - seq_len, size=batch_size)
    tokens = np.stack([ids[s : s + seq_len] for s in starts])
    targets = np.stack([ids[s + 1 : s + seq_len + 1] for s in starts])
    return tokens, targets
