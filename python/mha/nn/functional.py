"""mha.nn.functional: torch.nn.functional's scaled_dot_product_attention on
libmha (mha_attention forward, mha_attention_backward for autograd).

Where it differs from torch:
  - float32, bfloat16 and float16 CPU tensors (anything else: TypeError /
    ValueError).  bf16 / f16 q, k, v with no mask, dropout or modifier run
    libmha's 16-bit attention and its backward (AMX tiles for bf16 where
    the CPU has them, docs/semantics.md "bf16 and f16"); any other bf16 /
    f16 call computes in float32 and casts the result back (autograd
    flows through the casts);
  - a query row with no key left to attend to gives zeros, not NaN, and
    zero gradients;
  - dropout comes from libmha's counter-based hash keyed by a seed drawn
    from torch's default generator (torch.manual_seed makes it
    reproducible), so the masks differ from torch's own;
  - an additive float attn_mask is a constant: it gets no gradient
    (a mask that requires grad is refused);
  - the value's head dim must equal the query's;
  - inputs are (B, H, L, d); libmha reads (B, L, H*d): q, k and v that
    are transposed views of (B, L, H, d) tensors (how models make them)
    are read in place, any others gathered into that layout by the C
    layer (one pass each, the GIL released); the output (and the
    gradients) are transposed views of (B, L, H, d) tensors.
"""
import numpy as np
import torch

import mha as _mha
from mha import _core


def _check_tensor(t, name):
    """A float32 CPU tensor, or a TypeError / ValueError naming `name`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError("%s must be a torch.Tensor, not %s"
                        % (name, type(t).__name__))
    if t.device.type != "cpu":
        raise ValueError("%s is on %s: mha runs on the CPU only"
                         % (name, t.device))
    if t.dtype != torch.float32:
        raise TypeError("%s must be float32, got %s" % (name, t.dtype))


def _check(t, name, ndim=(3, 4)):
    _check_tensor(t, name)
    if t.dim() not in ndim:
        raise ValueError("%s must have %s dimensions, got shape %s"
                         % (name, " or ".join(map(str, ndim)),
                            tuple(t.shape)))


def _np(t):
    """A NumPy view of a CPU tensor (contiguous first: a copy if needed)."""
    return t.detach().contiguous().numpy()


def _seed():
    return int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64).item())


def _sdpa_mask(m, B, H, Lq, Lk):
    """torch's attn_mask (broadcastable to (B, H, Lq, Lk); bool True =
    may attend, float added) as (array, kind) for mha_attention."""
    if m is None:
        return None, 0
    if not isinstance(m, torch.Tensor):
        raise TypeError("attn_mask must be a torch.Tensor or None")
    if m.device.type != "cpu":
        raise ValueError("attn_mask is on %s: mha runs on the CPU only"
                         % m.device)
    if m.dtype == torch.bool:
        kind = _mha.MASK_ALLOW
    elif m.dtype.is_floating_point:
        kind = _mha.MASK_ADDITIVE
        if m.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError(
                "mha's scaled_dot_product_attention treats attn_mask as a "
                "constant: it cannot differentiate an attn_mask that "
                "requires grad")
        m = m.to(torch.float32)
    else:
        raise TypeError("attn_mask must be bool or floating, got %s"
                        % m.dtype)
    if m.dim() > 4 or m.dim() < 1:
        raise ValueError("attn_mask must have 1 to 4 dimensions, got %s"
                         % (tuple(m.shape),))
    # right-aligned broadcasting, as torch does: a 3-D mask is (H, Lq, Lk)
    m = m.detach().reshape((1,) * (4 - m.dim()) + tuple(m.shape))
    want = (B, H, Lq, Lk)
    for i in range(4):
        if m.shape[i] not in (1, want[i]):
            raise ValueError("attn_mask of shape %s does not broadcast to "
                             "(B, H, Lq, Lk) = %s" % (tuple(m.shape), want))
    if m.shape[2] != Lq or m.shape[3] != Lk:
        m = m.expand(m.shape[0], m.shape[1], Lq, Lk)
    return _np(m), kind


# From this many elements on, a (B, H, L, d) tensor not in libmha's layout
# is copied into it by torch (its copy runs on every thread) rather than
# gathered by the C layer on one: 3 x 12.6 MB took 11 ms more in C.
_TORCH_COPY_FROM = 1 << 16


def _any(t):
    """A NumPy view of a CPU tensor, any strides: the C layer
    (heads_first) reads (B, H, L, d) in place when it is a transposed view
    of a (B, L, H, d) tensor -- how models make q, k and v -- and gathers
    a small one of another layout itself; a large one torch copies first."""
    t = t.detach()
    if t.numel() >= _TORCH_COPY_FROM and not t.transpose(1, 2).is_contiguous():
        t = t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.numpy()


def _empty(B, H, L, d):
    """An output in libmha's layout (B, L, H, d) and its (B, H, L, d)
    view."""
    a = np.empty((B, L, H, d), np.float32)
    return a, torch.from_numpy(a).transpose(1, 2)


def _sdpa_forward(q, k, v, sinks, kw):
    """libmha's forward on (B, H, L, d) tensors: the output tensor."""
    out, res = _empty(*q.shape)
    _core.attention(q=_any(q), k=_any(k), v=_any(v), out=out,
                    sinks=None if sinks is None else _np(sinks),
                    heads_first=True, **kw)
    return res


_T, _F32 = torch.Tensor, torch.float32
# torch's 16-bit float dtypes and mha_dtype's values for them
_HALF = {torch.bfloat16: 3, torch.float16: 2}


def _bits(t):
    """The 2-byte elements of a contiguous bf16 / f16 tensor as an int16
    NumPy array over the same memory."""
    return t.view(torch.int16).numpy()


def _sdpa_half(query, key, value, attn_mask, dropout_p, is_causal, scale,
               enable_gqa, extra):
    """scaled_dot_product_attention on bf16 / f16 tensors: libmha's
    16-bit attention for the plain and causal inference call, float32
    otherwise (the result cast back to the inputs' dtype)."""
    dt = query.dtype
    for t, name in ((key, "key"), (value, "value")):
        if not isinstance(t, _T):
            raise TypeError("%s must be a torch.Tensor, not %s"
                            % (name, type(t).__name__))
        if t.dtype != dt:
            raise TypeError("query is %s but %s is %s: give all three the "
                            "same dtype" % (dt, name, t.dtype))
    grad = torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad)
    if attn_mask is not None or dropout_p or extra:
        out = scaled_dot_product_attention(
            query.float(), key.float(), value.float(), attn_mask, dropout_p,
            is_causal, scale, enable_gqa, **extra)
        return out.to(dt)
    for t, name in ((query, "query"), (key, "key"), (value, "value")):
        if t.device.type != "cpu":
            raise ValueError("%s is on %s: mha runs on the CPU only"
                             % (name, t.device))
        if t.dim() not in (3, 4) or t.dim() != query.dim():
            raise ValueError("query, key and value must all have 3 or 4 "
                             "dimensions, got shapes %s, %s, %s"
                             % (tuple(query.shape), tuple(key.shape),
                                tuple(value.shape)))
    unbatched = query.dim() == 3
    q, k, v = (t[None] if unbatched else t for t in (query, key, value))
    B, H, Lq, d = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != d:
        raise ValueError("key and value must be (B, H_kv, Lk, %d) with "
                         "B = %d, the same shape; got %s and %s"
                         % (d, B, tuple(k.shape), tuple(v.shape)))
    Hkv = k.shape[1]
    if Hkv != H and not enable_gqa:
        raise ValueError("key/value have %d heads, query %d: pass "
                         "enable_gqa=True for grouped-query attention"
                         % (Hkv, H))
    kw = (_HALF[dt], 2 if is_causal else 0,
          None if scale is None else float(scale), 0)
    if 0 in q.shape or 0 in k.shape:
        # (libmha refuses empty shapes; torch returns an empty result)
        out = torch.zeros((B, H, Lq, d), dtype=dt)
    elif grad:
        out = _SDPAHalf.apply(q, k, v, kw)
    else:
        out = _half_forward(q, k, v, kw)
    return out[0] if unbatched else out


def _half_forward(q, k, v, kw):
    out = torch.empty(q.shape, dtype=q.dtype)
    _core.attention_half(_bits(q.contiguous()), _bits(k.contiguous()),
                         _bits(v.contiguous()), _bits(out), *kw)
    return out


class _SDPAHalf(torch.autograd.Function):
    """bf16 / f16 attention with libmha's 16-bit backward
    (mha_attention_backward16), gradients in the inputs' dtype."""

    @staticmethod
    def forward(ctx, q, k, v, kw):
        ctx.kw = kw
        ctx.save_for_backward(q, k, v)
        return _half_forward(q, k, v, kw)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        gq = torch.empty(q.shape, dtype=q.dtype)
        gk = torch.empty(k.shape, dtype=k.dtype)
        gv = torch.empty(v.shape, dtype=v.dtype)
        go = grad_out.to(q.dtype).contiguous()
        _core.attention_half(_bits(q.contiguous()), _bits(k.contiguous()),
                             _bits(v.contiguous()), None, *ctx.kw,
                             _bits(go), _bits(gq), _bits(gk), _bits(gv))
        return gq, gk, gv, None


def _view(t):
    """t.numpy(), detached first only when it requires grad (.detach()
    makes a new tensor object: a microsecond a call at tiny shapes)."""
    return t.detach().numpy() if t.requires_grad else t.numpy()


def _sdpa_plain(q, k, v, is_causal, scale, gqa):
    """The short way for the common inference call (no grad, no mask,
    dropout or modifier; batched float32 CPU tensors of consistent
    shapes): one positional C call, the same computation.  Contiguous
    (B, H, L, d) tensors, torch's own layout, are read in place
    (MHA_LAYOUT_HEADS_FIRST) and the output is one too; others, below
    _TORCH_COPY_FROM elements, go to C as they are (heads_first above).
    None for anything else: the full way then checks (and raises) as
    always."""
    if type(q) is not _T or type(k) is not _T or type(v) is not _T or \
            q.dtype is not _F32 or k.dtype is not _F32 or \
            v.dtype is not _F32 or not (q.is_cpu and k.is_cpu and v.is_cpu) \
            or q.dim() != 4 or q.numel() == 0:
        return None
    B, H, Lq, d = q.shape
    ks = k.shape
    if v.shape != ks or len(ks) != 4 or ks[0] != B or ks[3] != d or \
            ks[2] == 0 or (ks[1] != H and (not gqa or H % ks[1])):
        return None
    if q.is_contiguous() and k.is_contiguous() and v.is_contiguous():
        out = np.empty((B, H, Lq, d), np.float32)
        _core.attention_plain(_view(q), _view(k), _view(v), out, 2, 0, 0,
                              2 if is_causal else 0,
                              None if scale is None else float(scale), 0)
        return torch.from_numpy(out)
    if q.numel() >= _TORCH_COPY_FROM:
        return None
    out = np.empty((B, Lq, H, d), np.float32)
    _core.attention_plain(_view(q), _view(k), _view(v), out, True, 0, 0,
                          2 if is_causal else 0,
                          None if scale is None else float(scale), 0)
    return torch.from_numpy(out).transpose(1, 2)


class _SDPA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, kw):
        ctx.kw = kw
        ctx.save_for_backward(q, k, v, sinks)
        return _sdpa_forward(q, k, v, sinks, kw)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, sinks = ctx.saved_tensors
        if grad_out is None:
            return None, None, None, None, None
        gq, tq = _empty(*q.shape)
        gk, tk = _empty(*k.shape)
        gv, tv = _empty(*v.shape)
        gs = (np.empty(sinks.shape, np.float32) if sinks is not None
              else None)
        _core.attention(q=_any(q), k=_any(k), v=_any(v), out=None,
                        sinks=None if sinks is None else _np(sinks),
                        grad_out=_any(grad_out.to(torch.float32)),
                        grad_q=gq, grad_k=gk, grad_v=gv, grad_sinks=gs,
                        heads_first=True, **ctx.kw)
        return (tq, tk, tv, None if gs is None else torch.from_numpy(gs),
                None)


def scaled_dot_product_attention(query, key, value, attn_mask=None,
                                 dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, window=None,
                                 alibi=False, softcap=None, sinks=None,
                                 rope=None, q_positions=None,
                                 k_positions=None):
    """torch.nn.functional.scaled_dot_product_attention on libmha.

    query (B, H, Lq, d), key and value (B, H_kv, Lk, d) float32 CPU
    tensors (or unbatched (H, L, d)).  attn_mask broadcastable to (B, H,
    Lq, Lk): bool True = may attend, or float added to the scores.
    is_causal: query i sees keys j <= i (top-left, torch's), not with
    attn_mask.  scale None: 1/sqrt(d).  enable_gqa: H_kv may divide H
    (query head h reads K/V head h // (H / H_kv)).  dropout_p > 0 drops
    (see the module docstring: libmha's own generator).

    Keyword-only, libmha's score modifiers (docs/semantics.md), aligned
    bottom-right (query i at position i + Lk - Lq):
        window=(left, right)   keys i+Lk-Lq-left .. i+Lk-Lq+right (-1:
                               no bound)
        alibi=True | slopes    ALiBi, the paper's slopes or (H) given
        softcap=c              s <- c tanh(s / c)
        sinks=(H) tensor       a logit per head in each softmax's
                               denominator (differentiable)
        rope='neox' | 'gptj' | dict(style=, dims=, theta=, scale=)
                               rotary embeddings of q and k, at
                               q_positions (B, Lq) / k_positions (B, Lk)
                               (default: Lk - Lq + i and j)

    Returns (B, H, Lq, d): under no_grad with q, k and v alone and all
    three contiguous, a contiguous tensor (libmha read them in place,
    MHA_LAYOUT_HEADS_FIRST); otherwise a transposed view of libmha's (B,
    Lq, H, d) output.
    Differences from torch: see this module's docstring.
    """
    if isinstance(query, _T) and query.dtype in _HALF:
        extra = {n: v for n, v in (("window", window), ("softcap", softcap),
                                   ("sinks", sinks), ("rope", rope),
                                   ("q_positions", q_positions),
                                   ("k_positions", k_positions))
                 if v is not None}
        if alibi is not False:
            extra["alibi"] = alibi
        return _sdpa_half(query, key, value, attn_mask, dropout_p, is_causal,
                          scale, enable_gqa, extra)
    if attn_mask is None and not dropout_p and window is None and \
            alibi is False and softcap is None and sinks is None and \
            rope is None and q_positions is None and k_positions is None \
            and not torch.is_grad_enabled():
        out = _sdpa_plain(query, key, value, is_causal, scale, enable_gqa)
        if out is not None:
            return out
    _check(query, "query")
    _check(key, "key")
    _check(value, "value")
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError("query, key and value must have the same number of "
                         "dimensions, got %d, %d, %d"
                         % (query.dim(), key.dim(), value.dim()))
    unbatched = query.dim() == 3
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    B, H, Lq, d = query.shape
    Bk, Hkv, Lk, dk = key.shape
    if Bk != B or value.shape[0] != B:
        raise ValueError("query, key and value must have the same batch, got "
                         "%d, %d, %d" % (B, Bk, value.shape[0]))
    if dk != d:
        raise ValueError("key has head dim %d, query %d" % (dk, d))
    if tuple(value.shape[1:3]) != (Hkv, Lk):
        raise ValueError("value must be (B, %d, %d, d), got %s"
                         % (Hkv, Lk, tuple(value.shape)))
    if value.shape[3] != d:
        raise ValueError("value has head dim %d, query %d: libmha needs "
                         "them equal" % (value.shape[3], d))
    if Hkv != H:
        if not enable_gqa:
            raise ValueError("key/value have %d heads, query %d: pass "
                             "enable_gqa=True for grouped-query attention"
                             % (Hkv, H))
        if H % Hkv:
            raise ValueError("the number of query heads %d must be a "
                             "multiple of key/value heads %d" % (H, Hkv))
    if is_causal and attn_mask is not None:
        raise ValueError("is_causal and attn_mask are mutually exclusive "
                         "(as in torch)")
    if not 0.0 <= float(dropout_p) <= 1.0:
        raise ValueError("dropout_p must be in [0, 1], got %r" % dropout_p)
    am, amk = _sdpa_mask(attn_mask, B, H, Lq, Lk)
    if sinks is not None:
        _check(sinks, "sinks", ndim=(1,))
        if sinks.shape[0] != H:
            raise ValueError("sinks must have shape (%d,), got %s"
                             % (H, tuple(sinks.shape)))
    if isinstance(alibi, torch.Tensor):
        alibi = _np(alibi.to(torch.float32))
    p = float(dropout_p)
    kw = dict(batch=B, num_heads=H, head_dim=d, q_len=Lq, kv_len=Lk,
              num_kv_heads=Hkv, scale=None if scale is None else float(scale),
              attn_mask=am, attn_mask_kind=amk, causal=2 if is_causal else 0,
              dropout=p, training=p > 0, dropout_seed=_seed() if p > 0 else 0,
              modifiers=_mha._modifiers(H, rope, alibi, window, softcap),
              q_positions=_mha._int64(q_positions, "q_positions"),
              k_positions=_mha._int64(k_positions, "k_positions"))
    if torch.is_grad_enabled() and (
            query.requires_grad or key.requires_grad or value.requires_grad
            or (sinks is not None and sinks.requires_grad)):
        out = _SDPA.apply(query, key, value, sinks, kw)
    else:
        # nothing to differentiate: no autograd node, the same call
        out = _sdpa_forward(query, key, value, sinks, kw)
    return out[0] if unbatched else out
