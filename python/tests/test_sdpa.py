"""mha.nn.functional.scaled_dot_product_attention against torch's (2.13)
in float64, and the score modifiers against reference code written here
from their definitions (docs/semantics.md), forward and backward."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mha
from mha.nn.functional import scaled_dot_product_attention as sdpa
from conftest import check_close


def tensors(r, *shapes):
    return [torch.from_numpy(r.standard_normal(s).astype(np.float32))
            for s in shapes]


def compare(fn_ours, fn_ref, inputs, G, name, wrt=None):
    """Runs ours in float32, the reference in float32 and float64; checks
    the output (2x) and the gradients of sum(out * G) (3x)."""
    res = {}
    for key, fn, dt in (("ours", fn_ours, torch.float32),
                        ("t32", fn_ref, torch.float32),
                        ("t64", fn_ref, torch.float64)):
        ins = [x.detach().to(dt).requires_grad_() for x in inputs]
        out = fn(*ins)
        grads = torch.autograd.grad((out * G.to(dt)).sum(), ins)
        res[key] = (out, grads)
    check_close(res["ours"][0], res["t32"][0], res["t64"][0], 2, name)
    for i, (a, b, c) in enumerate(zip(res["ours"][1], res["t32"][1],
                                      res["t64"][1])):
        check_close(a, b, c, 3, "%s grad %d" % (name, i), backward=True)


@pytest.mark.parametrize("seed", range(24))
def test_sdpa_parity(seed):
    r = np.random.default_rng(100 + seed)
    B, Hkv = int(r.integers(1, 3)), int(r.integers(1, 3))
    H = Hkv * int(r.choice([1, 2, 3]))
    d = int(r.choice([1, 3, 8, 16]))
    Lq, Lk = int(r.integers(1, 9)), int(r.integers(1, 11))
    causal = bool(r.random() < 0.3) and Lk >= Lq
    scale = None if r.random() < 0.5 else float(r.uniform(0.1, 1.0))
    mask = None
    kind = int(r.integers(0, 4)) if not causal else 0
    if kind == 1:      # bool (Lq, Lk), True = allowed
        m = r.random((Lq, Lk)) < 0.7
        m[:, 0] = True
        mask = torch.from_numpy(m)
    elif kind == 2:    # float (B, 1, Lq, Lk)
        m = r.standard_normal((B, 1, Lq, Lk)).astype(np.float32)
        m[r.random(m.shape) < 0.2] = -np.inf
        m[..., -1] = 0.0
        mask = torch.from_numpy(m)
    elif kind == 3:    # bool (B, 1, 1, Lk): broadcast over heads and rows
        m = r.random((B, 1, 1, Lk)) < 0.7
        m[..., 0] = True
        mask = torch.from_numpy(m)
    q, k, v = tensors(r, (B, H, Lq, d), (B, Hkv, Lk, d), (B, Hkv, Lk, d))
    G, = tensors(r, (B, H, Lq, d))
    gqa = Hkv != H
    if seed % 2:
        # as models make them: transposed views of (B, L, H, d) tensors,
        # which libmha reads in place (the even seeds: contiguous, copied
        # into libmha's layout by the C layer)
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2)
                   for x in (q, k, v))

    def ours(q, k, v):
        return sdpa(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                    enable_gqa=gqa)

    def ref(q, k, v):
        m = mask
        if m is not None and m.dtype != torch.bool:
            m = m.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m,
                                              is_causal=causal, scale=scale,
                                              enable_gqa=gqa)

    compare(ours, ref, [q, k, v], G,
            "seed %d B%d H%d Hkv%d d%d Lq%d Lk%d causal %s mask %d"
            % (seed, B, H, Hkv, d, Lq, Lk, causal, kind))


@pytest.mark.parametrize("dv,layout,causal", [
    (5, "contiguous", False), (16, "contiguous", True),
    (12, "rows", True), (3, "sliced", False)])
def test_value_width_differs(dv, layout, causal):
    """Values of another head width than queries and keys (torch's
    Ev != E, DeepSeek's MLA): torch's own SDPA in float64 the reference,
    forward and every gradient, grouped-query, in every input layout
    (contiguous heads first, transposed rows, sliced views)."""
    r = np.random.default_rng(dv)
    B, H, Hkv, d, Lq, Lk = 2, 4, 2, 8, 6, 9
    q, k, v = tensors(r, (B, H, Lq, d), (B, Hkv, Lk, d), (B, Hkv, Lk, dv))
    G, = tensors(r, (B, H, Lq, dv))
    if layout == "rows":
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2)
                   for x in (q, k, v))
    elif layout == "sliced":
        q, k, v = (torch.cat([x, x], -1)[..., ::2] for x in (q, k, v))
    out = sdpa(q, k, v, is_causal=causal, enable_gqa=True)
    assert out.shape == (B, H, Lq, dv)
    compare(lambda q, k, v: sdpa(q, k, v, is_causal=causal, enable_gqa=True),
            lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, enable_gqa=True),
            [q, k, v], G, "dv %d %s" % (dv, layout))
    # bf16 and f16 through libmha's 16-bit call (it widens d_v != d_h to
    # float32 inside and rounds each result once): against float64 torch
    # on the rounded inputs, forward and every gradient, within one
    # rounding of the result's magnitude (2^-8 bf16, 2^-11 f16) with a
    # factor 2 for float32's own error beside it.
    for dt, ulp in ((torch.bfloat16, 2 ** -8), (torch.float16, 2 ** -11)):
        qb, kb, vb = (x.detach().to(dt).requires_grad_() for x in (q, k, v))
        ob = sdpa(qb, kb, vb, is_causal=causal, enable_gqa=True)
        assert ob.dtype == dt and ob.shape == (B, H, Lq, dv)
        gb = torch.autograd.grad((ob * G.to(dt)).sum(), (qb, kb, vb))
        qd, kd, vd = (x.detach().double().requires_grad_()
                      for x in (qb, kb, vb))
        ref = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal,
                                             enable_gqa=True)
        gref = torch.autograd.grad((ref * G.to(dt).double()).sum(),
                                   (qd, kd, vd))
        for got, want, name in zip((ob,) + gb, (ref,) + gref,
                                   ("out", "dq", "dk", "dv")):
            assert got.dtype == dt and got.shape == want.shape, name
            err = float((got.detach().double() - want.detach()).abs().max())
            assert err <= 2 * ulp * (1 + float(want.detach().abs().max())), \
                "%s %s: %g" % (dt, name, err)


@pytest.mark.parametrize("L", [5, 1024])
def test_layouts_give_the_same_bits(L):
    """q, k, v contiguous (B, H, L, d), transposed views of (B, L, H, d)
    tensors (read in place) and sliced views (gathered by the C layer, or
    at L = 1024, past _TORCH_COPY_FROM, copied by torch): the same output
    and gradients, bit for bit."""
    r = np.random.default_rng(7)
    q, k, v = tensors(r, (2, 4, L, 8), (2, 2, L + 1, 8), (2, 2, L + 1, 8))
    G, = tensors(r, (2, 4, L, 8))
    assert (q.numel() >= mha.nn.functional._TORCH_COPY_FROM) == (L > 5)

    def views(kind, x):
        if kind == "contiguous":
            return x.clone()
        if kind == "BLHd":
            return x.transpose(1, 2).contiguous().transpose(1, 2)
        # every other element of the last dimension of a wider tensor
        w = torch.zeros(x.shape[:3] + (2 * x.shape[3],))
        w[..., ::2] = x
        return w[..., ::2]

    res = []
    for kind in ("contiguous", "BLHd", "strided"):
        ins = [views(kind, x).requires_grad_() for x in (q, k, v)]
        assert all(t.is_contiguous() == (kind == "contiguous") for t in ins)
        out = sdpa(*ins, enable_gqa=True, is_causal=True)
        res.append([out] + list(torch.autograd.grad((out * G).sum(), ins)))
        with torch.no_grad():   # the path without an autograd node
            assert torch.equal(sdpa(*ins, enable_gqa=True, is_causal=True),
                               out)
    for a, b, c in zip(*res):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_unbatched_and_output_layout():
    r = np.random.default_rng(1)
    q, k, v = tensors(r, (2, 5, 4), (2, 6, 4), (2, 6, 4))
    out = sdpa(q, k, v)
    assert out.shape == (2, 5, 4)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v),
                               rtol=1e-5, atol=1e-6)


def manual(q, k, v, scale, bias=None, allowed=None, softcap=None,
           sinks=None):
    """Softmax attention written out: (B, H, Lq, d) with H == H_kv."""
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        col = sinks.reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        p = torch.softmax(torch.cat([s, col.to(s.dtype)], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    return p @ v


def positions(Lq, Lk):
    i = torch.arange(Lq).reshape(-1, 1) + (Lk - Lq)   # bottom-right
    j = torch.arange(Lk).reshape(1, -1)
    return i, j


@pytest.mark.parametrize("Lq,Lk", [(5, 5), (3, 7)])
def test_modifiers(Lq, Lk):
    r = np.random.default_rng(Lq * 10 + Lk)
    B, H, d = 2, 4, 8
    q, k, v = tensors(r, (B, H, Lq, d), (B, H, Lk, d), (B, H, Lk, d))
    G, = tensors(r, (B, H, Lq, d))
    sc = 1 / math.sqrt(d)
    i, j = positions(Lq, Lk)

    # window (left 2, right 0)
    allowed = (j >= i - 2) & (j <= i)
    compare(lambda q, k, v: sdpa(q, k, v, window=(2, 0)),
            lambda q, k, v: manual(q, k, v, sc, allowed=allowed),
            [q, k, v], G, "window")
    # chunks of 3 (Llama 4's attention_chunk), causal and not
    same = (j // 3) == (i // 3)
    compare(lambda q, k, v: sdpa(q, k, v, attention_chunk=3),
            lambda q, k, v: manual(q, k, v, sc, allowed=same),
            [q, k, v], G, "chunk")
    compare(lambda q, k, v: sdpa(q, k, v, attention_chunk=3, window=(1, 0)),
            lambda q, k, v: manual(q, k, v, sc, allowed=same & allowed
                                   & (j >= i - 1)),
            [q, k, v], G, "chunk and window")
    # ALiBi, the paper's slopes, and given slopes
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / H) for h in range(H)])
    np.testing.assert_allclose(mha.alibi_slopes(H), slopes.numpy())
    dist = (i - j).abs().to(torch.float64)
    for given in (None, torch.tensor([0.5, 0.25, 0.1, 0.05])):
        s = slopes if given is None else given
        bias = -s.double().reshape(1, H, 1, 1) * dist
        compare(lambda q, k, v: sdpa(q, k, v, alibi=True if given is None
                                     else given),
                lambda q, k, v: manual(q, k, v, sc, bias=bias.to(q.dtype)),
                [q, k, v], G, "alibi %s" % given)
    # softcap
    compare(lambda q, k, v: sdpa(q, k, v, softcap=0.7),
            lambda q, k, v: manual(q, k, v, sc, softcap=0.7),
            [q, k, v], G, "softcap")
    # sinks, with their gradient
    sinks, = tensors(r, (H,))
    compare(lambda q, k, v, s: sdpa(q, k, v, sinks=s),
            lambda q, k, v, s: manual(q, k, v, sc, sinks=s),
            [q, k, v, sinks], G, "sinks")


def rotate_neox(x, pos, theta=10000.0):
    """HF rotate_half RoPE of x (B, H, L, d) at positions pos (L)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos.to(torch.float64).reshape(-1, 1) * inv.reshape(1, -1)
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def test_rope():
    r = np.random.default_rng(9)
    B, H, Lq, Lk, d = 1, 2, 3, 6, 8
    q, k, v = tensors(r, (B, H, Lq, d), (B, H, Lk, d), (B, H, Lk, d))
    G, = tensors(r, (B, H, Lq, d))
    qpos = torch.arange(Lq) + (Lk - Lq)
    kpos = torch.arange(Lk)
    compare(lambda q, k, v: sdpa(q, k, v, rope="neox"),
            lambda q, k, v: manual(rotate_neox(q, qpos), rotate_neox(k, kpos),
                                   v, 1 / math.sqrt(d)),
            [q, k, v], G, "rope neox")


def test_fully_masked_row_is_zero():
    q = torch.randn(1, 2, 3, 4, requires_grad=True)
    k = torch.randn(1, 2, 5, 4)
    v = torch.randn(1, 2, 5, 4)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False
    out = sdpa(q, k, v, attn_mask=mask)
    assert (out[:, :, 1] == 0).all() and torch.isfinite(out).all()
    out.sum().backward()
    assert (q.grad[:, :, 1] == 0).all()


def test_dropout_reproducible():
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    torch.manual_seed(5)
    a = sdpa(q, k, v, dropout_p=0.5)
    torch.manual_seed(5)
    b = sdpa(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b)
    assert not torch.allclose(a, sdpa(q, k, v))
    assert torch.equal(sdpa(q, k, v, dropout_p=0.0), sdpa(q, k, v))


BAD = [
    ("float64", TypeError, lambda q, k, v: sdpa(q.double(), k, v)),
    ("2-D", ValueError, lambda q, k, v: sdpa(q[0, 0], k[0, 0], v[0, 0])),
    ("ndarray", TypeError, lambda q, k, v: sdpa(q.numpy(), k, v)),
    ("None value", TypeError, lambda q, k, v: sdpa(q, k, None)),
    ("head dim", ValueError, lambda q, k, v: sdpa(q, k[..., :3], v)),
    ("gqa off", ValueError, lambda q, k, v: sdpa(q, k[:, :1], v[:, :1])),
    ("gqa uneven", ValueError,
     lambda q, k, v: sdpa(torch.randn(1, 3, 5, 4), k[:, :2], v[:, :2],
                          enable_gqa=True)),
    ("causal and mask", ValueError,
     lambda q, k, v: sdpa(q, k, v, attn_mask=torch.ones(5, 6,
                                                        dtype=torch.bool),
                          is_causal=True)),
    ("mask shape", ValueError,
     lambda q, k, v: sdpa(q, k, v, attn_mask=torch.ones(5, 5,
                                                        dtype=torch.bool))),
    ("int mask", TypeError,
     lambda q, k, v: sdpa(q, k, v, attn_mask=torch.ones(5, 6,
                                                        dtype=torch.int64))),
    ("NaN mask", mha.NonFiniteError,
     lambda q, k, v: sdpa(q, k, v, attn_mask=torch.full((5, 6),
                                                        float("nan")))),
    ("dropout", ValueError, lambda q, k, v: sdpa(q, k, v, dropout_p=1.5)),
    ("softcap", mha.MhaError, lambda q, k, v: sdpa(q, k, v, softcap=-1.0)),
    ("window", TypeError, lambda q, k, v: sdpa(q, k, v, window=3)),
    ("sinks shape", ValueError,
     lambda q, k, v: sdpa(q, k, v, sinks=torch.zeros(3))),
    ("rope", ValueError, lambda q, k, v: sdpa(q, k, v, rope="bogus")),
]


@pytest.mark.parametrize("name,exc,fn", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs(name, exc, fn):
    q = torch.randn(1, 2, 5, 4)
    k = torch.randn(1, 2, 6, 4)
    v = torch.randn(1, 2, 6, 4)
    with pytest.raises(exc):
        fn(q, k, v)


def test_non_cpu_refused():
    # "meta" tensors have a device and no data: the check must come first
    q = torch.randn(1, 2, 5, 4, device="meta")
    c = torch.randn(1, 2, 5, 4)
    for args in ((q, q, q), (c, q, c), (c, c, q)):
        with pytest.raises(ValueError, match="CPU"):
            sdpa(*args)


def test_no_grad_heads_first_in_place_large():
    """Large contiguous (B, H, L, d) tensors (past the size where other
    layouts are copied by torch) are read in place too: the autograd
    path's bits, GQA, causal."""
    r = np.random.default_rng(77)
    q, k, v = tensors(r, (2, 4, 130, 64), (2, 2, 150, 64), (2, 2, 150, 64))
    assert q.numel() >= (1 << 16)
    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = sdpa(*ins, is_causal=True, enable_gqa=True)
    with torch.no_grad():
        out = sdpa(q, k, v, is_causal=True, enable_gqa=True)
    assert out.is_contiguous() and torch.equal(out, ref.detach())


@pytest.mark.parametrize("seed", range(8))
def test_no_grad_short_way_is_the_same_call(seed):
    """Under no_grad, SDPA with q, k, v alone (and is_causal, scale,
    enable_gqa) takes a short way, one positional C call: the same bits as
    the autograd path; what it cannot take goes the full way and raises
    there (heads that differ without enable_gqa)."""
    r = np.random.default_rng(900 + seed)
    Hkv = int(r.integers(1, 3))
    H = Hkv * int(r.integers(1, 4))
    d = int(r.choice([1, 4, 16]))
    B, Lq, Lk = int(r.integers(1, 3)), int(r.integers(1, 7)), \
        int(r.integers(1, 7))
    causal = bool(seed % 2)
    scale = None if seed % 3 else 0.25
    q, k, v = tensors(r, (B, H, Lq, d), (B, Hkv, Lk, d), (B, Hkv, Lk, d))
    if seed % 4 == 1:   # as models make them
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2)
                   for x in (q, k, v))
    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = sdpa(*ins, is_causal=causal, scale=scale, enable_gqa=True)
    assert ref.requires_grad
    with torch.no_grad():
        out = sdpa(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
        assert not out.requires_grad and torch.equal(out, ref.detach())
        # inputs that require grad, under no_grad: the same short way
        assert torch.equal(sdpa(*ins, is_causal=causal, scale=scale,
                                enable_gqa=True), ref.detach())
        # contiguous (B, H, L, d), torch's layout, is read in place
        # (MHA_LAYOUT_HEADS_FIRST) and so is the output
        if all(x.is_contiguous() for x in (q, k, v)):
            assert out.is_contiguous()
        mixed = sdpa(q, k.transpose(1, 2).contiguous().transpose(1, 2), v,
                     is_causal=causal, scale=scale, enable_gqa=True)
        assert torch.equal(mixed, ref.detach())
        if H != Hkv:
            with pytest.raises(ValueError, match="enable_gqa"):
                sdpa(q, k, v)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_backward_on_the_forwards_plan(layout):
    """Autograd differentiates the forward's own run (a plan kept from the
    forward, no second forward), on torch's contiguous (B, H, L, d) tensors
    in place (libmha's heads-first layout) or on transposed views of (B, L,
    H, d) ones (its rows layout): the gradients are the bits of the NumPy
    level's mha.attention_backward (create, run, backward), with two graphs
    of one shape alive at once, a plan reused by a later step, sinks and a
    key mask; q changed in place before the backward is refused by torch's
    check."""
    B, H, Hkv, L, S, d = 2, 4, 2, 5, 9, 8
    g = torch.Generator().manual_seed(4)

    def leaf(h, n):
        """(leaf, the (B, h, n, d) tensor made from it)"""
        if layout == "contiguous":
            t = torch.randn(B, h, n, d, generator=g, requires_grad=True)
            return t, t
        t = torch.randn(B, n, h, d, generator=g, requires_grad=True)
        return t, t.transpose(1, 2)

    def rows(t):
        return t.detach().transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)

    def inputs():
        (lq, q), (lk, k), (lv, v) = leaf(H, L), leaf(Hkv, S), leaf(Hkv, S)
        s = torch.randn(H, generator=g, requires_grad=True)
        return (lq, lk, lv, s), (q, k, v, s)
    keys = torch.arange(S)[None, :] < torch.tensor([[9], [6]])
    for step in range(2):   # the second step reuses the first's plans
        a, b = inputs(), inputs()
        outs = [sdpa(x[0], x[1], x[2], enable_gqa=True, sinks=x[3],
                     key_mask=keys) for _, x in (a, b)]
        gos = [torch.randn(o.shape, generator=g) for o in outs]
        for (leaves, x), o, go in ((b, outs[1], gos[1]), (a, outs[0], gos[0])):
            o.backward(go)
            want = mha.attention_backward(
                rows(go).numpy(), rows(x[0]).numpy(), rows(x[1]).numpy(),
                rows(x[2]).numpy(), num_heads=H, num_kv_heads=Hkv,
                sinks=x[3].detach().numpy(),
                key_padding_mask=mha.allow(keys.numpy()))
            for t, lf, w in zip(x, leaves, want):
                if t.dim() == 4:
                    got = lf.grad if lf is not t else t.grad.transpose(1, 2)
                    got = got.reshape(w.shape)
                else:
                    got = t.grad
                np.testing.assert_array_equal(got.numpy(), w)
    (lq, _, _, _), (q, k, v, s) = inputs()
    out = sdpa(q, k, v, enable_gqa=True)
    with torch.no_grad():
        lq.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace"):
        out.sum().backward()
