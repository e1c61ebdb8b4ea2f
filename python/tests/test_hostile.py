"""The newer surfaces attacked from Python (the Reliability issue): the KV
cache, grouped-query attention, the score modifiers, tensors of the wrong
dtype, device or strides, objects outliving their partners.  Each attack
must raise the exception a Python caller expects, with a message naming
the problem, and leave the cache it touched as it was.  The C side's
table is tests/test_hostile.c."""
import copy
import gc
import pickle

import numpy as np
import pytest
import torch

import mha
import mha.nn


def f32(r, *shape):
    return r.standard_normal(shape).astype(np.float32)


@pytest.fixture
def setup():
    """A grouped-query module (E 16, 4 heads, 2 K/V heads) and a cache of
    2 sequences holding 3 tokens each."""
    r = np.random.default_rng(5)
    m = mha.Module(16, 4, num_kv_heads=2, seed=3)
    cache = mha.KVCache.for_module(m, batch=2, capacity=8)
    k, v = f32(r, 3, 8), f32(r, 3, 8)
    for s in range(2):
        cache.append(s, k, v)
    return m, cache, r


def attacks(m, cache, r):
    x1 = f32(r, 2, 1, 16)
    q = f32(r, 2, 1, 16)
    other = mha.Module(16, 4, seed=1)           # 4 K/V heads, not 2
    return [
        ("append past capacity", mha.MhaError, "capacity",
         lambda: cache.append(0, f32(r, 6, 8), f32(r, 6, 8))),
        ("append to sequence 2 of 2", mha.MhaError, "sequence 2",
         lambda: cache.append(2, f32(r, 1, 8), f32(r, 1, 8))),
        ("append of the wrong width", ValueError, r"\(n, 8\)",
         lambda: cache.append(0, f32(r, 1, 7), f32(r, 1, 7))),
        ("append k and v of different lengths", ValueError, "shape",
         lambda: cache.append(0, f32(r, 2, 8), f32(r, 1, 8))),
        ("append of strings", (TypeError, ValueError), "float|dtype|could not",
         lambda: cache.append(0, [["a"] * 8], [["b"] * 8])),
        ("truncate beyond the length", mha.MhaError, "length 3",
         lambda: cache.truncate(1, 4)),
        ("truncate to a negative length", mha.MhaError, "-1",
         lambda: cache.truncate(0, -1)),
        ("read past the length", mha.MhaError, "length 3",
         lambda: cache.read(0, 2, 2)),
        ("read from past the end", ValueError, "start",
         lambda: cache.read(0, 5)),
        ("reset of sequence 7", mha.MhaError, "sequence 7",
         lambda: cache.reset(7)),
        ("a cache of another module's heads", mha.ShapeError, "K/V heads",
         lambda: other.forward(x1, cache=cache)),
        ("a cache and a key", mha.MhaError, "key",
         lambda: m.forward(x1, x1, cache=cache)),
        ("a cache, one sequence of its two", mha.ShapeError, "2 sequences",
         lambda: m.forward(x1[:1], cache=cache)),
        ("a cache in training", mha.MhaError, "training",
         lambda: m.forward(x1, cache=cache, training=True)),
        ("queries past the capacity", mha.MhaError, "do not fit",
         lambda: m.forward(f32(r, 2, 6, 16), cache=cache)),
        ("attention: heads not a multiple of the K/V heads", ValueError,
         "num_kv_heads",
         lambda: mha.attention(q, q[..., :12], q[..., :12], num_heads=4,
                               num_kv_heads=3)),
        ("attention: a K width not H_kv d_h", ValueError,
         r"num_kv_heads 2 x head_dim 4",
         lambda: mha.attention(q, q[..., :6], q[..., :6], num_heads=4,
                               num_kv_heads=2)),
        ("a cache dtype that does not exist", ValueError, "dtype",
         lambda: mha.KVCache(1, 2, 4, 8, dtype="int4")),
        ("a window wider than the ring", mha.MhaError, "window",
         lambda: mha.KVCache(1, 2, 4, 4, window=5)),
        ("a rope style that does not exist", ValueError, "rope",
         lambda: mha.Module(16, 4, rope="sideways")),
        ("a negative softcap", mha.MhaError, "softcap",
         lambda: mha.Module(16, 4, softcap=-1.0)),
        ("a window of one number", (TypeError, ValueError), "window",
         lambda: mha.Module(16, 4, window=3)),
        ("ALiBi slopes with NaN", mha.MhaError, "slope",
         lambda: mha.attention(q, q, q, num_heads=4,
                               alibi=[0.5, np.nan, 0.25, 0.1])),
        ("negative RoPE positions", mha.MhaError, "position",
         lambda: mha.rope_apply(f32(r, 2, 16), 4, positions=[0, -3])),
        ("float64 query (float16 and bfloat16 are the 16-bit module)",
         TypeError, "float32",
         lambda: m.forward(x1.astype(np.float64))),
        ("a torch tensor on the meta device", (TypeError, ValueError,
                                               RuntimeError), "device|meta|CPU|cpu",
         lambda: mha.nn.functional.scaled_dot_product_attention(
             torch.empty(1, 2, 3, 4, device="meta"),
             torch.empty(1, 2, 3, 4, device="meta"),
             torch.empty(1, 2, 3, 4, device="meta"))),
        ("pickling a cache", (TypeError, pickle.PicklingError), "pickle",
         lambda: pickle.dumps(cache)),
    ]


NAMES = [a[0] for a in attacks(*(lambda m: (m, mha.KVCache.for_module(
    m, batch=2, capacity=8), np.random.default_rng(0)))(
        mha.Module(16, 4, num_kv_heads=2, seed=3)))]


@pytest.mark.parametrize("name", NAMES)
def test_attack(setup, name):
    m, cache, r = setup
    before = [cache.read(s) for s in range(2)]
    (_, exc, words, fn), = [a for a in attacks(m, cache, r) if a[0] == name]
    with pytest.raises(exc, match=words):
        fn()
    assert cache.lengths == [3, 3], name
    for s in range(2):
        k, v = cache.read(s)
        np.testing.assert_array_equal(k, before[s][0])
        np.testing.assert_array_equal(v, before[s][1])


def test_table_is_long_enough():
    assert len(NAMES) >= 25


def test_strided_and_reversed_inputs_are_read_right():
    """Negative strides and steps: the same bits as a contiguous copy."""
    r = np.random.default_rng(2)
    m = mha.Module(8, 2, num_kv_heads=1, seed=4)
    x = f32(r, 2, 10, 8)
    for view in (x[:, ::-1], x[:, ::2], x[::-1], np.asfortranarray(x)):
        np.testing.assert_array_equal(m.forward(view),
                                      m.forward(np.ascontiguousarray(view)))


def test_objects_outliving_their_partners():
    """A cache outlives the module it was shaped for; a copy of a cache
    shares nothing that a free could pull from under the other; an nn
    module's cache-less forward after the numpy module it made is gone."""
    r = np.random.default_rng(3)
    m = mha.Module(16, 4, num_kv_heads=2, seed=3)
    cache = mha.KVCache.for_module(m, batch=1, capacity=8)
    x = f32(r, 1, 2, 16)
    want = m.forward(x, cache=cache)
    cache.reset()
    state = m.state_dict()
    del m
    gc.collect()
    cache.append(0, f32(r, 1, 8), f32(r, 1, 8))      # still usable
    cache.reset()
    m2 = mha.Module(16, 4, num_kv_heads=2, seed=0)
    m2.load_state_dict(state)
    np.testing.assert_array_equal(m2.forward(x, cache=cache), want)
    twin = copy.copy(cache)
    del cache
    gc.collect()
    assert twin.lengths == [2]
    twin.truncate(0, 1)
    assert twin.lengths == [1]
