"""mha.nn: torch.nn.MultiheadAttention on libmha, a drop-in replacement.

    from mha.nn import MultiheadAttention   # instead of torch.nn's

The constructor, forward, parameter names (in_proj_weight or
q/k/v_proj_weight, in_proj_bias, bias_k, bias_v, out_proj.weight/bias) and
so state_dict() / load_state_dict() are torch's; autograd runs libmha's
backward (mha_backward) through a torch.autograd.Function.

Where it differs from torch:
  - float32 CPU tensors, or a module moved to bfloat16 / float16
    (module.to(dtype)) with inputs of that dtype: libmha's 16-bit forward
    and backward, no attention weights and no dropout in 16 bits (they
    raise NotImplementedError); anything else: TypeError / ValueError;
  - a query row with no key left to attend to gives out_proj.bias (zero
    context), not NaN, and zero gradients;
  - dropout (training mode) comes from libmha's counter-based hash keyed
    by a seed drawn from torch's default generator (torch.manual_seed
    makes it reproducible), so its masks differ from torch's;
  - is_causal without an attn_mask applies the causal mask (torch
    requires the mask as well); with one, the mask is used as given;
  - masks are constants: a float attn_mask gets no gradient;
  - _qkv_same_embed_dim is False, so that torch's TransformerEncoderLayer
    and TransformerEncoder call this module rather than their fused
    kernels (see the class); nested tensors are taken where torch's
    module takes them;
  - gradients are first order: a second backward through one
    (create_graph=True, then backward again) raises RuntimeError;
  - parameters must be finite (NaN or Inf raises mha.NonFiniteError,
    except written through .data, which gives NaN as torch would);
  - the parameters are views of the libmha module's memory from the first
    call on (no copies per call; see docs/semantics.md, "The Python
    package").
Importing this module imports torch; ``import mha`` alone does not (the
attribute ``mha.nn`` imports it on first use).
"""
from __future__ import annotations

import math
import operator
from typing import Optional, Tuple

import numpy as np
import torch
from torch import nn
from torch.autograd.function import once_differentiable

import mha as _mha
from mha import _core

from . import functional  # noqa: F401
from .functional import _check_tensor, _np

__all__ = ["MultiheadAttention", "functional"]


def _torch_mask(m, name, kind_bool):
    """torch's bool (True = blocked) or float mask -> (array, kind)."""
    if m is None:
        return None, 0
    if not isinstance(m, torch.Tensor):
        raise TypeError("%s must be a torch.Tensor or None" % name)
    if m.device.type != "cpu":
        raise ValueError("%s is on %s: mha runs on the CPU only"
                         % (name, m.device))
    if m.dtype == torch.bool:
        return _np(m), kind_bool
    if m.dtype.is_floating_point:
        return _np(m.to(torch.float32)), _mha.MASK_ADDITIVE
    raise TypeError("only bool and floating types of %s are supported, "
                    "got %s" % (name, m.dtype))


# The 16-bit dtypes a module may be moved to (module.to(dtype)), as
# libmha's dtype codes (MHA_DTYPE_BF16, MHA_DTYPE_F16).
_HALF = {torch.bfloat16: 3, torch.float16: 2}


def _check_param(name, p):
    if (p.dtype != torch.float32 and p.dtype not in _HALF) or \
            p.device.type != "cpu":
        raise TypeError("parameter %s must be a float32, bfloat16 or "
                        "float16 CPU tensor, got %s on %s"
                        % (name, p.dtype, p.device))


def _half_dtype(params):
    """The parameters' dtype when the module was moved to bfloat16 or
    float16 (every parameter in it), None for float32; a mix raises."""
    dts = {p.dtype for p in params}
    if not dts or dts == {torch.float32}:
        return None
    if len(dts) == 1 and next(iter(dts)) in _HALF:
        return next(iter(dts))
    raise TypeError("the module's parameters mix dtypes (%s): move it to "
                    "one with module.to(dtype)"
                    % ", ".join(sorted(str(d) for d in dts)))


def _bits(t):
    """A 16-bit tensor's elements as an int16 NumPy array (their bits)."""
    return t.contiguous().view(torch.int16).numpy()


def _run_forward(owner, kw, q, k, v, params):
    """libmha's forward on the (batch-first, float32) tensors: (out, w)
    as arrays, w None without need_weights."""
    core = owner._core_module()
    owner._sync(core, params)
    B, Lq = q.shape[0], q.shape[1]
    out = np.empty((B, Lq, owner.embed_dim), np.float32)
    w = None
    if kw["need_weights"]:
        lkt = core.total_keys(kw["kv_len"])
        w = np.empty((B, Lq, lkt) if kw["need_weights"] == 1
                     else (B, owner.num_heads, Lq, lkt), np.float32)
    _mha._run_module(core, query=_np(q), key=None if k is None else _np(k),
                     value=None if v is None else _np(v), out=out,
                     attn_weights=w, **kw)
    return out, w


class _MHAFunction(torch.autograd.Function):
    """Inputs: query, key, value (batch first, float32), then every
    parameter in libmha's (state_dict) order.  The parameters are views of
    the libmha module's memory (MultiheadAttention._link), so forward and
    backward compute with them as they are at each call."""

    @staticmethod
    def forward(ctx, owner, kw, q, k, v, *params):
        out, w = _run_forward(owner, kw, q, k, v, params)
        ctx.owner = owner
        ctx.kw = dict(kw, need_weights=0)
        ctx.save_for_backward(q, k, v, *params)
        ctx.n_in = (q is not None, k is not None, v is not None)
        if w is None:
            return torch.from_numpy(out), None
        wt = torch.from_numpy(w)
        ctx.mark_non_differentiable(wt)
        return torch.from_numpy(out), wt

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_w):
        # libmha's backward runs outside autograd and has no derivative of
        # its own: a second backward through it raises (once_differentiable)
        # instead of dropping that term silently
        q, k, v, *params = ctx.saved_tensors
        nones = [None] * (2 + 3 + len(params))
        if grad_out is None:
            return tuple(nones)
        owner = ctx.owner
        core = owner._core_module()
        owner._sync(core, params)
        need = ctx.needs_input_grad
        gq = np.empty(q.shape, np.float32) if need[2] else None
        gk = (np.empty(k.shape, np.float32)
              if k is not None and need[3] else None)
        gv = np.empty(v.shape, np.float32) if v is not None and need[4] \
            else None
        gp = (np.empty(core.param_numel(), np.float32)
              if any(need[5:]) else None)
        _mha._run_module(
            core, query=_np(q), key=None if k is None else _np(k),
            value=None if v is None else _np(v), out=None,
            grad_out=_np(grad_out.to(torch.float32)), grad_query=gq,
            grad_key=gk, grad_value=gv, grad_params=gp,
            **dict(ctx.kw, num_threads=torch.get_num_threads()))
        res = [None, None,
               None if gq is None else torch.from_numpy(gq),
               None if gk is None else torch.from_numpy(gk),
               None if gv is None else torch.from_numpy(gv)]
        for (name, shape, numel, off), p in zip(core.params(), params):
            res.append(None if gp is None else
                       torch.from_numpy(gp[off:off + numel].reshape(shape)))
        return tuple(res)


def _run_half(owner, dt, kw, q, k, v, params):
    """libmha's 16-bit forward on the bits of the (batch-first) inputs: the
    output tensor, of dtype dt."""
    core = owner._core_module()
    owner._sync_half(core, params)
    out = torch.empty(kw["batch"], kw["q_len"], owner.embed_dim, dtype=dt)
    _mha._run_module(core, query=_bits(q),
                     key=None if k is None else _bits(k),
                     value=None if v is None else _bits(v),
                     out=out.view(torch.int16).numpy(), attn_weights=None,
                     dtype=_HALF[dt], **kw)
    return out


class _MHAHalfFunction(torch.autograd.Function):
    """A module moved to bfloat16 or float16: inputs query, key, value
    (batch first, dtype dt), then every parameter (dt) in libmha's order,
    widened into the libmha module (_sync_half) before each call.  The
    backward (mha_backward on 16-bit data) returns 16-bit gradients of the
    inputs, and the parameters' float32 sums rounded to dt once, here."""

    @staticmethod
    def forward(ctx, owner, dt, kw, q, k, v, *params):
        ctx.owner, ctx.dt, ctx.kw = owner, dt, kw
        ctx.save_for_backward(q, k, v, *params)
        return _run_half(owner, dt, kw, q, k, v, params)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, *params = ctx.saved_tensors
        nones = [None] * (3 + 3 + len(params))
        if grad_out is None:
            return tuple(nones)
        owner, dt = ctx.owner, ctx.dt
        core = owner._core_module()
        owner._sync_half(core, params)
        need = ctx.needs_input_grad
        gq = torch.empty(q.shape, dtype=dt) if need[3] else None
        gk = (torch.empty(k.shape, dtype=dt)
              if k is not None and need[4] else None)
        gv = (torch.empty(v.shape, dtype=dt)
              if v is not None and need[5] else None)
        gp = (np.empty(core.param_numel(), np.float32)
              if any(need[6:]) else None)

        def bits(t):
            return None if t is None else t.view(torch.int16).numpy()

        _mha._run_module(
            core, query=_bits(q), key=None if k is None else _bits(k),
            value=None if v is None else _bits(v), out=None,
            grad_out=_bits(grad_out.to(dt)), grad_query=bits(gq),
            grad_key=bits(gk), grad_value=bits(gv), grad_params=gp,
            dtype=_HALF[dt],
            **dict(ctx.kw, num_threads=torch.get_num_threads()))
        res = [None, None, None, gq, gk, gv]
        for (name, shape, numel, off), p in zip(core.params(), params):
            res.append(None if gp is None else torch.from_numpy(
                gp[off:off + numel].reshape(shape)).to(p.dtype))
        return tuple(res)


class MultiheadAttention(nn.Module):
    """torch.nn.MultiheadAttention computed by libmha (float32, CPU).

    MultiheadAttention(embed_dim, num_heads, dropout=0.0, bias=True,
                       add_bias_kv=False, add_zero_attn=False, kdim=None,
                       vdim=None, batch_first=False, device=None,
                       dtype=None, *, v_head_dim=None)

    Parameters and their initialisation are torch's, drawn from torch's
    generator in torch's order: after torch.manual_seed(s) this module
    and torch's hold the same values.  See the module docstring for the
    differences from torch.

    v_head_dim (libmha's own, keyword only): the values' head width when
    it is not embed_dim / num_heads, as in DeepSeek's MLA (values of 128
    beside queries and keys of 192): v_proj_weight is then
    (num_heads * v_head_dim, vdim), in_proj_bias 2 embed_dim + num_heads
    * v_head_dim long, out_proj a Linear(num_heads * v_head_dim,
    embed_dim), bias_v (1, 1, num_heads * v_head_dim); torch's module
    has no such option (its state_dict cannot hold such a module).
    """

    __constants__ = ["batch_first"]

    # torch's TransformerEncoderLayer.forward in eval mode without grad
    # (and TransformerEncoder.__init__, choosing its nested-tensor path)
    # take their fast path when self_attn._qkv_same_embed_dim is True: they
    # read in_proj_weight themselves into torch's fused kernel (after
    # self_attn.merge_masks, which this module has not), never calling
    # self_attn.  In torch this private flag says "the fused projection
    # layout a fused kernel may read"; False here makes both decline, so
    # that libmha computes the attention.  Whether this module's
    # projections are fused is `in_proj_weight is not None`.
    _qkv_same_embed_dim = False

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0,
                 bias: bool = True, add_bias_kv: bool = False,
                 add_zero_attn: bool = False, kdim: Optional[int] = None,
                 vdim: Optional[int] = None, batch_first: bool = False,
                 device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None, *,
                 v_head_dim: Optional[int] = None) -> None:
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError("embed_dim and num_heads must be greater than "
                             "0, got embed_dim=%s and num_heads=%s instead"
                             % (embed_dim, num_heads))
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError("mha.nn.MultiheadAttention runs on the CPU "
                             "only, got device=%s" % (device,))
        if dtype is not None and dtype != torch.float32:
            raise TypeError("mha.nn.MultiheadAttention is float32 only, got "
                            "dtype=%s" % (dtype,))
        # (torch takes kdim=0, a key projected from nothing; libmha's kdim 0
        # means "embed_dim", so a width below 1 is refused here)
        for name, width in (("kdim", kdim), ("vdim", vdim),
                            ("v_head_dim", v_head_dim)):
            if width is None:
                continue
            try:
                width = operator.index(width)
            except TypeError:
                raise TypeError("%s must be an integer or None, got %r"
                                % (name, width)) from None
            if width < 1:
                raise ValueError("%s must be >= 1 (or None: embed_dim), got "
                                 "%d" % (name, width))
        super().__init__()
        fk = {"device": "cpu", "dtype": torch.float32}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        if self.head_dim * num_heads != embed_dim:
            raise ValueError("embed_dim must be divisible by num_heads")
        self.v_head_dim = (self.head_dim if v_head_dim is None
                           else operator.index(v_head_dim))
        Dv = num_heads * self.v_head_dim   # the values' heads side by side
        fused = (self.kdim == embed_dim and self.vdim == embed_dim and
                 Dv == embed_dim)
        if not fused:
            self.q_proj_weight = nn.Parameter(
                torch.empty((embed_dim, embed_dim), **fk))
            self.k_proj_weight = nn.Parameter(
                torch.empty((embed_dim, self.kdim), **fk))
            self.v_proj_weight = nn.Parameter(
                torch.empty((Dv, self.vdim), **fk))
            self.register_parameter("in_proj_weight", None)
        else:
            self.in_proj_weight = nn.Parameter(
                torch.empty((3 * embed_dim, embed_dim), **fk))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(
                torch.empty(2 * embed_dim + Dv, **fk))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(Dv, embed_dim, bias=bias, **fk)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty((1, 1, embed_dim), **fk))
            self.bias_v = nn.Parameter(torch.empty((1, 1, Dv), **fk))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self._core = self._core_key = None
        self._paths = self._ptrs = self._stamp = None
        self._reset_parameters()

    def _reset_parameters(self):
        if self.in_proj_weight is not None:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
        if self.bias_v is not None:
            nn.init.xavier_normal_(self.bias_v)

    # -- the libmha module behind it --
    def _core_module(self):
        """The libmha module, made at the first call (and again when
        dropout or add_zero_attn change), its parameters then linked."""
        key = (float(self.dropout), bool(self.add_zero_attn))
        if self._core is None or self._core_key != key:
            core = _core.module_create(
                embed_dim=self.embed_dim, num_heads=self.num_heads,
                kdim=self.kdim, vdim=self.vdim,
                v_head_dim=(0 if self.v_head_dim == self.head_dim
                            else self.v_head_dim),
                bias=self.in_proj_bias is not None,
                add_bias_kv=self.bias_k is not None,
                add_zero_attn=bool(self.add_zero_attn),
                dropout=float(self.dropout))
            self._paths = [tuple(name.rsplit(".", 1)) if "." in name
                           else ("", name) for name, *_ in core.params()]
            self._link(core)
            self._core, self._core_key = core, key
        return self._core

    def _param_list(self):
        """The parameters in libmha's order (= torch's state_dict order)."""
        self._core_module()
        own, mods = self._parameters, self._modules
        return [(mods[m]._parameters if m else own)[n]
                for m, n in self._paths]

    def _link(self, core):
        """Makes every parameter a view of the libmha module's parameter
        memory (mha_param_data, exported as a buffer), its values copied in
        once: from then on forward and backward read the parameters where
        they are, and every in-place change (optimizer steps,
        load_state_dict, writes through .data) is what libmha computes
        with, with no copy per call.  A parameter later replaced by
        another tensor is copied in on each call instead (_sync)."""
        buf = np.frombuffer(core, dtype=np.float32)
        ptrs = []
        params = [(getattr(self, m) if m else self)._parameters[n]
                  for m, n in self._paths]
        # (the first call may come under torch.inference_mode(), as
        # sentence-transformers' encode runs: the views must be ordinary
        # tensors, or the parameters could not change in place later)
        with torch.inference_mode(False):
            for (name, shape, numel, off), p in zip(core.params(), params):
                _check_param(name, p)
                if p.dtype in _HALF:   # copied in by _sync_half, widened
                    ptrs.append(-1)
                    continue
                core.param_set(name, _np(p))       # refuses NaN / Inf
                p.data = torch.from_numpy(
                    buf[off:off + numel].reshape(shape))
                ptrs.append(p.data_ptr())
        self._ptrs = ptrs
        self._stamp = tuple(p._version for p in params)
        self._watch(core)

    def _watch(self, core):
        """Tells C (forward_fast) where the parameters are and the data
        pointers and versions that let a call skip _sync."""
        core.watch(self, tuple((m or None, n) for m, n in self._paths),
                   tuple(self._ptrs), self._stamp)

    def _sync(self, core, params):
        """Before a call: a parameter that is no longer the linked view is
        copied in (with mha_param_set's checks); the linked ones, if any
        changed in place since the last check (a version counter moved),
        are checked for NaN / Inf."""
        moved = [i for i, (p, ptr) in enumerate(zip(params, self._ptrs))
                 if p.data_ptr() != ptr]
        if moved:
            info = core.params()
            for i in moved:
                _check_param(info[i][0], params[i])
                core.param_set(info[i][0], _np(params[i]))
        stamp = tuple(p._version for p in params)
        if stamp != self._stamp:
            core.check_finite()
            self._stamp = stamp
            self._watch(core)

    def _sync_half(self, core, params):
        """Before a 16-bit call: the parameters (bf16 or f16) widened into
        the libmha module's float32 memory, exactly, when any of them is
        another tensor or changed in place since the last copy; libmha
        rounds them back to the dtype (the same values)."""
        stamp = tuple((p.data_ptr(), p._version, p.dtype) for p in params)
        if stamp != getattr(self, "_half_stamp", None):
            for (name, *_), p in zip(core.params(), params):
                core.param_set(name, _np(p.detach().to(torch.float32)))
            self._half_stamp = stamp
            # no float32 view is linked now: a float32 call copies in
            self._ptrs = [-1] * len(params)
            self._stamp = tuple(p._version for p in params)
            self._watch(core)

    def _forward_half(self, dt, kw, ins, params):
        """forward on a module moved to bfloat16 or float16: libmha's
        16-bit forward (forward16.c: projections and attention on 16-bit
        data, float32 sums) on the bits of the inputs, the output in the
        same dtype; with autograd, its backward (backward16.c).  No
        weights and no dropout yet."""
        for t, n in zip(ins, ("query", "key", "value")):
            if t is not None and t.dtype != dt:
                raise TypeError("%s is %s but the module's parameters are "
                                "%s" % (n, t.dtype, dt))
        if kw["need_weights"]:
            raise NotImplementedError(
                "a %s mha.nn.MultiheadAttention returns no attention weights "
                "yet: call it with need_weights=False (or in float32)" % dt)
        if kw["training"]:
            raise NotImplementedError(
                "a %s mha.nn.MultiheadAttention has no dropout yet: eval() "
                "or dropout=0 (or float32)" % dt)
        if torch.is_grad_enabled() and (
                any(t is not None and t.requires_grad for t in ins) or
                any(p.requires_grad for p in params)):
            return _MHAHalfFunction.apply(self, dt, kw, *ins, *params)
        return _run_half(self, dt, kw, *ins, params)

    def __getstate__(self):
        state = self.__dict__.copy()
        for k in ("_core", "_core_key", "_paths", "_ptrs", "_stamp",
                  "_half_stamp"):
            state[k] = None
        return state

    def __setstate__(self, state):
        # an instance's own _qkv_same_embed_dim (pickled by an earlier
        # mha.nn) would hide the class's False (see the class): dropped
        state.pop("_qkv_same_embed_dim", None)
        # (pickled before v_head_dim existed: the values were d_h wide)
        state.setdefault("v_head_dim", state.get("head_dim"))
        self.__dict__.update(state)

    def extra_repr(self) -> str:
        return "embed_dim=%d, num_heads=%d, dropout=%s, batch_first=%s" % (
            self.embed_dim, self.num_heads, self.dropout, self.batch_first)

    def _forward_no_grad(self, query, key, value, is_causal):
        """forward's short way, for the common inference call (no grad, no
        masks, no weights, no dropout, float32 CPU tensors of the right
        shapes): NumPy views of the tensors straight to C, which checks the
        shapes and the watched parameters (watch_ok in mha_core.c) and
        answers NotImplemented for anything else.  None then: forward's
        checks run (and raise) as always."""
        if self.training and self.dropout > 0:
            return None
        core = self._core
        if core is None or self._core_key != (self.dropout,
                                              self.add_zero_attn):
            core = self._core_module()
        for t in (query, key, value):
            if type(t) is not torch.Tensor:
                return None
        try:                                # .numpy(): CPU, no grad, strided
            if self.batch_first:
                q = query.numpy()
                k = None if key is query else key.numpy()
                v = None if value is key else value.numpy()
            else:
                q = query.transpose(0, 1).contiguous().numpy()
                k = None if key is query else \
                    key.transpose(0, 1).contiguous().numpy()
                v = None if value is key else \
                    value.transpose(0, 1).contiguous().numpy()
        except (RuntimeError, TypeError):
            return None
        out = np.empty_like(q)
        if core.forward_fast(q, k, v, out, 2 if is_causal else 0,
                             torch.get_num_threads()) is not True:
            return None
        out = torch.from_numpy(out)
        return out if self.batch_first else out.transpose(0, 1)

    def _forward_nested(self, query, key, value, key_padding_mask,
                        need_weights, attn_mask, average_attn_weights,
                        is_causal):
        """forward on nested tensors (batch first, one sequence each), as
        torch's TransformerEncoder gives its layers in eval mode with a
        src_key_padding_mask when it was built around torch's module (its
        use_nested_tensor is decided in its __init__): the sequences padded
        into one batch, the padding blocked as keys, the output nested
        again; the weights are the padded batch's, as torch's.  Like
        torch's module, only where nothing needs a gradient and with no
        other mask."""
        if not (query.is_nested and key.is_nested and value.is_nested):
            raise ValueError("query, key and value must be all nested "
                             "tensors or none of them")
        if not self.batch_first:
            raise ValueError("nested tensors need batch_first=True (a "
                             "nested tensor is a batch of sequences)")
        if attn_mask is not None or key_padding_mask is not None:
            raise ValueError("nested tensors take no attn_mask or "
                             "key_padding_mask: the nesting is the padding")
        if torch.is_grad_enabled() and (
                any(t.requires_grad for t in (query, key, value)) or
                any(p.requires_grad for p in self.parameters())):
            raise ValueError("nested tensors are taken without autograd "
                             "only (under torch.no_grad(), as torch's "
                             "module takes them)")
        k_len = [t.shape[0] for t in key.unbind()]
        if [t.shape[0] for t in value.unbind()] != k_len:
            raise ValueError("the key's and the value's sequences must have "
                             "the same lengths")
        q = query.to_padded_tensor(0.0)
        k = q if key is query else key.to_padded_tensor(0.0)
        v = k if value is key else value.to_padded_tensor(0.0)
        pad = torch.arange(k.shape[1]) >= torch.tensor(k_len)[:, None]
        out, w = MultiheadAttention.forward(
            self, q, k, v, key_padding_mask=pad, need_weights=need_weights,
            average_attn_weights=average_attn_weights, is_causal=is_causal)
        return torch.nested.as_nested_tensor(
            [o[:t.shape[0]] for o, t in zip(out, query.unbind())]), w

    def forward(self, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor,
                key_padding_mask: Optional[torch.Tensor] = None,
                need_weights: bool = True,
                attn_mask: Optional[torch.Tensor] = None,
                average_attn_weights: bool = True, is_causal: bool = False
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """torch.nn.MultiheadAttention.forward: query (L, N, E) (or (N, L,
        E) with batch_first, or unbatched (L, E)), key (S, N, kdim), value
        (S, N, vdim); key_padding_mask (N, S) (bool True = padding, or
        float added); attn_mask (L, S) or (N*num_heads, L, S) (bool True =
        NOT allowed, or float added).  Returns (attn_output, weights):
        weights (N, L, S) averaged over heads, (N, num_heads, L, S) with
        average_attn_weights=False, or None without need_weights."""
        if not need_weights and attn_mask is None and \
                key_padding_mask is None and not torch.is_grad_enabled():
            out = self._forward_no_grad(query, key, value, is_causal)
            if out is not None:
                return out, None
        half = _half_dtype(list(self.parameters()))
        for t, n in ((query, "query"), (key, "key"), (value, "value")):
            if half is None or not isinstance(t, torch.Tensor):
                _check_tensor(t, n)
            elif t.device.type != "cpu" or t.dtype != half:
                raise TypeError("%s must be a %s CPU tensor (the module's "
                                "dtype), got %s on %s"
                                % (n, half, t.dtype, t.device))
        if query.is_nested or key.is_nested or value.is_nested:
            return self._forward_nested(query, key, value, key_padding_mask,
                                        need_weights, attn_mask,
                                        average_attn_weights, is_causal)
        batched = query.dim() == 3
        if query.dim() not in (2, 3) or key.dim() != query.dim() or \
                value.dim() != query.dim():
            raise ValueError("query, key and value must all be 3-D (batched) "
                             "or 2-D (unbatched), got %s, %s, %s"
                             % (tuple(query.shape), tuple(key.shape),
                                tuple(value.shape)))
        same_kv = key is value
        self_attn = same_kv and query is key
        if not batched:
            q, k, v = query[None], key[None], value[None]
        elif self.batch_first:
            q, k, v = query, key, value
        else:
            q, k, v = (query.transpose(0, 1), key.transpose(0, 1),
                       value.transpose(0, 1))
        B, Lq, E = q.shape
        if E != self.embed_dim:
            raise ValueError("was expecting embedding dimension of %d, but "
                             "got %d" % (self.embed_dim, E))
        Lk = k.shape[1]
        if k.shape[0] != B or v.shape[0] != B or v.shape[1] != Lk:
            raise ValueError("key %s and value %s do not match query %s"
                             % (tuple(key.shape), tuple(value.shape),
                                tuple(query.shape)))
        if k.shape[2] != self.kdim or v.shape[2] != self.vdim:
            raise ValueError("key and value must have last dimensions kdim "
                             "%d and vdim %d, got %d and %d"
                             % (self.kdim, self.vdim, k.shape[2],
                                v.shape[2]))
        am, amk = _torch_mask(attn_mask, "attn_mask", _mha.MASK_BLOCK)
        if am is not None:
            H = self.num_heads
            if am.ndim == 3:
                if am.shape[0] != (B if batched else 1) * H:
                    raise ValueError(
                        "the shape of the 3D attn_mask is %s, but should be "
                        "%s" % (am.shape, ((B if batched else 1) * H, Lq,
                                           Lk)))
                am = am.reshape(B, H, am.shape[1], am.shape[2])
            elif am.ndim != 2:
                raise ValueError("attn_mask's dimension %d is not supported"
                                 % am.ndim)
            if am.shape[-2:] != (Lq, Lk):
                raise ValueError("attn_mask has shape %s, expected (%d, %d) "
                                 "in its last two dimensions"
                                 % (am.shape, Lq, Lk))
        kpm, kpmk = _torch_mask(key_padding_mask, "key_padding_mask",
                                _mha.MASK_BLOCK)
        if kpm is not None:
            want = (B, Lk) if batched else (Lk,)
            if kpm.shape != want:
                raise ValueError("expected key_padding_mask of shape %s, got "
                                 "%s" % (want, kpm.shape))
        causal = 2 if is_causal and am is None else 0
        training = self.training and self.dropout > 0
        # libmha's threads are torch's intra-op count, read at every call:
        # the kept plan is per (shape, thread count), so a later
        # torch.set_num_threads takes effect at the next call
        kw = dict(batch=B, q_len=Lq, kv_len=Lk, attn_mask=am,
                  attn_mask_kind=amk, key_padding_mask=kpm,
                  key_padding_mask_kind=kpmk, causal=causal,
                  need_weights=(0 if not need_weights else
                                1 if average_attn_weights else 2),
                  training=training,
                  dropout_seed=(int(torch.randint(0, 2 ** 62, (1,)).item())
                                if training else 0),
                  num_threads=torch.get_num_threads())
        if self_attn:
            ins = (q, None, None)
        elif same_kv:
            ins = (q, k, None)
        else:
            ins = (q, k, v)
        params = self._param_list()
        half = _half_dtype(params)
        if half is not None:
            out, w = self._forward_half(half, kw, ins, params), None
        elif torch.is_grad_enabled() and (
                any(t is not None and t.requires_grad for t in ins) or
                any(p.requires_grad for p in params)):
            out, w = _MHAFunction.apply(self, kw, *ins, *params)
        else:
            # nothing to differentiate: no autograd node, the same call
            out, w = _run_forward(self, kw, *ins, params)
            out = torch.from_numpy(out)
            w = None if w is None else torch.from_numpy(w)
        if not batched:
            out = out[0]
            w = None if w is None else w[0]
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, w
