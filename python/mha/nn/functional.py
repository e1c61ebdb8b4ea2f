"""mha.nn.functional: torch.nn.functional's scaled_dot_product_attention on
libmha (mha_attention forward, mha_attention_backward for autograd).

Where it differs from torch:
  - float32, bfloat16 and float16 CPU tensors (anything else: TypeError /
    ValueError).  bf16 / f16 q, k, v run libmha's 16-bit attention, masks
    and modifiers included (AMX tiles for bf16 where the CPU has them,
    else the float32 engine widening each tile, docs/semantics.md "bf16
    and f16"), the output in that dtype; with autograd, on a 16-bit plan
    whose backward reuses the forward it kept (the gradients in that
    dtype, the sinks' float32);
  - a query row with no key left to attend to gives zeros, not NaN, and
    zero gradients;
  - dropout comes from libmha's counter-based hash keyed by a seed drawn
    from torch's default generator (torch.manual_seed makes it
    reproducible), so the masks differ from torch's own;
  - an additive float attn_mask is a constant: it gets no gradient
    (a mask that requires grad is refused);
  - the value's head dim may differ from the query's, as in torch (Ev !=
    E: libmha's v_head_dim), in float32, bf16 and f16 alike;
  - inputs are (B, H, L, d); libmha reads (B, L, H*d): q, k and v that
    are transposed views of (B, L, H, d) tensors (how models make them)
    are read in place, any others gathered into that layout by the C
    layer (one pass each, the GIL released); the output (and the
    gradients) are transposed views of (B, L, H, d) tensors.
"""
import collections
from typing import Any, Optional, Tuple

import numpy as np
import torch
from torch.nn.attention.bias import CausalBias, CausalVariant

import mha as _mha
from mha import _core


def _check_tensor(t, name, dtype=torch.float32):
    """A CPU tensor of dtype (float32 unless said), or a TypeError /
    ValueError naming `name`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError("%s must be a torch.Tensor, not %s"
                        % (name, type(t).__name__))
    if t.device.type != "cpu":
        raise ValueError("%s is on %s: mha runs on the CPU only"
                         % (name, t.device))
    if t.dtype != dtype:
        raise TypeError("%s must be %s, got %s"
                        % (name, str(dtype).replace("torch.", ""), t.dtype))


def _check(t, name, ndim=(3, 4), dtype=torch.float32):
    _check_tensor(t, name, dtype)
    if t.dim() not in ndim:
        raise ValueError("%s must have %s dimensions, got shape %s"
                         % (name, " or ".join(map(str, ndim)),
                            tuple(t.shape)))


def _np(t):
    """A NumPy view of a CPU tensor (contiguous first: a copy if needed)."""
    return t.detach().contiguous().numpy()


def _first_order(backward):
    """A backward with no derivative of its own: libmha computes the
    gradients, so a second derivative (create_graph=True: gradient
    penalties, Hessian products) raises here, by name, rather than
    silently dropping the second-order term."""
    def first_order(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "mha's attention is differentiable once: its backward is "
                "libmha's, with no derivative of its own, so "
                "create_graph=True (a second derivative) is not supported; "
                "use torch's attention for double backward")
        return backward(ctx, *grads)
    return first_order


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


def _empty_as(shape, heads_first, dtype=None):
    """A (B, H, L, d) output as (array, tensor): with heads_first both
    contiguous (B, H, L, d), else libmha's rows layout and its view.
    dtype: torch.bfloat16 / float16, the array then the tensor's bits."""
    if dtype is not None:
        b, h, n, d = shape
        t = torch.empty(shape if heads_first else (b, n, h, d), dtype=dtype)
        return _bits(t), t if heads_first else t.transpose(1, 2)
    if heads_first:
        a = np.empty(shape, np.float32)
        return a, torch.from_numpy(a)
    return _empty(*shape)


def _sdpa_forward(q, k, v, sinks, kw, in_place):
    """libmha's forward on (B, H, L, d) tensors: the output tensor.
    Contiguous q, k and v (torch's own layout: a KV cache's keys, rotated
    queries) are read in place, heads first, and so is the output written
    (in_place: not with RoPE, which rotates copies in the rows layout);
    others go through heads_first gathering (_any)."""
    sa = None if sinks is None else _np(sinks)
    oshape = tuple(q.shape[:3]) + (v.shape[3],)   # (values' head width)
    if in_place and q.is_contiguous() and k.is_contiguous() and \
            v.is_contiguous():
        out, res = _empty_as(oshape, True)
        _core.attention(q=_view(q), k=_view(k), v=_view(v), out=out,
                        sinks=sa, heads_first=2, **kw)
        return res
    out, res = _empty(*oshape)
    _core.attention(q=_any(q), k=_any(k), v=_any(v), out=out, sinks=sa,
                    heads_first=True, **kw)
    return res


_T, _F32 = torch.Tensor, torch.float32
# torch's 16-bit float dtypes and mha_dtype's values for them
_HALF = {torch.bfloat16: 3, torch.float16: 2}


def _bits(t):
    """The 2-byte elements of a contiguous bf16 / f16 tensor as an int16
    NumPy array over the same memory."""
    return t.view(torch.int16).numpy()


def _sdpa_half(query, key, value, attn_mask, dropout_p, causal, scale,
               enable_gqa, extra):
    """scaled_dot_product_attention on bf16 / f16 tensors: libmha's
    16-bit attention, its own short call for the plain and causal call,
    the full one (masks, dropout, modifiers; read and written in 16 bits,
    widened per tile) otherwise, and for any call to be differentiated
    (on a 16-bit plan, whose backward reuses the forward it kept)."""
    dt = query.dtype
    for t, name in ((key, "key"), (value, "value")):
        if not isinstance(t, _T):
            raise TypeError("%s must be a torch.Tensor, not %s"
                            % (name, type(t).__name__))
        if t.dtype != dt:
            raise TypeError("query is %s but %s is %s: give all three the "
                            "same dtype" % (dt, name, t.dtype))
    grad = torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad or
        getattr(extra.get("sinks"), "requires_grad", False))
    if attn_mask is not None or dropout_p or extra or grad:
        return _sdpa(query, key, value, attn_mask, dropout_p, causal, scale,
                     enable_gqa, half=_HALF[dt], **extra)
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
    # (the values' head width may differ: Ev != E, as torch allows)
    if k.shape[:3] != v.shape[:3] or k.shape[0] != B or k.shape[3] != d \
            or v.shape[3] == 0:
        raise ValueError("key must be (B, H_kv, Lk, %d) and value (B, H_kv, "
                         "Lk, d_v) with B = %d; got %s and %s"
                         % (d, B, tuple(k.shape), tuple(v.shape)))
    Hkv = k.shape[1]
    if Hkv != H and not enable_gqa:
        raise ValueError("key/value have %d heads, query %d: pass "
                         "enable_gqa=True for grouped-query attention"
                         % (Hkv, H))
    kw = (_HALF[dt], causal, None if scale is None else float(scale), 0)
    if 0 in q.shape or 0 in k.shape:
        out = _Empty.apply((B, H, Lq, v.shape[3]), q, k, v)
    else:
        out = _half_forward(q, k, v, kw)
    return out[0] if unbatched else out


def _half_forward(q, k, v, kw):
    out = torch.empty(q.shape[:3] + v.shape[3:], dtype=q.dtype)
    _core.attention_half(_bits(q.contiguous()), _bits(k.contiguous()),
                         _bits(v.contiguous()), _bits(out), *kw)
    return out


def _view(t):
    """t.numpy(), detached first only when it requires grad (.detach()
    makes a new tensor object: a microsecond a call at tiny shapes)."""
    return t.detach().numpy() if t.requires_grad else t.numpy()


def _sdpa_plain(q, k, v, causal, scale, gqa, rows_out=False,
                key_mask=None):
    """The short way for the common inference call (no grad, no mask,
    dropout or modifier; batched float32 CPU tensors of consistent
    shapes): one positional C call, the same computation.  Contiguous
    (B, H, L, d) tensors, torch's own layout, are read in place
    (MHA_LAYOUT_HEADS_FIRST) and the output is one too; others, below
    _TORCH_COPY_FROM elements, go to C as they are (heads_first above).
    None for anything else: the full way then checks (and raises) as
    always.  rows_out: the output (B, Lq, H, d) contiguous instead
    (transformers' hooks return that), which for one query row is the same
    memory as (B, H, 1, d): no copy.  key_mask: None or a contiguous
    (B, Lk) bool tensor (True = the key takes part)."""
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
    extra = ()   # attention_plain's optional 11th argument
    if key_mask is not None:
        if type(key_mask) is not _T or key_mask.dtype is not torch.bool or \
                key_mask.shape != (B, ks[2]) or \
                not key_mask.is_contiguous():
            return None
        extra = (key_mask.numpy(),)
    if q.is_contiguous() and k.is_contiguous() and v.is_contiguous():
        one = rows_out and Lq == 1
        out = np.empty((B, 1, H, d) if one else (B, H, Lq, d), np.float32)
        _core.attention_plain(_view(q), _view(k), _view(v), out, 2, 0, 0,
                              causal,
                              None if scale is None else float(scale), 0,
                              *extra)
        out = torch.from_numpy(out)
        return out if one or not rows_out else \
            out.transpose(1, 2).contiguous()
    if q.numel() >= _TORCH_COPY_FROM:
        return None
    out = np.empty((B, Lq, H, d), np.float32)
    _core.attention_plain(_view(q), _view(k), _view(v), out, True, 0, 0,
                          causal, None if scale is None else float(scale),
                          0, *extra)
    out = torch.from_numpy(out)
    return out if rows_out else out.transpose(1, 2)


def _rows(t, half=False):
    """A (B, H, L, d) tensor in libmha's rows layout, (B, L, H, d)
    C-contiguous, as a NumPy array: a view when it is a transposed view of
    such a tensor (how models make q, k and v), torch's copy otherwise
    (half: in its own 16-bit dtype, the array its bits)."""
    r = t.detach().transpose(1, 2)
    r = r if r.is_contiguous() else r.contiguous()
    return _bits(r) if half else r.numpy()


# Idle attention plans by shape (B, H, H_kv, Lq, Lk, d_h, threads): a
# forward that autograd will differentiate runs on one (made on first
# use), its backward differentiates that run (no second forward, nothing
# allocated), then gives it back.  The few most recent shapes are kept.
_PLANS = collections.OrderedDict()
_PLANS_KEPT = 4


def _plan_of(key):
    return _PLANS.pop(key, True)


def _give_back(key, plan):
    _PLANS[key] = plan
    while len(_PLANS) > _PLANS_KEPT:
        _PLANS.popitem(last=False)


class _SDPA(torch.autograd.Function):
    """libmha's attention on a plan whose backward differentiates the run
    it kept: float32, or bf16 / f16 data (kw["dtype"]) on a 16-bit plan,
    the gradients in the data's dtype (sinks' float32)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, kw, in_place):
        ctx.kw = kw
        ctx.dt = q.dtype if kw.get("dtype") else None
        # Contiguous (B, H, L, d) tensors, torch's own, are read and written
        # where they are (libmha's heads-first layout, the gradients too;
        # not with RoPE);
        # any others in libmha's rows layout, (B, L, H, d), where they are
        # transposed views of it (how models make q, k and v), else copied.
        # The backward must see the very buffers of this run (the plan
        # checks them): they are kept here.
        ctx.hf = 2 if (in_place and q.is_contiguous() and
                       k.is_contiguous() and v.is_contiguous()) else 0
        half = ctx.dt is not None
        if ctx.hf:
            arr = (lambda t: _bits(t.detach())) if half else \
                (lambda t: t.detach().numpy())
        else:
            arr = (lambda t: _rows(t, half))
        ctx.arrays = (arr(q), arr(k), arr(v),
                      None if sinks is None else _np(sinks))
        ctx.key = (tuple(q.shape) + tuple(k.shape[1:3]) +
                   (v.shape[3], kw["num_threads"], ctx.hf, ctx.dt))
        out, res = _empty_as(tuple(q.shape[:3]) + (v.shape[3],), ctx.hf,
                             ctx.dt)
        qa, ka, va, sa = ctx.arrays
        ctx.plan = _core.attention(q=qa, k=ka, v=va, out=out, sinks=sa,
                                   plan=_plan_of(ctx.key),
                                   heads_first=ctx.hf, **kw)
        # (a 16-bit plan on the bf16 kernels reads its output again, as
        # torch's flash backward does: saved, so that torch refuses a
        # backward after the output was changed in place)
        ctx.out = out if half else None
        ctx.save_for_backward(q, k, v, sinks, res if half else None)
        return res

    @staticmethod
    @_first_order
    def backward(ctx, grad_out):
        q, k, v, sinks, _ = ctx.saved_tensors   # (torch's in-place checks)
        if grad_out is None:
            return None, None, None, None, None, None
        hf, dt = ctx.hf, ctx.dt
        gq, tq = _empty_as(q.shape, hf, dt)
        gk, tk = _empty_as(k.shape, hf, dt)
        gv, tv = _empty_as(v.shape, hf, dt)
        gs = (np.empty(sinks.shape, np.float32) if sinks is not None
              else None)
        go = grad_out.to(dt or torch.float32)
        if hf:
            go = go.contiguous()
            go = _bits(go) if dt else go.numpy()
        else:
            go = _rows(go, dt is not None)
        qa, ka, va, sa = ctx.arrays
        _core.attention(q=qa, k=ka, v=va, out=ctx.out, sinks=sa, grad_out=go,
                        grad_q=gq, grad_k=gk, grad_v=gv, grad_sinks=gs,
                        plan=ctx.plan, heads_first=hf, **ctx.kw)
        _give_back(ctx.key, ctx.plan)
        ctx.plan = ctx.arrays = ctx.out = None
        return (tq, tk, tv, None if gs is None else torch.from_numpy(gs),
                None, None)


def _half_full(q, k, v, sinks, kw, rows):
    """libmha's 16-bit attention with every option on (B, H, L, d) bf16 /
    f16 tensors, the output in their dtype: contiguous ones read and
    written where they lie (heads first; others copied in their own
    dtype), or, with rows (RoPE, which libmha applies in its rows
    layout), copied to (B, L, H, d) and the output a transposed view of
    that layout."""
    def lay(t):   # the layout libmha reads, as a contiguous tensor
        return t.transpose(1, 2).contiguous() if rows else t.contiguous()

    b, h, n, dv = q.shape[:3] + (v.shape[3],)
    out = torch.empty((b, n, h, dv) if rows else (b, h, n, dv),
                      dtype=q.dtype)
    _core.attention(q=_bits(lay(q)), k=_bits(lay(k)), v=_bits(lay(v)),
                    out=_bits(out), sinks=None if sinks is None else _np(sinks),
                    heads_first=0 if rows else 2, **kw)
    return out.transpose(1, 2) if rows else out


class _Empty(torch.autograd.Function):
    """The result of an empty problem (B, Lq or Lk zero): zeros of the
    output's shape, as torch gives (with no key a row's context is zero,
    libmha's rule), and zero gradients for the inputs."""

    @staticmethod
    def forward(ctx, shape, *inputs):
        ctx.inputs = [(t.shape, t.dtype) for t in inputs]
        return inputs[0].new_zeros(shape)

    @staticmethod
    @_first_order
    def backward(ctx, grad_out):
        return (None,) + tuple(torch.zeros(s, dtype=d) for s, d in ctx.inputs)


def _causal_of(attn_mask, is_causal, Lq, Lk):
    """(attn_mask, libmha's causal kind) from torch's arguments: is_causal
    is top-left (torch's), a CausalBias (torch.nn.attention.bias'
    causal_upper_left / causal_lower_right) is its variant."""
    if not isinstance(attn_mask, CausalBias):
        return attn_mask, 2 if is_causal else 0
    if is_causal:
        raise ValueError("is_causal and a CausalBias attn_mask are mutually "
                         "exclusive (as in torch)")
    if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (Lq, Lk):
        raise ValueError("the CausalBias is for (Lq, Lk) = (%d, %d), the "
                         "inputs are (%d, %d)"
                         % (attn_mask.seq_len_q, attn_mask.seq_len_kv, Lq, Lk))
    return None, 2 if attn_mask.variant == CausalVariant.UPPER_LEFT else 1


def _key_lengths(x, B, Lk):
    """key_lengths (B,) ints in [0, Lk] as an int64 array, or None."""
    if x is None:
        return None
    t = torch.as_tensor(x)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() != 1 \
            or t.shape[0] != B:
        raise ValueError("key_lengths must be (B,) = (%d,) integers, got %s "
                         "%s" % (B, t.dtype, tuple(t.shape)))
    if t.numel() and (int(t.min()) < 0 or int(t.max()) > Lk):
        raise ValueError("key_lengths must lie in [0, Lk = %d], got %s"
                         % (Lk, t.tolist()))
    return _np(t.to(torch.int64))


def _key_mask(m, B, Lk):
    """key_mask (B, Lk) bool, True = the key takes part, as an array."""
    if m is None:
        return None, 0
    if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or \
            tuple(m.shape) != (B, Lk):
        raise ValueError("key_mask must be a (B, Lk) = (%d, %d) bool tensor "
                         "(True: the key takes part), got %s" % (
                             B, Lk, tuple(m.shape) if isinstance(
                                 m, torch.Tensor) else type(m).__name__))
    return _np(m), _mha.MASK_ALLOW


def scaled_dot_product_attention(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
        is_causal: bool = False, scale: Optional[float] = None,
        enable_gqa: bool = False, *, key_lengths: Any = None,
        key_mask: Optional[torch.Tensor] = None,
        window: Optional[Tuple[int, int]] = None, alibi: Any = False,
        softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
        rope: Any = None, q_positions: Any = None,
        k_positions: Any = None,
        attention_chunk: Optional[int] = None) -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention on libmha.

    query (B, H, Lq, d), key and value (B, H_kv, Lk, d) float32, bfloat16
    or float16 CPU tensors (or unbatched (H, L, d)).  attn_mask
    broadcastable to (B, H, Lq, Lk): bool True = may attend, or float
    added to the scores; or torch's CausalBias (causal_upper_left /
    causal_lower_right, computed from indices, no mask memory).
    is_causal: query i sees keys j <= i (top-left, torch's), not with
    attn_mask.  scale None: 1/sqrt(d).  enable_gqa: H_kv may divide H
    (query head h reads K/V head h // (H / H_kv)).  dropout_p > 0 drops
    (see the module docstring: libmha's own generator).

    Keyword-only, padding without a dense mask:
        key_lengths=(B,) ints  sequence b's keys are its first
                               key_lengths[b] (right padding)
        key_mask=(B, Lk) bool  True: the key takes part (any padding)

    Keyword-only, libmha's score modifiers (docs/semantics.md), aligned
    bottom-right (query i at position i + Lk - Lq):
        window=(left, right)   keys i+Lk-Lq-left .. i+Lk-Lq+right (-1:
                               no bound)
        attention_chunk=C      only the keys j with j // C equal to
                               (i+Lk-Lq) // C (Llama 4's chunked layers)
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
    Lq, H, d) output.  Empty inputs (B, Lq or Lk zero) give zeros.
    Differentiable once (a second derivative raises).
    Differences from torch: see this module's docstring.
    """
    if isinstance(attn_mask, CausalBias) or is_causal:
        shapes = [getattr(t, "shape", ()) for t in (query, key)]
        if any(len(s) not in (3, 4) for s in shapes):
            raise ValueError("query and key must have 3 or 4 dimensions, "
                             "got shapes %s" % (shapes,))
        attn_mask, causal = _causal_of(attn_mask, is_causal, shapes[0][-2],
                                       shapes[1][-2])
    else:
        causal = 0
    extra = {n: x for n, x in (("key_lengths", key_lengths),
                               ("key_mask", key_mask), ("window", window),
                               ("softcap", softcap), ("sinks", sinks),
                               ("rope", rope), ("q_positions", q_positions),
                               ("k_positions", k_positions),
                               ("attention_chunk", attention_chunk))
             if x is not None}
    if alibi is not False:
        extra["alibi"] = alibi
    if isinstance(query, _T) and query.dtype in _HALF:
        return _sdpa_half(query, key, value, attn_mask, dropout_p, causal,
                          scale, enable_gqa, extra)
    if attn_mask is None and not dropout_p and not extra and \
            not torch.is_grad_enabled():
        out = _sdpa_plain(query, key, value, causal, scale, enable_gqa)
        if out is not None:
            return out
    return _sdpa(query, key, value, attn_mask, dropout_p, causal, scale,
                 enable_gqa, **extra)


def _sdpa(query, key, value, attn_mask, dropout_p, causal, scale, enable_gqa,
          key_lengths=None, key_mask=None, window=None, alibi=False,
          softcap=None, sinks=None, rope=None, q_positions=None,
          k_positions=None, attention_chunk=None, half=0):
    """The full call, every option: checks, then libmha's forward (an
    autograd node when something requires grad).  half: mha_dtype's
    value for bf16 / f16 q, k and v (0: float32)."""
    dt = query.dtype if half else torch.float32
    _check(query, "query", dtype=dt)
    _check(key, "key", dtype=dt)
    _check(value, "value", dtype=dt)
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
    dv = value.shape[3]   # may differ from d (Ev != E, as torch allows)
    if dv == 0:
        raise ValueError("value has head dim 0")
    if Hkv != H:
        if not enable_gqa:
            raise ValueError("key/value have %d heads, query %d: pass "
                             "enable_gqa=True for grouped-query attention"
                             % (Hkv, H))
        if Hkv == 0 or H % Hkv:
            raise ValueError("the number of query heads %d must be a "
                             "multiple of key/value heads %d" % (H, Hkv))
    if causal and attn_mask is not None:
        raise ValueError("is_causal and attn_mask are mutually exclusive "
                         "(as in torch)")
    if not 0.0 <= float(dropout_p) <= 1.0:
        raise ValueError("dropout_p must be in [0, 1], got %r" % dropout_p)
    am, amk = _sdpa_mask(attn_mask, B, H, Lq, Lk)
    kl = _key_lengths(key_lengths, B, Lk)
    km, kmk = _key_mask(key_mask, B, Lk)
    if sinks is not None:
        _check(sinks, "sinks", ndim=(1,))
        if sinks.shape[0] != H:
            raise ValueError("sinks must have shape (%d,), got %s"
                             % (H, tuple(sinks.shape)))
    if isinstance(alibi, torch.Tensor):
        alibi = _np(alibi.to(torch.float32))
    if 0 in (B, H, Lq, d, Lk):
        ins = (query, key, value) + (() if sinks is None else (sinks,))
        out = _Empty.apply((B, H, Lq, dv), *ins)
        return out[0] if unbatched else out
    p = float(dropout_p)
    kw = dict(batch=B, num_heads=H, head_dim=d, q_len=Lq, kv_len=Lk,
              num_kv_heads=Hkv, v_head_dim=0 if dv == d else dv,
              scale=None if scale is None else float(scale),
              attn_mask=am, attn_mask_kind=amk, key_padding_mask=km,
              key_padding_mask_kind=kmk, key_lengths=kl, causal=causal,
              dropout=p, training=p > 0, dropout_seed=_seed() if p > 0 else 0,
              num_threads=torch.get_num_threads(),
              modifiers=_mha._modifiers(H, rope, alibi, window, softcap,
                                        attention_chunk),
              q_positions=_mha._int64(q_positions, "q_positions"),
              k_positions=_mha._int64(k_positions, "k_positions"))
    if half:
        kw["dtype"] = half
    if torch.is_grad_enabled() and (
            query.requires_grad or key.requires_grad or value.requires_grad
            or (sinks is not None and sinks.requires_grad)):
        # (RoPE rotates copies in the rows layout: no heads-first there)
        out = _SDPA.apply(query, key, value, sinks, kw, rope is None)
    elif half:
        out = _half_full(query, key, value, sinks, kw, rope is not None)
    else:
        # nothing to differentiate: no autograd node, the same call
        out = _sdpa_forward(query, key, value, sinks, kw, rope is None)
    return out[0] if unbatched else out
