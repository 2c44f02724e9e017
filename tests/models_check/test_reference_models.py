"""The reference GPT: stage chaining == full model, torch == MindSpore, spec helpers."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

from hyper_parallel.demo.gpt import (
    TIED_PARAMS,
    CharTokenizer,
    GPTConfig,
    init_gpt_weights,
    load_tiny_corpus,
    param_shapes,
    sample_batch,
    split_layers,
    stage_param_names,
)

torch = pytest.importorskip("torch")
ms = pytest.importorskip("mindspore")

from hyper_parallel.demo import gpt_mindspore as msm  # noqa: E402
from hyper_parallel.demo import gpt_torch as thm  # noqa: E402

VOCAB, SEQ = 32, 8
CONFIGS = [
    GPTConfig(VOCAB, SEQ, d_model=16, n_heads=2, n_layers=3, tie_embeddings=tie, two_tensor_boundary=two)
    for tie, two in itertools.product((False, True), (False, True))
]
CONFIG_IDS = [f"tie{int(c.tie_embeddings)}-two{int(c.two_tensor_boundary)}" for c in CONFIGS]
STAGES = (1, 2, 4)


@pytest.fixture(scope="module", autouse=True)
def _mindspore_in_tmp_dir(tmp_path_factory: pytest.TempPathFactory):
    """MindSpore may write rank_*/ dump folders into the working directory."""
    ms.set_device("CPU")
    old = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("mindspore"))
    yield
    os.chdir(old)


def weights_for(config: GPTConfig) -> dict[str, np.ndarray]:
    """Initial weights with every parameter perturbed, so layer-norm weights/biases matter too."""
    weights = init_gpt_weights(config, seed=3)
    rng = np.random.default_rng(4)
    out = {k: (v + rng.normal(0.0, 0.1, v.shape)).astype(np.float32) for k, v in weights.items()}
    if config.tie_embeddings:
        out["head.weight"] = out["tok_emb"].copy()
    return out


def batch(seq: int, batch_size: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, VOCAB, (batch_size, seq)), rng.integers(0, VOCAB, (batch_size, seq))


def as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def torch_chain(stages, tokens: np.ndarray, **kwargs) -> torch.Tensor:
    x = (torch.as_tensor(tokens),)
    for stage in stages:
        x = as_tuple(stage(*x, **kwargs))
    (logits,) = x
    return logits


def ms_chain(stages, tokens: np.ndarray, **kwargs):
    x = (ms.Tensor(tokens),)
    for stage in stages:
        x = as_tuple(stage(*x, **kwargs))
    (logits,) = x
    return logits


# ---------------------------------------------------------------- spec helpers


@pytest.mark.parametrize("n_layers", [0, 1, 3, 5, 8])
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 6, 9])
def test_split_layers_covers_every_block_once(n_layers: int, num_stages: int) -> None:
    ranges = split_layers(n_layers, num_stages)
    assert len(ranges) == num_stages
    assert [i for r in ranges for i in r] == list(range(n_layers))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


def test_split_layers_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_stages must be >= 1, got 0"):
        split_layers(3, 0)
    with pytest.raises(ValueError, match="n_layers must be >= 0, got -1"):
        split_layers(-1, 2)


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("num_stages", [1, 2, 4, 5])
def test_stage_param_names_partition_the_spec(config: GPTConfig, num_stages: int) -> None:
    owned = [n for s in range(num_stages) for n in stage_param_names(config, s, num_stages)]
    assert len(owned) == len(set(owned))
    expected = set(param_shapes(config))
    if config.tie_embeddings and num_stages == 1:
        expected.discard("head.weight")
    assert set(owned) == expected


def test_init_gpt_weights_is_deterministic_float32() -> None:
    config = CONFIGS[1]
    a, b, c = init_gpt_weights(config, 7), init_gpt_weights(config, 7), init_gpt_weights(config, 8)
    assert list(a) == list(param_shapes(config))
    for name, shape in param_shapes(config).items():
        assert a[name].dtype == np.float32 and a[name].shape == shape
        np.testing.assert_array_equal(a[name], b[name])
    assert not np.array_equal(a["tok_emb"], c["tok_emb"])
    assert not np.array_equal(a["tok_emb"], a["head.weight"])
    tied = init_gpt_weights(CONFIGS[2], 7)
    np.testing.assert_array_equal(tied["tok_emb"], tied["head.weight"])
    assert tied["tok_emb"] is not tied["head.weight"]


def test_config_validates_heads() -> None:
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(VOCAB, SEQ, d_model=10, n_heads=3, n_layers=1)


def test_char_tokenizer_and_corpus() -> None:
    text = load_tiny_corpus()
    assert 6_000 <= len(text) <= 10_000
    assert text.isascii()
    tok = CharTokenizer.from_text(text)
    assert tok.vocab_size == len(set(text))
    ids = tok.encode(text)
    assert min(ids) == 0 and max(ids) == tok.vocab_size - 1
    assert tok.decode(ids) == text
    assert tok.decode(np.array(tok.encode("bread"))) == "bread"
    with pytest.raises(ValueError, match="vocabulary"):
        tok.encode("\u00e9")


def test_sample_batch_targets_are_shifted_tokens() -> None:
    ids = np.arange(50)
    tokens, targets = sample_batch(ids, 4, 8, np.random.default_rng(0))
    assert tokens.shape == targets.shape == (4, 8)
    np.testing.assert_array_equal(targets, tokens + 1)
    np.testing.assert_array_equal(tokens[:, 1:], tokens[:, :-1] + 1)


# ---------------------------------------------------------------- models


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_stage_parameters_are_named_by_spec(config: GPTConfig) -> None:
    weights = weights_for(config)
    for num_stages in (1, 2, 4, 5):
        for s in range(num_stages):
            expected = stage_param_names(config, s, num_stages)
            t_stage = thm.GPTStage(config, s, num_stages, weights)
            m_stage = msm.GPTStage(config, s, num_stages, weights)
            t_map, m_map = thm.spec_name_map(t_stage), msm.spec_name_map(m_stage)
            assert sorted(t_map.values()) == sorted(m_map.values()) == sorted(expected)
            for name, p in t_stage.named_parameters():
                np.testing.assert_array_equal(p.detach().numpy(), weights[t_map[name]])
            for p in m_stage.trainable_params():
                np.testing.assert_array_equal(p.asnumpy(), weights[m_map[p.name]])


@pytest.mark.parametrize("seq", [5, SEQ])
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_chained_stages_match_full_model(config: GPTConfig, seq: int) -> None:
    weights = weights_for(config)
    tokens, _ = batch(seq)
    t_full = thm.GPTFull(config, weights)(torch.as_tensor(tokens)).detach().numpy()
    m_full = msm.GPTFull(config, weights)(ms.Tensor(tokens)).asnumpy()
    assert t_full.shape == m_full.shape == (3, seq, VOCAB)
    for num_stages in STAGES:
        t_stages = [thm.GPTStage(config, s, num_stages, weights) for s in range(num_stages)]
        m_stages = [msm.GPTStage(config, s, num_stages, weights) for s in range(num_stages)]
        np.testing.assert_allclose(torch_chain(t_stages, tokens).detach().numpy(), t_full, rtol=0, atol=1e-6)
        np.testing.assert_allclose(ms_chain(m_stages, tokens).asnumpy(), m_full, rtol=0, atol=1e-6)


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_stage_boundaries_carry_expected_tensors(config: GPTConfig) -> None:
    """Non-last stages send one or two (batch, seq, d_model) tensors that never alias their inputs."""
    weights = weights_for(config)
    tokens, _ = batch(SEQ)
    n_out = 2 if config.two_tensor_boundary else 1
    # 5 stages over 3 blocks: stages 3 and 4 hold no blocks (stage 3 only passes data through).
    x = (torch.as_tensor(tokens),)
    for s in range(5):
        out = as_tuple(thm.GPTStage(config, s, 5, weights)(*x))
        if s < 4:
            assert len(out) == n_out
            assert all(o.shape == (3, SEQ, config.d_model) and o.dtype == torch.float32 for o in out)
            assert len({o.data_ptr() for o in out} | {i.data_ptr() for i in x}) == len(out) + len(x)
        x = out
    assert x[0].shape == (3, SEQ, VOCAB)


def test_prefix_logits_do_not_depend_on_later_tokens() -> None:
    """Causal mask: logits of a 5-token prefix equal the first 5 positions of the 8-token run."""
    config = CONFIGS[3]
    weights = weights_for(config)
    tokens, _ = batch(SEQ)
    t_model, m_model = thm.GPTFull(config, weights), msm.GPTFull(config, weights)
    t_long = t_model(torch.as_tensor(tokens)).detach().numpy()
    t_short = t_model(torch.as_tensor(tokens[:, :5])).detach().numpy()
    m_long = m_model(ms.Tensor(tokens)).asnumpy()
    m_short = m_model(ms.Tensor(tokens[:, :5])).asnumpy()
    np.testing.assert_allclose(t_short, t_long[:, :5], rtol=0, atol=1e-6)
    np.testing.assert_allclose(m_short, m_long[:, :5], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="max_seq_len"):
        t_model(torch.zeros((1, SEQ + 1), dtype=torch.long))


@pytest.mark.parametrize(("seq", "attn_scale"), [(5, None), (SEQ, 0.5)])
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_torch_and_mindspore_agree(config: GPTConfig, seq: int, attn_scale: float | None) -> None:
    weights = weights_for(config)
    tokens, targets = batch(seq)
    kwargs = {} if attn_scale is None else {"attn_scale": attn_scale}
    t_model, m_model = thm.GPTFull(config, weights), msm.GPTFull(config, weights)
    t_logits = t_model(torch.as_tensor(tokens), **kwargs)
    m_logits = m_model(ms.Tensor(tokens), **kwargs)
    np.testing.assert_allclose(m_logits.asnumpy(), t_logits.detach().numpy(), rtol=0, atol=1e-5)
    t_loss = float(thm.cross_entropy_loss(t_logits, torch.as_tensor(targets)).detach())
    m_loss = float(msm.cross_entropy_loss(m_logits, ms.Tensor(targets)).asnumpy())
    assert abs(t_loss - m_loss) < 1e-5

    t_loss2, t_grads = thm.full_batch_grads(t_model, tokens, targets, **kwargs)
    m_loss2, m_grads = msm.full_batch_grads(m_model, tokens, targets, **kwargs)
    assert t_loss2 == pytest.approx(t_loss, abs=1e-7) and m_loss2 == pytest.approx(m_loss, abs=1e-7)
    assert set(t_grads) == set(m_grads) == set(stage_param_names(config, 0, 1))
    for name, grad in t_grads.items():
        assert np.abs(grad).max() > 0, name
        np.testing.assert_allclose(m_grads[name], grad, rtol=1e-4, atol=1e-5, err_msg=name)
    if attn_scale is not None:
        default = t_model(torch.as_tensor(tokens)).detach().numpy()
        assert np.abs(default - t_logits.detach().numpy()).max() > 1e-4


def test_attention_scale_reaches_every_stage() -> None:
    config = CONFIGS[3]
    weights = weights_for(config)
    tokens, _ = batch(SEQ)
    full = thm.GPTFull(config, weights)(torch.as_tensor(tokens), attn_scale=2.0).detach().numpy()
    for num_stages in STAGES:
        t_stages = [thm.GPTStage(config, s, num_stages, weights) for s in range(num_stages)]
        m_stages = [msm.GPTStage(config, s, num_stages, weights) for s in range(num_stages)]
        chained_t = torch_chain(t_stages, tokens, attn_scale=2.0).detach().numpy()
        chained_m = ms_chain(m_stages, tokens, attn_scale=2.0).asnumpy()
        np.testing.assert_allclose(chained_t, full, rtol=0, atol=1e-6)
        np.testing.assert_allclose(chained_m, full, rtol=0, atol=1e-5)


def sum_tied(config: GPTConfig, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Stage gradients as the pipeline would report them: a tied head's gradient adds to tok_emb."""
    grads = dict(grads)
    if config.tie_embeddings and TIED_PARAMS[1] in grads:
        grads[TIED_PARAMS[0]] = grads[TIED_PARAMS[0]] + grads.pop(TIED_PARAMS[1])
    return grads


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_stage_gradients_match_full_batch_grads(config: GPTConfig) -> None:
    """Backward through chained stages (both frameworks) == full_batch_grads after summing tied grads."""
    weights = weights_for(config)
    tokens, targets = batch(SEQ)
    _, reference = thm.full_batch_grads(thm.GPTFull(config, weights), tokens, targets)
    num_stages = 4

    t_stages = [thm.GPTStage(config, s, num_stages, weights) for s in range(num_stages)]
    t_params = {n: p for st in t_stages for n, p in st.named_parameters()}
    loss = thm.cross_entropy_loss(torch_chain(t_stages, tokens), torch.as_tensor(targets))
    t_grads = dict(zip(t_params, (g.numpy() for g in torch.autograd.grad(loss, list(t_params.values())))))

    m_stages = [msm.GPTStage(config, s, num_stages, weights) for s in range(num_stages)]
    m_params = [p for st in m_stages for p in st.trainable_params()]

    def m_loss(tok, tgt):
        return msm.cross_entropy_loss(ms_chain(m_stages, tok), tgt)

    _, m_raw = ms.value_and_grad(m_loss, grad_position=None, weights=m_params)(ms.Tensor(tokens), ms.Tensor(targets))
    m_grads = {p.name: g.asnumpy() for p, g in zip(m_params, m_raw)}

    for grads, atol in ((sum_tied(config, t_grads), 1e-6), (sum_tied(config, m_grads), 1e-5)):
        assert set(grads) == set(reference)
        for name, ref in reference.items():
            np.testing.assert_allclose(grads[name], ref, rtol=1e-4, atol=atol, err_msg=name)
