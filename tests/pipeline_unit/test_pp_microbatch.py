"""Splitting nested inputs into micro-batches and merging nested outputs, on the real platforms.

Expected pieces are cut with plain slicing (``x[:, 2:4]``), not with the platform's ``chunk``.
"""

from __future__ import annotations

import re
from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch

from hyper_parallel.core.pipeline_parallel.runtime.microbatch import BatchDimSpec, merge_outputs, split_inputs, split_target
from hyper_parallel.platform.torch import TorchPlatform

P = TorchPlatform()
Pair = namedtuple("Pair", "a b")


def t(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def piece(x: torch.Tensor, dim: int, i: int, num: int) -> torch.Tensor:
    size = x.shape[dim] // num
    index = [slice(None)] * x.dim()
    index[dim] = slice(i * size, (i + 1) * size)
    return x[tuple(index)]


def same(a, b) -> None:
    """Equal structure (container types too) and bitwise-equal tensors."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    else:
        assert a == b


def test_flat_arguments_keep_their_behaviour():
    x, y = t(6, 4), t(3, 6, seed=1)
    parts = split_inputs(P, (x, y, "tag", 7), {"k": t(6, 2, seed=2)}, 3, args_batch_dim=[None, 1, 0, -1])
    for i, (args, kwargs) in enumerate(parts):
        same(args, (piece(x, 0, i, 3), piece(y, 1, i, 3), "tag", 7))
        assert list(kwargs) == ["k"]
    whole = split_inputs(P, (x,), {}, 2, args_batch_dim=BatchDimSpec(None))
    assert all(args[0] is x for args, _ in whole)
    one_dim = split_inputs(P, (y, y), {}, 2, args_batch_dim=1)
    same(one_dim[1][0], (piece(y, 1, 1, 2), piece(y, 1, 1, 2)))


def test_nested_arguments_are_split_with_their_containers_kept():
    x, a, b, k = t(4, 3), t(4, 2, seed=1), t(4, seed=2), t(4, 5, seed=3)
    arg = {"x": x, "more": [a, (b, "tag", None)], "pair": Pair(a, 1.5), "od": OrderedDict(z=x)}
    parts = split_inputs(P, (arg,), {"kw": {"k": [k]}, "flag": True}, 2)
    for i, (args, kwargs) in enumerate(parts):
        expected = {
            "x": piece(x, 0, i, 2),
            "more": [piece(a, 0, i, 2), (piece(b, 0, i, 2), "tag", None)],
            "pair": Pair(piece(a, 0, i, 2), 1.5),
            "od": OrderedDict(z=piece(x, 0, i, 2)),
        }
        same(args, (expected,))
        same(kwargs, {"kw": {"k": [piece(k, 0, i, 2)]}, "flag": True})


def test_nested_specs_for_args_with_dims_other_than_zero():
    x, a, b, c = t(3, 8), t(8, 2, seed=1), t(2, 2, 8, seed=2), t(5, seed=3)
    arg = {"x": x, "y": [a, (b, c)]}
    spec = {"x": 1, "y": [0, (BatchDimSpec(2), -1)]}
    parts = split_inputs(P, (arg, x), {}, 4, args_batch_dim=[spec, BatchDimSpec(1)])
    for i, (args, _) in enumerate(parts):
        expected = {"x": piece(x, 1, i, 4), "y": [piece(a, 0, i, 4), (piece(b, 2, i, 4), c)]}
        same(args, (expected, piece(x, 1, i, 4)))
        assert args[0]["y"][1][1] is c


def test_one_leaf_spec_applies_to_every_tensor_below_it():
    x, y = t(2, 6), t(3, 6, 2, seed=1)
    parts = split_inputs(P, ({"x": x, "deep": [y, {"y": y}]},), {}, 3, args_batch_dim=[{"deep": 1, "x": 1}])
    for i, (args, _) in enumerate(parts):
        same(args, ({"x": piece(x, 1, i, 3), "deep": [piece(y, 1, i, 3), {"y": piece(y, 1, i, 3)}]},))
    whole = split_inputs(P, ([x, {"y": y}],), {}, 3, args_batch_dim=[[-1, BatchDimSpec(None)]])
    assert all(args[0][0] is x and args[0][1]["y"] is y for args, _ in whole)


def test_nested_specs_for_kwargs_with_dims_other_than_zero():
    m, n, p, q = t(5, 4), t(4, 2, seed=1), t(2, 4, seed=2), t(3, seed=3)
    kwargs = {"mask": {"a": m, "b": n, "c": "text"}, "pos": [p, q], "plain": n}
    spec = {"mask": {"a": 1}, "pos": [1, -1]}  # mask['b'] and plain: not named, so dim 0
    parts = split_inputs(P, (), kwargs, 2, kwargs_batch_dim=spec)
    for i, (args, kw) in enumerate(parts):
        assert args == ()
        same(kw, {
            "mask": {"a": piece(m, 1, i, 2), "b": piece(n, 0, i, 2), "c": "text"},
            "pos": [piece(p, 1, i, 2), q],
            "plain": piece(n, 0, i, 2),
        })
    every = split_inputs(P, (), {"mask": {"a": m}, "pos": p}, 4, kwargs_batch_dim=1)
    for i, (_, kw) in enumerate(every):
        same(kw, {"mask": {"a": piece(m, 1, i, 4)}, "pos": piece(p, 1, i, 4)})


ERRORS = [  # (args, kwargs, num, args_batch_dim, kwargs_batch_dim, error, message)
    (({"x": [t(4), t(4)]},), {}, 2, [{"x": [0, {"k": 0}]}], None, ValueError,
     "args[0]['x'][1]: the batch-dim spec is a dict but the argument is a Tensor"),
    (({"x": [t(4), t(4)]},), {}, 2, [{"x": [0, 0, 0]}], None, ValueError,
     "args[0]['x']: the batch-dim spec has 3 entries but the argument has 2"),
    (({"x": t(4)},), {}, 2, [{"x": (0,)}], None, ValueError,
     "args[0]['x']: the batch-dim spec is a tuple but the argument is a Tensor"),
    ((t(4), [t(4)]), {}, 2, [0, {"a": 0}], None, ValueError,
     "args[1]: the batch-dim spec is a dict but the argument is a list"),
    ((), {"mask": {"a": t(4)}}, 2, None, {"mask": {"a": 0, "c": 1}}, ValueError,
     "kwargs['mask']: the batch-dim spec names keys the argument does not have: ['c']"),
    ((), {"mask": "text"}, 2, None, {"mask": [0]}, ValueError,
     "kwargs['mask']: the batch-dim spec is a list but the argument is a str"),
    (({"x": [t(4), t(3, 5)]},), {}, 2, [{"x": [0, 1]}], None, ValueError,
     "args[0]['x'][1] has size 5 along dim 1, which does not divide into micro_batch_num=2"),
    ((), {"mask": {"a": [t(4, 6)]}}, 4, None, {"mask": 1}, ValueError,
     "kwargs['mask']['a'][0] has size 6 along dim 1, which does not divide into micro_batch_num=4"),
    ((), {"m": {"a": t(4, 2)}}, 2, None, {"m": {"a": 2}}, ValueError,
     "kwargs['m']['a'] has 2 dims; cannot split along dim 2"),
    (({"x": t(4)},), {}, 2, [{"x": "0"}], None, TypeError,
     "batch dim of args[0]['x']: batch dim must be an int, BatchDimSpec or None, got '0'"),
    (({"x": t(4)},), {}, 2, [{"x": -2}], None, ValueError,
     "BatchDimSpec.dim must be a non-negative int or None, got -2"),
    ((t(4), t(4)), {}, 2, [0], None, ValueError, "args_batch_dim has 1 entries for 2 positional arguments"),
    ((t(4),), {}, 2, {"x": 0}, None, TypeError, "args_batch_dim must be one spec for every positional argument"),
    ((), {"a": t(4)}, 2, None, [0], TypeError, "kwargs_batch_dim must be one spec for every keyword argument"),
    ((), {"a": t(4)}, 2, None, {"b": 0}, ValueError, "kwargs_batch_dim names arguments that were not passed: ['b']"),
]


@pytest.mark.parametrize("args, kwargs, num, args_dim, kwargs_dim, error, message", ERRORS)
def test_errors_name_the_argument_path(args, kwargs, num, args_dim, kwargs_dim, error, message):
    with pytest.raises(error, match=re.escape(message)):
        split_inputs(P, args, kwargs, num, args_dim, kwargs_dim)


def test_nested_target_is_split_along_dim_zero():
    y, z = t(6, 2), t(6, seed=1)
    parts = split_target(P, {"y": y, "rest": (z, [y])}, 3)
    for i, part in enumerate(parts):
        same(part, {"y": piece(y, 0, i, 3), "rest": (piece(z, 0, i, 3), [piece(y, 0, i, 3)])})
    with pytest.raises(ValueError, match=re.escape("target['rest'][1][0] has size 6 along dim 0, which does not "
                                                   "divide into micro_batch_num=4")):
        split_target(P, {"y": t(8), "rest": (t(8), [y])}, 4)
    with pytest.raises(TypeError, match=re.escape("target['k'] must be a tensor or a tuple/list/dict of tensors, "
                                                  "got str")):
        split_target(P, {"k": "text"}, 2)


def test_merge_outputs_concatenates_nested_outputs():
    a, b, c = t(4, 6), t(2, 6, seed=1), t(3, 6, seed=2)
    per_micro = [
        {"a": piece(a, 1, i, 3), "b": [piece(b, 1, i, 3), (piece(c, 1, i, 3), "tag")], "n": None} for i in range(3)
    ]
    same(merge_outputs(P, per_micro, 1), {"a": a, "b": [b, (c, "tag")], "n": None})
    assert merge_outputs(P, [(1, t(2)), (2, t(2))], 0)[0] == [1, 2]
    same(merge_outputs(P, [Pair(t(2), 0), Pair(t(2, seed=1), 0)], 0), Pair(torch.cat([t(2), t(2, seed=1)]), 0))
    same(merge_outputs(P, [piece(a, 0, i, 2) for i in range(2)], 0), a)


@pytest.mark.parametrize("outputs, message", [
    ([(t(2), t(2)), (t(2),)], "output: micro-batch 1 gives a tuple of 1 where micro-batch 0 gives a tuple of 2"),
    ([{"a": t(2)}, {"b": t(2)}], "output: micro-batch 1 gives a dict with keys ['b'] where micro-batch 0 gives a "
                                 "dict with keys ['a']"),
    ([[t(2), {"x": t(2)}], [t(2), {"x": 3}]], "output[1]['x']: micro-batch 1 gives an int where micro-batch 0 gives "
                                              "a tensor"),
])
def test_merge_outputs_structure_mismatch_names_the_path(outputs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        merge_outputs(P, outputs, 0)


def test_nested_split_and_merge_on_mindspore():
    import mindspore as ms

    from hyper_parallel.platform.mindspore import MindSporePlatform

    platform = MindSporePlatform()
    rng = np.random.default_rng(0)
    x, m = rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal((3, 4)).astype(np.float32)
    parts = split_inputs(platform, ({"x": ms.Tensor(x), "extra": [ms.Tensor(m), 0.5]},), {"mask": ms.Tensor(m)}, 2,
                         args_batch_dim=[{"x": 1, "extra": [1, -1]}], kwargs_batch_dim={"mask": 1})
    for i, (args, kwargs) in enumerate(parts):
        np.testing.assert_array_equal(args[0]["x"].asnumpy(), x[:, 3 * i:3 * i + 3])
        np.testing.assert_array_equal(args[0]["extra"][0].asnumpy(), m[:, 2 * i:2 * i + 2])
        assert args[0]["extra"][1] == 0.5
        np.testing.assert_array_equal(kwargs["mask"].asnumpy(), m[:, 2 * i:2 * i + 2])
    merged = merge_outputs(platform, [(a[0]["x"], {"m": k["mask"]}) for a, k in parts], 1)
    np.testing.assert_array_equal(merged[0].asnumpy(), x)
    np.testing.assert_array_equal(merged[1]["m"].asnumpy(), m)
    with pytest.raises(ValueError, match=re.escape("args[0]['extra'][0] has size 3 along dim 0, which does not "
                                                   "divide into micro_batch_num=2")):
        split_inputs(platform, ({"x": ms.Tensor(x), "extra": [ms.Tensor(m)]},), {}, 2)
