"""mha: multi-head attention on libmha, from NumPy (this module) and from
PyTorch (``mha.nn``, ``mha.nn.functional``: imported on first use, so that
``import mha`` alone does not import torch).

The NumPy level follows the C API (include/mha.h) closely:

    Module        mha_module: create, load/save safetensors, parameters by
                  PyTorch's names, forward, backward
    attention     mha_attention on heads already projected, (B, L, H*d_h);
    attention_backward                          and its backward
    KVCache       mha_kv_cache: create, append, truncate, reset, read
    allow, block, additive
                  the three mask kinds: a bool mask must say its kind
                  (``block(m)``: True = blocked, PyTorch MHA's polarity;
                  ``allow(m)``: True = may attend, SDPA's); a float32
                  array is additive

Arrays.  Inputs must be float32 (masks: bool; lengths and positions:
int64); any other dtype raises TypeError rather than being converted
silently; the one exception is 16-bit data: float16 (or ml_dtypes'
bfloat16) inputs, all of one dtype, run libmha's 16-bit attention or
module (``attention`` and its backward, ``Module.forward`` and its
backward), results in that dtype.  C-contiguous arrays are read in
place, never copied; a non-contiguous array is copied once
(numpy.ascontiguousarray).  Outputs are new float32 arrays (16-bit
ones for 16-bit inputs).  Unbatched inputs (L, E) are batch 1 and give
unbatched outputs.  Empty problems are taken as torch takes them: batch 0
or a query of 0 rows gives empty outputs (and zero gradients for the
rest), a key of 0 rows leaves every query row with no key.

Errors.  Every libmha failure raises a subclass of ``MhaError`` (also a
ValueError, OSError, ... as fits) with libmha's own message; wrong types
raise TypeError, wrong shapes ValueError, before libmha is called.

Semantics are libmha's (docs/semantics.md): a query row with no key to
attend to gives a zero context (its output is out_proj.bias), never NaN;
dropout comes from a counter-based hash keyed by (seed, b, h, i, j).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

from . import _core
from ._errors import (BY_STATUS, ConfigError, FormatError,  # noqa: F401
                      InvalidArgumentError, MhaError, MhaIOError,
                      MhaMemoryError, MhaNullPointerError, MhaOverflowError,
                      NonFiniteError, NotFoundError, ShapeError,
                      UnsupportedError, CommError)

_core._set_errors(BY_STATUS)


def __getattr__(name):
    """``mha.nn`` (and so ``mha.nn.functional``) on first use (PEP 562):
    the drop-ins import torch, which ``import mha`` alone must not."""
    if name == "nn":
        import importlib
        return importlib.import_module(".nn", __name__)
    raise AttributeError("module 'mha' has no attribute %r" % name)


def __dir__():
    return sorted(set(globals()) | {"nn"})


__version__ = _core.version()
__all__ = ["Module", "KVCache", "PagedKVCache", "attention",
           "attention_ragged", "attention_backward", "allow",
           "block", "additive", "alibi_slopes", "rope_apply", "MhaError",
           "kernel_tier", "gemm_backend", "dropout_keep"]

# mha_mask_kind, mha_causal, mha_weights_mode, mha_rope_style, mha_kv_dtype
MASK_NONE, MASK_ALLOW, MASK_BLOCK, MASK_ADDITIVE = 0, 1, 2, 3
_CAUSAL = {None: 0, False: 0, "none": 0, "bottom_right": 1, "top_left": 2}
_WEIGHTS = {None: 0, False: 0, "none": 0, True: 1, "average": 1,
            "per_head": 2}
_ROPE = {None: 0, "none": 0, "neox": 1, "gptj": 2}
_KV_DTYPE = {"f32": 0, "f16": 1, "bf16": 2, "q8": 3, "q4": 4}
_PROJ = {"query": 0, "key": 1, "value": 2, "out": 3}


# Type hints (annotations only, never evaluated at run time): what the
# public calls take.  A mask is an additive float32 array or a typed bool
# one (allow / block); rope, alibi and window as Module's docstring says.
_MaskArg = Union[npt.ArrayLike, "_Mask", None]
_Causal = Optional[str]
_Rope = Union[str, Dict[str, Any], None]
_Alibi = Union[bool, npt.ArrayLike, None]
_Window = Optional[Tuple[int, int]]
_Path = Union[str, "os.PathLike[str]"]


# ---- arrays ------------------------------------------------------------------

def _array(x, name, dtype=np.float32, required=True):
    """x as a C-contiguous array of dtype (copied only if not contiguous)."""
    if x is None:
        if required:
            raise TypeError("%s is required, got None" % name)
        return None
    if not isinstance(x, np.ndarray):
        if hasattr(x, "__array__") or isinstance(x, (list, tuple)):
            x = np.asarray(x)
        else:
            raise TypeError("%s must be a numpy array, not %s"
                            % (name, type(x).__name__))
    want = np.dtype(dtype)
    if x.dtype != want:
        raise TypeError("%s must have dtype %s, got %s"
                        % (name, want.name, x.dtype.name))
    if not x.flags.c_contiguous:
        x = np.ascontiguousarray(x)
    return x


def _int64(x, name):
    if x is None:
        return None
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError("%s must hold integers, got %s" % (name, a.dtype.name))
    return np.ascontiguousarray(a, dtype=np.int64)


class _Mask:
    __slots__ = ("kind", "data")

    def __init__(self, kind, data):
        self.kind = kind
        self.data = data

    def __repr__(self):
        return "mha.%s(shape=%s)" % (
            {1: "allow", 2: "block", 3: "additive"}[self.kind],
            self.data.shape)


def allow(mask: npt.ArrayLike) -> _Mask:
    """A bool mask whose True means "may attend" (MHA_MASK_ALLOW; the
    polarity of torch's scaled_dot_product_attention)."""
    return _Mask(MASK_ALLOW, _array(mask, "allow mask", np.bool_))


def block(mask: npt.ArrayLike) -> _Mask:
    """A bool mask whose True means "blocked" (MHA_MASK_BLOCK; the polarity
    of torch.nn.MultiheadAttention's attn_mask and key_padding_mask)."""
    return _Mask(MASK_BLOCK, _array(mask, "block mask", np.bool_))


def additive(mask: npt.ArrayLike) -> _Mask:
    """A float32 mask added to the scaled scores; -inf blocks
    (MHA_MASK_ADDITIVE).  NaN and +inf are refused."""
    return _Mask(MASK_ADDITIVE, _array(mask, "additive mask"))


def _mask(m, name):
    """(array, kind) for the C layer."""
    if m is None:
        return None, 0
    if isinstance(m, _Mask):
        return m.data, m.kind
    a = m if isinstance(m, np.ndarray) else np.asarray(m)
    if a.dtype == np.bool_:
        raise TypeError("%s is a bool mask: say its kind, mha.allow(mask) "
                        "(True = may attend) or mha.block(mask) (True = "
                        "blocked)" % name)
    return _array(a, name), MASK_ADDITIVE


def _key(d, table, name):
    try:
        return table[d]
    except (KeyError, TypeError):
        raise ValueError("%s must be one of %s, got %r"
                         % (name, sorted(k for k in table
                                         if isinstance(k, str)), d)) from None


def _modifiers(num_heads, rope=None, alibi=False, window=None, softcap=None,
               attention_chunk=None):
    """The tuple of mha_modifiers (and attention_chunk, beside them in C)
    the C layer reads, or None."""
    if rope is None and alibi is False and window is None and not softcap \
            and attention_chunk is None:
        return None
    slopes = None
    if alibi is None or alibi is False:
        alibi_on = 0
    elif alibi is True:
        alibi_on = 1
    else:
        alibi_on = 1
        if isinstance(alibi, (list, tuple)):   # Python numbers: float32
            alibi = np.asarray(alibi, np.float32)
        slopes = _array(alibi, "alibi slopes")
        if slopes.shape != (num_heads,):
            raise ValueError("alibi slopes must have shape (%d,), got %s"
                             % (num_heads, slopes.shape))
    win, left, right = 0, 0, 0
    if window is not None:
        try:
            left, right = (int(w) for w in window)
        except (TypeError, ValueError):
            raise TypeError("window must be (left, right), -1 for no bound, "
                            "got %r" % (window,)) from None
        win = 1
    style, dims, theta, rscale = 0, 0, 0.0, 0.0
    if rope is not None:
        if isinstance(rope, str):
            rope = {"style": rope}
        if not isinstance(rope, dict):
            raise TypeError("rope must be 'neox', 'gptj' or a dict(style=, "
                            "dims=, theta=, scale=), got %r" % (rope,))
        unknown = set(rope) - {"style", "dims", "theta", "scale"}
        if unknown:
            raise TypeError("rope: unknown keys %s" % sorted(unknown))
        style = _key(rope.get("style", "neox"), _ROPE, "rope style")
        dims = int(rope.get("dims", 0))
        theta = float(rope.get("theta", 0.0))
        rscale = float(rope.get("scale", 0.0))
    return (float(softcap or 0.0), alibi_on, slopes, win, left, right, style,
            dims, theta, rscale, int(attention_chunk or 0))


def _mods_kwargs(d, num_heads):
    """mha_modifiers as a dict (from the C layer) -> Module kwargs."""
    out = {}
    if d["softcap"]:
        out["softcap"] = d["softcap"]
    if d["alibi"]:
        out["alibi"] = (np.array(d["alibi_slopes"], np.float32)
                        if d["alibi_slopes"] is not None else True)
    if d["window"]:
        out["window"] = (d["window_left"], d["window_right"])
    if d["rope_style"]:
        out["rope"] = {"style": {1: "neox", 2: "gptj"}[d["rope_style"]],
                       "dims": d["rope_dims"], "theta": d["rope_theta"],
                       "scale": d["rope_scale"]}
    return out


def _batched(x, name, ndim=3):
    """(array as (B, L, W), was_unbatched)."""
    if x.ndim == ndim - 1:
        return x.reshape((1,) + x.shape), True
    if x.ndim != ndim:
        raise ValueError("%s must have %d dimensions (or %d unbatched), got "
                         "shape %s" % (name, ndim, ndim - 1, x.shape))
    return x, False


# ---- empty problems ----------------------------------------------------------
#
# libmha takes batch >= 1 and q_len >= 1, and its kv_len 0 means "as many
# keys as queries" (self-attention), never "no key".  So the empty
# problems are answered here, before the C layer:
#   - batch 0 or q_len 0: no output row, nothing to compute: the outputs
#     are empty, and the gradients of the key, value, parameters, head mask
#     and sinks are zero (no output depends on them), as torch's are;
#   - a key of 0 rows: every query row has no key, libmha's "row with no
#     key" (a zero context: the module's output is out_proj.bias), so the
#     call runs with one zero key row that key_lengths 0 blocks; bias_k and
#     the zero key of add_bias_kv / add_zero_attn, never masked, are
#     attended as with any key.  That row's weight column and gradients
#     are dropped.
# Their arguments are checked here as the C layer would check them.

def _check_empty_args(B, H, Lq, Lk, attn_mask=None, key_padding_mask=None,
                      key_lengths=None, cache=None, counts=(), **_):
    """The checks of an empty problem's arguments: the masks' shapes, the
    key lengths' values, and counts = ((name, array, elements), ...)."""
    am = attn_mask
    if am is not None and (
            not 2 <= am.ndim <= 4 or am.shape[-2:] != (Lq, Lk) or
            (am.ndim >= 3 and am.shape[0] not in (1, B)) or
            (am.ndim == 4 and am.shape[1] not in (1, H))):
        raise ValueError("attn_mask has shape %s, expected (Lq, Lk) = (%d, "
                         "%d), (B, Lq, Lk) or (B, H, Lq, Lk) with B = %d "
                         "(or 1) and H = %d (or 1)"
                         % (am.shape, Lq, Lk, B, H))
    kpm = key_padding_mask
    if kpm is not None and (
            not 1 <= kpm.ndim <= 2 or kpm.shape[-1] != Lk or
            (kpm.ndim == 2 and kpm.shape[0] not in (1, B))):
        raise ValueError("key_padding_mask has shape %s, expected (Lk) = "
                         "(%d,) or (B, Lk) with B = %d (or 1)"
                         % (kpm.shape, Lk, B))
    if key_lengths is not None:
        if key_lengths.size != B:
            raise ValueError("key_lengths has %d elements, expected batch %d"
                             % (key_lengths.size, B))
        if np.any((key_lengths < 0) | (key_lengths > Lk)):
            raise ValueError("key_lengths must be within 0 .. %d (the key's "
                             "rows), got %s" % (Lk, key_lengths.tolist()))
    if cache is not None and cache.config()["batch"] != B:
        raise ValueError("the cache holds %d sequences, the query %d"
                         % (cache.config()["batch"], B))
    for name, x, n in counts:
        if x is not None and x.size != n:
            raise ValueError("%s has %d elements, expected %d"
                             % (name, x.size, n))


def _one_blocked_key(a, names):
    """A copy of the arguments ``a`` with a key of 0 rows replaced by one
    zero row that key_lengths 0 blocks (names: the key, value and key
    positions entries of ``a``), the masks over no key dropped."""
    b = dict(a, kv_len=1, attn_mask=None, attn_mask_kind=0,
             key_padding_mask=None, key_padding_mask_kind=0,
             key_lengths=np.zeros(a["batch"], np.int64))
    for name in names:
        x = a.get(name)
        if x is not None:
            b[name] = np.zeros((a["batch"], 1) + x.shape[2:], x.dtype)
    return b


def _run_empty(run, a, key, value, grads, zero_grads):
    """run(**a) for an empty problem (see above): ``key`` and ``value`` name
    a's key and value entries, ``grads`` their gradient buffers,
    ``zero_grads`` the other gradients that an empty batch zeroes."""
    if not (a["batch"] and a["q_len"]):
        for name in grads + zero_grads:
            if a.get(name) is not None and not (
                    name in zero_grads and a.get("accumulate")):
                a[name][...] = 0
        return
    b = _one_blocked_key(a, (key, value, "k_positions"))
    w = a.get("attn_weights")
    if w is not None:
        b["attn_weights"] = np.empty(w.shape[:-1] + (w.shape[-1] + 1,),
                                     np.float32)
    for name, of in zip(grads, (key, value)):
        if a.get(name) is not None:
            b[name] = np.empty_like(b[of])  # the blocked row's, dropped
    run(**b)
    if w is not None:
        w[...] = b["attn_weights"][..., 1:]


def _run_module(m, **a):
    """m.run(**a) (a module's forward, or its backward with grad_out), the
    empty problems answered as above."""
    key = a.get("key")
    if a["batch"] and a["q_len"] and (key is None or key.shape[1]):
        return m.run(**a)
    c = m.config()
    B, Lq = a["batch"], a["q_len"]
    cache = a.get("cache")
    Lk = (key.shape[1] if key is not None else
          Lq if cache is None else
          max(cache.length(s) for s in range(cache.config()["batch"])) + Lq)
    _check_empty_args(B, c["num_heads"], Lq, Lk, counts=(
        ("head_mask", a.get("head_mask"), c["num_heads"]),
        ("positions", a.get("positions"), B * Lq)), **a)
    _run_empty(m.run, a, "key", "value", ("grad_key", "grad_value"),
               ("grad_params", "grad_head_mask"))


def _run_attention(**a):
    """_core.attention(**a) (mha_attention, or its backward with
    grad_out), the empty problems answered as above."""
    k = a.get("k")
    if a["batch"] and a["q_len"] and (k is None or k.shape[1]):
        return _core.attention(**a)
    B, H, Lq = a["batch"], a["num_heads"], a["q_len"]
    cache = a.get("cache")
    Lk = (k.shape[1] if cache is None else
          max(cache.length(s) for s in range(cache.config()["batch"])))
    _check_empty_args(B, H, Lq, Lk, counts=(
        ("sinks", a.get("sinks"), H),
        ("q_positions", a.get("q_positions"), B * Lq),
        ("k_positions", a.get("k_positions"), B * Lk)), **a)
    _run_empty(_core.attention, a, "k", "v", ("grad_k", "grad_v"),
               ("grad_sinks",))


# ---- the module --------------------------------------------------------------

# 16-bit arrays: NumPy's float16, and bfloat16 arrays of ml_dtypes where
# the caller uses it (mha does not depend on it), as libmha's dtype codes
# (MHA_DTYPE_F16, MHA_DTYPE_BF16); their elements reach C as their bits.
_HALF_NAMES = {"float16": 2, "bfloat16": 3}


def _data_dtype(q):
    """q's dtype if it is float16 or bfloat16 (k, v, out and the gradients
    then share it), else float32, the default."""
    dt = getattr(q, "dtype", None)
    if isinstance(q, np.ndarray) and dt.name in _HALF_NAMES:
        return dt
    return np.dtype(np.float32)


class Module:
    """A libmha module with nn.MultiheadAttention's parameters
    (mha_create).  Keyword arguments are mha_config's fields:

        Module(embed_dim, num_heads, kdim=None, vdim=None, bias=True,
               add_bias_kv=False, add_zero_attn=False, dropout=0.0,
               scale=None, seed=0, num_kv_heads=None, head_dim=None,
               sinks=False, rope=None, alibi=False, window=None,
               softcap=None, attention_chunk=None, v_head_dim=None)

    rope: 'neox' | 'gptj' | dict(style=, dims=, theta=, scale=); alibi:
    True (the paper's slopes) or an (H,) float32 array of slopes; window:
    (left, right) with -1 for no bound; softcap: c > 0; attention_chunk:
    C >= 1, a query sees only the keys of its own chunk of C positions
    (Llama 4's chunked layers); v_head_dim: the values' head width d_v
    when it is not d_h (DeepSeek's MLA: 128 beside keys of 192), making
    v_proj_weight (H_kv*d_v, vdim) and out_proj.weight (E, H*d_v).
    Parameters start
    as mha_create initialises them from ``seed`` (Xavier-uniform weights,
    zero biases).
    """

    def __init__(self, embed_dim: int, num_heads: int, *,
                 kdim: Optional[int] = None, vdim: Optional[int] = None,
                 bias: bool = True, add_bias_kv: bool = False,
                 add_zero_attn: bool = False, dropout: float = 0.0,
                 scale: Optional[float] = None, seed: int = 0,
                 num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, sinks: bool = False,
                 rope: _Rope = None, alibi: _Alibi = False,
                 window: _Window = None, softcap: Optional[float] = None,
                 attention_chunk: Optional[int] = None,
                 v_head_dim: Optional[int] = None,
                 _handle: Optional[_core.Module] = None) -> None:
        if _handle is None:
            mods = _modifiers(int(num_heads), rope, alibi, window, softcap,
                              attention_chunk)
            _handle = _core.module_create(
                embed_dim=int(embed_dim), num_heads=int(num_heads),
                kdim=int(kdim or 0), vdim=int(vdim or 0), bias=bool(bias),
                add_bias_kv=bool(add_bias_kv),
                add_zero_attn=bool(add_zero_attn), dropout=float(dropout),
                scale=None if scale is None else float(scale),
                seed=int(seed), num_kv_heads=int(num_kv_heads or 0),
                head_dim=int(head_dim or 0), sinks=bool(sinks),
                modifiers=mods, v_head_dim=int(v_head_dim or 0))
        self._m = _handle
        self._cfg = _handle.config()
        self._params = _handle.params()

    # -- files --
    @classmethod
    def load(cls, path: _Path, num_heads: Optional[int] = None, *,
             add_zero_attn: bool = False, dropout: Optional[float] = None,
             scale: Optional[float] = None, rope: _Rope = None,
             alibi: _Alibi = False, window: _Window = None,
             softcap: Optional[float] = None,
             attention_chunk: Optional[int] = None) -> Module:
        """A module from a safetensors state_dict (mha_module_from_file):
        torch's nn.MultiheadAttention's, or one Module.save wrote.  The
        head count comes from ``num_heads`` or the file's __metadata__;
        the other keywords override what the file says."""
        h = int(num_heads or 0)
        mods = _modifiers(h, rope, alibi, window, softcap, attention_chunk)
        return cls(0, 0, _handle=_core.module_load(
            path=str(path), num_heads=h, add_zero_attn=bool(add_zero_attn),
            dropout=None if dropout is None else float(dropout),
            scale=None if scale is None else float(scale), modifiers=mods))

    def save(self, path: _Path) -> None:
        """Saves the parameters as safetensors with the config in
        __metadata__ (mha_module_save); atomic."""
        self._m.save(str(path))

    # -- configuration --
    @property
    def config(self) -> Dict[str, Any]:
        """The resolved mha_config as a dict."""
        return dict(self._cfg)

    embed_dim = property(lambda self: self._cfg["embed_dim"])
    num_heads = property(lambda self: self._cfg["num_heads"])
    num_kv_heads = property(lambda self: self._cfg["num_kv_heads"])
    head_dim = property(lambda self: self._cfg["head_dim"])
    v_head_dim = property(lambda self: self._cfg["v_head_dim"])
    kdim = property(lambda self: self._cfg["kdim"])
    vdim = property(lambda self: self._cfg["vdim"])
    dropout = property(lambda self: self._cfg["dropout"])
    scale = property(lambda self: self._cfg["scale"])

    def _kwargs(self):
        c = self._cfg
        kw = dict(kdim=c["kdim"], vdim=c["vdim"], bias=c["bias"],
                  add_bias_kv=c["add_bias_kv"],
                  add_zero_attn=c["add_zero_attn"], dropout=c["dropout"],
                  scale=c["scale"], seed=c["seed"],
                  num_kv_heads=c["num_kv_heads"], head_dim=c["head_dim"],
                  sinks=c["sinks"], v_head_dim=c["v_head_dim"])
        kw.update(_mods_kwargs(c["modifiers"], c["num_heads"]))
        if c["attention_chunk"]:
            kw["attention_chunk"] = c["attention_chunk"]
        return kw

    def __repr__(self):
        c = self._cfg
        return ("mha.Module(embed_dim=%d, num_heads=%d, num_kv_heads=%d, "
                "kdim=%d, vdim=%d)" % (c["embed_dim"], c["num_heads"],
                                      c["num_kv_heads"], c["kdim"],
                                      c["vdim"]))

    def __reduce__(self):
        return (_module_from_state, (self._cfg["embed_dim"],
                                     self._cfg["num_heads"], self._kwargs(),
                                     self.state_dict()))

    # -- parameters, by PyTorch's names and in state_dict order --
    def parameter_names(self) -> List[str]:
        return [p[0] for p in self._params]

    def parameter_shapes(self) -> Dict[str, Tuple[int, ...]]:
        return {p[0]: p[1] for p in self._params}

    def __getitem__(self, name: str) -> np.ndarray:
        """A copy of parameter ``name`` (mha_param_get)."""
        for n, shape, _, _ in self._params:
            if n == name:
                out = np.empty(shape, np.float32)
                self._m.param_get(name, out)
                return out
        raise NotFoundError("no parameter named %r; this module has %s"
                            % (name, self.parameter_names()), 7)

    def __setitem__(self, name: str, value: npt.ArrayLike) -> None:
        """Sets parameter ``name`` (mha_param_set): float32 of its exact
        shape, every value finite, else an exception and no change."""
        shape = self.parameter_shapes().get(name)
        if shape is None:
            raise NotFoundError("no parameter named %r; this module has %s"
                                % (name, self.parameter_names()), 7)
        a = _array(value, name)
        if a.shape != tuple(shape):
            raise ValueError("%s must have shape %s, got %s"
                             % (name, tuple(shape), a.shape))
        self._m.param_set(name, a)

    def state_dict(self) -> Dict[str, np.ndarray]:
        """{name: float32 array} in PyTorch's state_dict order."""
        return {n: self[n] for n in self.parameter_names()}

    def load_state_dict(self, state: Dict[str, npt.ArrayLike],
                        strict: bool = True) -> None:
        """Sets every parameter from ``state``; strict: the names must be
        exactly this module's."""
        names = self.parameter_names()
        if strict:
            missing = [n for n in names if n not in state]
            extra = [n for n in state if n not in names]
            if missing or extra:
                raise KeyError("state_dict mismatch: missing %s, unexpected "
                               "%s" % (missing, extra))
        for n in names:
            if n in state:
                self[n] = state[n]

    def reset_parameters(self, seed: int = 0) -> None:
        self._m.reset_parameters(int(seed))

    def prune_heads(self, keep: Sequence[int]) -> Module:
        """A new Module of the heads ``keep`` (distinct head indices, in
        the order given), mha_prune_heads: the rows of the q/k/v
        projections and the columns of out_proj.weight those heads own.
        Its forward equals this one's with head_mask 1 on the kept heads
        and 0 elsewhere, at len(keep)/H of the cost."""
        return Module(0, 0, _handle=self._m.prune_heads(
            [int(h) for h in keep]))

    def project(self, which: str, x: npt.ArrayLike) -> np.ndarray:
        """One projection (mha_project): which = 'query' | 'key' | 'value'
        (x (rows, E|kdim|vdim) -> (rows, H*d_h | H_kv*d_h | H_kv*d_v)) or
        'out' (x (rows, H*d_v) -> (rows, E))."""
        w = _key(which, _PROJ, "projection")
        x = _array(x, "x")
        rows = int(np.prod(x.shape[:-1])) if x.ndim else 0
        c = self._cfg
        width = {0: c["num_heads"] * c["head_dim"],
                 1: c["num_kv_heads"] * c["head_dim"],
                 2: c["num_kv_heads"] * c["v_head_dim"],
                 3: c["embed_dim"]}[w]
        y = np.empty(x.shape[:-1] + (width,), np.float32)
        self._m.project(w, x, rows, y)
        return y

    # -- forward and backward --
    def _args(self, query, key, value, attn_mask, key_padding_mask,
              key_lengths, causal, need_weights, training, dropout_seed,
              head_mask, cache, positions, num_threads):
        dt = _data_dtype(query)
        q, unbatched = _batched(_array(query, "query", dt), "query")
        B, Lq = q.shape[0], q.shape[1]
        k = v = None
        Lk = 0
        if key is not None:
            k, ub = _batched(_array(key, "key", dt), "key")
            if ub != unbatched:
                raise ValueError("query and key must both be batched or "
                                 "both unbatched")
            Lk = k.shape[1]
            if value is not None:
                v, _ = _batched(_array(value, "value", dt), "value")
                if v.shape[:2] != k.shape[:2]:
                    raise ValueError("key %s and value %s must have the same "
                                     "batch and length" % (k.shape, v.shape))
        elif value is not None:
            raise ValueError("value given without key")
        if k is not None and k.shape[0] != B:
            raise ValueError("query has batch %d, key %d" % (B, k.shape[0]))
        c = self._cfg
        for name, t, want in (("query", q, c["embed_dim"]),
                              ("key", k, c["kdim"]),
                              ("value", v, c["vdim"])):
            if t is not None and t.shape[2] != want:
                raise ValueError("%s has last dimension %d, expected %s %d"
                                 % (name, t.shape[2], {"query": "embed_dim",
                                    "key": "kdim", "value": "vdim"}[name],
                                    want))
        am, amk = _mask(attn_mask, "attn_mask")
        kpm, kpmk = _mask(key_padding_mask, "key_padding_mask")
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError("cache must be a mha.KVCache")
        half = _HALF_NAMES.get(dt.name, 0)
        if half:   # (the bits; forward and backward view results as dt)
            q = q.view(np.uint16)
            k = None if k is None else k.view(np.uint16)
            v = None if v is None else v.view(np.uint16)
        args = dict(dtype=half,
                    query=q, key=k, value=v, batch=B, q_len=Lq, kv_len=Lk,
                    attn_mask=am, attn_mask_kind=amk, key_padding_mask=kpm,
                    key_padding_mask_kind=kpmk,
                    key_lengths=_int64(key_lengths, "key_lengths"),
                    causal=_key(causal, _CAUSAL, "causal"),
                    need_weights=_key(need_weights, _WEIGHTS, "need_weights"),
                    training=bool(training), dropout_seed=int(dropout_seed),
                    head_mask=_array(head_mask, "head_mask", required=False),
                    cache=None if cache is None else cache._c,
                    positions=_int64(positions, "positions"),
                    num_threads=int(num_threads))
        return args, unbatched

    def forward(self, query: npt.ArrayLike,
                key: Optional[npt.ArrayLike] = None,
                value: Optional[npt.ArrayLike] = None, *,
                attn_mask: _MaskArg = None,
                key_padding_mask: _MaskArg = None,
                key_lengths: Optional[npt.ArrayLike] = None,
                causal: _Causal = None,
                need_weights: Union[bool, str, None] = False,
                training: bool = False, dropout_seed: int = 0,
                head_mask: Optional[npt.ArrayLike] = None,
                cache: Optional[KVCache] = None,
                positions: Optional[npt.ArrayLike] = None,
                num_threads: int = 0
                ) -> Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]:
        """The forward pass (mha_forward).

        query (B, Lq, E), key (B, Lk, kdim), value (B, Lk, vdim); key None:
        self-attention (query is also key and value); value None: the key
        is also the value.  attn_mask: (Lq, Lk), (B, Lq, Lk) or (B, H, Lq,
        Lk), key_padding_mask (Lk) or (B, Lk): float32 (additive) or a
        typed bool mask (mha.block / mha.allow).  key_lengths (B) int.
        causal: None, 'top_left' (j <= i) or 'bottom_right' (j <= i + Lk -
        Lq).  need_weights: False, 'average' (B, Lq, Lk') or 'per_head'
        (B, H, Lq, Lk'), Lk' counting bias_k and the zero key.  training:
        dropout of config p keyed by dropout_seed.  head_mask (H) float32.
        cache: a KVCache (incremental self-attention: key/value None).
        positions (B, Lq) int: RoPE positions.

        Returns out (B, Lq, E), or (out, weights) with need_weights.
        float16 inputs (or ml_dtypes' bfloat16, all of one dtype) run the
        module on 16-bit data (mha_forward's dtype: the parameters rounded
        to it), out in that dtype; no cache, weights, dropout, head_mask
        or RoPE there (docs/semantics.md, "16-bit modules").
        """
        if type(query) is np.ndarray and attn_mask is None and \
                key_padding_mask is None and key_lengths is None and \
                not need_weights and not training and head_mask is None \
                and cache is None and positions is None and \
                (causal is None or type(causal) is str):
            # the short way for the plain call: C reads the shapes from the
            # arrays and answers NotImplemented for anything it would have
            # to convert or refuse, which the full path below then does
            out = np.empty_like(query)
            if self._m.forward_fast(query, key, value, out,
                                    _CAUSAL.get(causal, -1),
                                    num_threads) is True:
                return out
        a, unbatched = self._args(query, key, value, attn_mask,
                                  key_padding_mask, key_lengths, causal,
                                  need_weights, training, dropout_seed,
                                  head_mask, cache, positions, num_threads)
        c = self._cfg
        B, Lq = a["batch"], a["q_len"]
        dt = _data_dtype(query)
        out = np.empty((B, Lq, c["embed_dim"]), dt)
        w = None
        if a["need_weights"]:
            if cache is not None:
                lk = max(cache.length(s) for s in range(cache.batch)) + Lq
            else:                           # key None: self-attention
                lk = Lq if a["key"] is None else a["kv_len"]
            lkt = self._m.total_keys(lk)
            shape = ((B, Lq, lkt) if a["need_weights"] == 1
                     else (B, c["num_heads"], Lq, lkt))
            w = np.empty(shape, np.float32)
        _run_module(self._m, out=out.view(np.uint16) if a["dtype"] else out,
                    attn_weights=w, **a)
        if unbatched:
            out = out[0]
            w = None if w is None else w[0]
        return (out, w) if a["need_weights"] else out

    __call__ = forward

    def backward(self, grad_out: npt.ArrayLike, query: npt.ArrayLike,
                 key: Optional[npt.ArrayLike] = None,
                 value: Optional[npt.ArrayLike] = None, *,
                 attn_mask: _MaskArg = None,
                 key_padding_mask: _MaskArg = None,
                 key_lengths: Optional[npt.ArrayLike] = None,
                 causal: _Causal = None, training: bool = False,
                 dropout_seed: int = 0,
                 head_mask: Optional[npt.ArrayLike] = None,
                 positions: Optional[npt.ArrayLike] = None,
                 num_threads: int = 0,
                 wrt: Sequence[str] = ("query", "key", "value", "params")
                 ) -> Dict[str, Any]:
        """The gradients of ``sum(forward(...) * grad_out)`` (mha_backward):
        the same arguments as forward, then a dict with the entries named
        in ``wrt``: 'query', 'key', 'value' (arrays shaped like the inputs;
        with key None the query's gradient sums all three, with value None
        the key's sums two), 'params' ({name: gradient} in state_dict
        order), 'head_mask' ((H), the head importance).  On 16-bit inputs
        the inputs' gradients are of their dtype, the parameters' float32."""
        a, unbatched = self._args(query, key, value, attn_mask,
                                  key_padding_mask, key_lengths, causal,
                                  None, training, dropout_seed, head_mask,
                                  None, positions, num_threads)
        c = self._cfg
        B, Lq = a["batch"], a["q_len"]
        dt = _data_dtype(query)
        go = _array(grad_out, "grad_out", dt)
        if a["dtype"]:
            go = go.view(np.uint16)
        if unbatched:
            go = go.reshape((1,) + go.shape)
        if go.shape != (B, Lq, c["embed_dim"]):
            raise ValueError("grad_out must have shape %s, got %s"
                             % ((B, Lq, c["embed_dim"])[unbatched:],
                                go.shape[unbatched:]))
        wrt = set(wrt)
        unknown = wrt - {"query", "key", "value", "params", "head_mask"}
        if unknown:
            raise ValueError("wrt: unknown names %s" % sorted(unknown))
        g = {}
        if "query" in wrt:
            g["query"] = np.empty_like(a["query"])
        if "key" in wrt and a["key"] is not None:
            g["key"] = np.empty_like(a["key"])
        if "value" in wrt and a["value"] is not None:
            g["value"] = np.empty_like(a["value"])
        gp = (np.empty(self._m.param_numel(), np.float32)
              if "params" in wrt else None)
        ghm = (np.empty(c["num_heads"], np.float32)
               if "head_mask" in wrt else None)
        _run_module(self._m, out=None, grad_out=go,
                    grad_query=g.get("query"), grad_key=g.get("key"),
                    grad_value=g.get("value"), grad_params=gp,
                    grad_head_mask=ghm, **a)
        g = {k: v.view(dt) for k, v in g.items()}
        if unbatched:
            g = {k: v[0] for k, v in g.items()}
        if gp is not None:
            g["params"] = {n: gp[off:off + numel].reshape(shape)
                           for n, shape, numel, off in self._params}
        if ghm is not None:
            g["head_mask"] = ghm
        return g


def _module_from_state(embed_dim, num_heads, kwargs, state):
    m = Module(embed_dim, num_heads, **kwargs)
    m.load_state_dict(state)
    return m


# ---- the KV cache ------------------------------------------------------------

class KVCache:
    """Projected (and rotated) keys and values of ``batch`` sequences, up
    to ``capacity`` tokens each, H_kv heads of d_h (mha_kv_cache).  dtype:
    'f32', 'f16', 'bf16', 'q8' or 'q4' (rounded once, when appended).
    v_head_dim: the values' head width when it is not d_h (appended and
    read as (n, H_kv*v_head_dim); the attention's output then H*that).
    latent: multi-head latent attention's cache (DeepSeek's MLA,
    absorbed): the values are the keys' first v_head_dim elements, stored
    once; append(seq, k, None).
    window W >= 1: a sliding-window ring of ``capacity`` >= W slots.
    rotate: store K and V turned by a Hadamard rotation of the head
    dimension (queries and outputs turned alike: the attention unchanged
    but for rounding), which spreads outlier channels before q4 / q8
    round them.  Give it to Module.forward(cache=...) or
    attention(cache=...)."""

    def __init__(self, batch: int, num_kv_heads: int, head_dim: int,
                 capacity: int, dtype: str = "f32", window: int = 0,
                 page_size: int = 0, num_pages: int = 0,
                 rotate: bool = False,
                 v_head_dim: Optional[int] = None,
                 latent: bool = False) -> None:
        self._c = _core.kv_cache_create(
            batch=int(batch), num_kv_heads=int(num_kv_heads),
            head_dim=int(head_dim), capacity=int(capacity),
            dtype=_key(dtype, _KV_DTYPE, "dtype"), window=int(window),
            page_size=int(page_size), num_pages=int(num_pages),
            rotate=bool(rotate), v_head_dim=int(v_head_dim or 0),
            latent=bool(latent))
        cfg = self._c.config()
        self.batch = cfg["batch"]
        self.num_kv_heads = cfg["num_kv_heads"]
        self.head_dim = cfg["head_dim"]
        self.capacity = cfg["capacity"]
        self.window = cfg["window"]
        self.page_size = cfg["page_size"]
        self.rotate = bool(cfg["rotate"])
        self.v_head_dim = cfg["v_head_dim"]
        self.latent = bool(cfg["latent"])
        self.dtype = dtype

    @classmethod
    def for_module(cls, module: Module, batch: int, capacity: int,
                   dtype: str = "f32", window: int = 0,
                   rotate: bool = False) -> KVCache:
        """A cache shaped for ``module`` (its H_kv, d_h and d_v)."""
        dv = module.v_head_dim
        return cls(batch, module.num_kv_heads, module.head_dim, capacity,
                   dtype, window, rotate=rotate,
                   v_head_dim=None if dv == module.head_dim else dv)

    def length(self, seq: int) -> int:
        """Tokens held by sequence ``seq`` (counting every one appended
        since the last reset, with a window)."""
        return self._c.length(int(seq))

    @property
    def lengths(self) -> List[int]:
        return [self._c.length(s) for s in range(self.batch)]

    def append(self, seq: int, k: npt.ArrayLike,
               v: Optional[npt.ArrayLike]) -> None:
        """Appends n tokens to sequence ``seq``: k and v (n, H_kv*d_h)
        float32, projected (and rotated); v None on a latent cache."""
        row = self.num_kv_heads * self.head_dim
        vrow = self.num_kv_heads * self.v_head_dim
        k = _array(k, "k")
        if self.latent:
            if v is not None:
                raise ValueError("v must be None: a latent cache's values "
                                 "are its keys' first %d elements"
                                 % self.v_head_dim)
            if k.ndim != 2 or k.shape[1] != row:
                raise ValueError("k must have shape (n, %d), got %s"
                                 % (row, k.shape))
            self._c.append(int(seq), k, None, k.shape[0])
            return
        v = _array(v, "v")
        if k.ndim != 2 or k.shape[1] != row or \
                v.shape != (k.shape[0], vrow):
            raise ValueError("k and v must have shapes (n, %d) and (n, %d), "
                             "got %s and %s" % (row, vrow, k.shape, v.shape))
        self._c.append(int(seq), k, v, k.shape[0])

    def truncate(self, seq: int, length: int) -> None:
        """Keeps the first ``length`` tokens of sequence ``seq``."""
        self._c.truncate(int(seq), int(length))

    def reset(self, seq: Optional[int] = None) -> None:
        """Empties sequence ``seq`` (None: every sequence)."""
        self._c.reset(-1 if seq is None else int(seq))

    def read(self, seq: int, start: int = 0, n: Optional[int] = None
             ) -> Tuple[np.ndarray, np.ndarray]:
        """(k, v), (n, H_kv*d_h) and (n, H_kv*d_v): tokens start .. start+n-1 of ``seq``
        as the attention reads them (n None: up to the length)."""
        length = self.length(seq)
        if n is None:
            if not 0 <= int(start) <= length:
                raise ValueError("start %d is outside sequence %d's %d "
                                 "tokens" % (int(start), int(seq), length))
            n = length - int(start)
        if int(n) < 0:
            raise ValueError("n must be >= 0, got %d" % int(n))
        row = self.num_kv_heads * self.head_dim
        k = np.empty((int(n), row), np.float32)
        v = np.empty((int(n), self.num_kv_heads * self.v_head_dim),
                     np.float32)
        self._c.read(int(seq), int(start), int(n), k, v)
        return k, v

    def fork(self, src: int, dst: int) -> None:
        """Sequence ``dst`` becomes a copy of ``src`` (what it held is
        dropped): a paged cache shares src's pages, copied only when one
        of them appends into a shared page; a contiguous one copies."""
        self._c.fork(int(src), int(dst))

    def usage(self) -> Dict[str, int]:
        """What the cache holds and takes (mha_kv_cache_usage): tokens,
        token_bytes (their keys' and values' bytes), bytes (the storage
        held: pages in use, a shared one once), bytes_total, page_size,
        pages_used, pages_free."""
        return dict(self._c.usage())

    def __repr__(self):
        return ("mha.%s(batch=%d, num_kv_heads=%d, head_dim=%d, "
                "capacity=%d, dtype=%r, window=%d, page_size=%d, lengths=%s)"
                % (type(self).__name__, self.batch, self.num_kv_heads,
                   self.head_dim, self.capacity, self.dtype, self.window,
                   self.page_size, self.lengths))


def attention_ragged(q: npt.ArrayLike, q_start: npt.ArrayLike,
                     cache: KVCache, *, num_heads: int,
                     scale: Optional[float] = None, num_threads: int = 0,
                     return_lse: bool = False, share_prefix: bool = False,
                     attention_chunk: Optional[int] = None
                     ) -> Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]:
    """A ragged decoding step (mha_attention_decode with q_start): the new
    queries of every sequence of ``cache`` packed back to back, q (T,
    H*d_h) float32, sequence b's rows q_start[b] .. q_start[b+1]-1
    (q_start: B + 1 offsets, FlashAttention's cu_seqlens), so prefill
    chunks and single tokens mix in one call.  Append each sequence's new
    keys and values first; each attends causally (bottom right) to its
    cache, with the bits of a call on that sequence alone.  Returns out
    (T, H*d_v), d_v the cache's v_head_dim, and with return_lse the lse (T*H: sequence b's (H, n_b)
    block at H*q_start[b]).  share_prefix (a PagedKVCache): sequences
    whose first pages are shared (forks of one prompt) attend to them once
    for all their queries (cascade attention): equal to the separate calls
    up to float rounding, not bit for bit.  attention_chunk C: each query
    sees only the keys of its own chunk of C positions."""
    q = _array(q, "q")
    if q.ndim != 2 or q.shape[1] % int(num_heads):
        raise ValueError("q must be (T, num_heads*head_dim), got shape %s"
                         % (q.shape,))
    qs = np.ascontiguousarray(q_start, dtype=np.int64)
    if qs.shape != (cache.batch + 1,):
        raise ValueError("q_start must have batch + 1 = %d entries, got "
                         "shape %s" % (cache.batch + 1, qs.shape))
    out = np.empty((q.shape[0], int(num_heads) * cache.v_head_dim),
                   np.float32)
    lse = (np.empty(q.shape[0] * int(num_heads), np.float32) if return_lse
           else None)
    cache._c.decode_ragged(q, out, qs, int(num_heads),
                           q.shape[1] // int(num_heads),
                           scale=0.0 if scale is None else float(scale),
                           given=0 if scale is None else 1,
                           num_threads=int(num_threads), lse=lse,
                           share_prefix=bool(share_prefix),
                           attention_chunk=int(attention_chunk or 0))
    return (out, lse) if return_lse else out


class PagedKVCache(KVCache):
    """A KV cache whose memory follows the tokens held (mha_kv_cache with
    page_size): a pool of ``num_pages`` pages of ``page_size`` positions
    (16, 32 or a multiple of 64; num_pages 0: room for every sequence at
    its capacity) and a table of pages per sequence.  ``batch`` is the number
    of sequence slots, ``capacity`` the most tokens one may hold; append
    to an empty slot to add a sequence, ``reset(seq)`` to free its pages,
    ``fork(src, dst)`` to share a prefix.  An append the pool cannot take
    raises MemoryError and changes nothing.  Attention reads it exactly as
    a contiguous cache: the same results, bit for bit."""

    def __init__(self, batch: int, num_kv_heads: int, head_dim: int,
                 capacity: int, page_size: int = 64, num_pages: int = 0,
                 dtype: str = "f32", rotate: bool = False,
                 v_head_dim: Optional[int] = None,
                 latent: bool = False) -> None:
        super().__init__(batch, num_kv_heads, head_dim, capacity, dtype,
                         0, int(page_size), int(num_pages), rotate,
                         v_head_dim=v_head_dim, latent=latent)


# ---- attention on heads --------------------------------------------------------

def _attention_args(q, k, v, num_heads, num_kv_heads, scale, attn_mask,
                    key_padding_mask, key_lengths, causal, need_weights,
                    dropout, training, dropout_seed, num_threads, cache,
                    rope, alibi, window, softcap, sinks, q_positions,
                    k_positions, attention_chunk=None):
    dt = _data_dtype(q)
    q, unbatched = _batched(_array(q, "q", dt), "q")
    H = int(num_heads)
    if H < 1:
        raise ValueError("num_heads must be >= 1, got %d" % H)
    if q.shape[2] % H:
        raise ValueError("q's last dimension %d is not num_heads %d times "
                         "a head_dim" % (q.shape[2], H))
    dh = q.shape[2] // H
    Hkv = int(num_kv_heads or H)
    B, Lq = q.shape[0], q.shape[1]
    if cache is not None:
        if not isinstance(cache, KVCache):
            raise TypeError("cache must be a mha.KVCache")
        if k is not None or v is not None:
            raise ValueError("with a cache, k and v must be None (append "
                             "them to the cache first)")
        Lk = 0
        dv = cache.v_head_dim
    else:
        k, _ = _batched(_array(k, "k", dt), "k")
        v, _ = _batched(_array(v, "v", dt), "v")
        if k.shape[0] != B or k.shape[2] != Hkv * dh:
            raise ValueError("k must have shape (%d, Lk, %d) (num_kv_heads "
                             "%d x head_dim %d), got %s"
                             % (B, Hkv * dh, Hkv, dh, k.shape))
        # values may have another head width (d_v: v_head_dim)
        if v.shape[:2] != k.shape[:2] or v.shape[2] % Hkv or \
                v.shape[2] == 0:
            raise ValueError("v must have shape (%d, %d, num_kv_heads %d x "
                             "d_v), got %s" % (B, k.shape[1], Hkv, v.shape))
        Lk = k.shape[1]
        dv = v.shape[2] // Hkv
    am, amk = _mask(attn_mask, "attn_mask")
    kpm, kpmk = _mask(key_padding_mask, "key_padding_mask")
    s = _array(sinks, "sinks", required=False)
    half = _HALF_NAMES.get(dt.name, 0)
    if half:   # (the bits; the caller views results back as dt)
        q = q.view(np.uint16)
        k = None if k is None else k.view(np.uint16)
        v = None if v is None else v.view(np.uint16)
    return dict(
        dtype=half,
        q=q, k=k, v=v, batch=B, num_heads=H, head_dim=dh, q_len=Lq,
        kv_len=Lk, num_kv_heads=Hkv, v_head_dim=0 if dv == dh else dv,
        scale=None if scale is None else float(scale), attn_mask=am,
        attn_mask_kind=amk, key_padding_mask=kpm, key_padding_mask_kind=kpmk,
        key_lengths=_int64(key_lengths, "key_lengths"),
        causal=_key(causal, _CAUSAL, "causal"),
        need_weights=_key(need_weights, _WEIGHTS, "need_weights"),
        dropout=float(dropout), training=bool(training),
        dropout_seed=int(dropout_seed), num_threads=int(num_threads),
        cache=None if cache is None else cache._c,
        modifiers=_modifiers(H, rope, alibi, window, softcap,
                             attention_chunk), sinks=s,
        q_positions=_int64(q_positions, "q_positions"),
        k_positions=_int64(k_positions, "k_positions")), unbatched, dt


def _attention_plain(q, k, v, num_heads, num_kv_heads, scale, num_threads):
    """attention's short way for q, k and v alone (batched C-contiguous
    float32 arrays of consistent shapes): one positional C call, the same
    computation.  None for anything else: the full way then checks (and
    raises) as always."""
    A, f32 = np.ndarray, np.float32
    if type(q) is not A or type(k) is not A or type(v) is not A or \
            q.dtype != f32 or k.dtype != f32 or v.dtype != f32 or \
            q.ndim != 3 or k.ndim != 3 or k.shape != v.shape or \
            q.size == 0 or k.size == 0 or \
            not (q.flags.c_contiguous and k.flags.c_contiguous and
                 v.flags.c_contiguous) or type(num_heads) is not int:
        return None
    H, Hkv = num_heads, num_kv_heads or num_heads
    if type(Hkv) is not int or H < 1 or Hkv < 1 or q.shape[2] % H or \
            k.shape[0] != q.shape[0] or k.shape[2] != Hkv * (q.shape[2] // H):
        return None
    out = np.empty(q.shape, f32)
    _core.attention_plain(q, k, v, out, False, H, Hkv, 0,
                          None if scale is None else float(scale),
                          int(num_threads))
    return out


def attention(q: npt.ArrayLike, k: Optional[npt.ArrayLike] = None,
              v: Optional[npt.ArrayLike] = None, *, num_heads: int,
              num_kv_heads: Optional[int] = None,
              scale: Optional[float] = None, attn_mask: _MaskArg = None,
              key_padding_mask: _MaskArg = None,
              key_lengths: Optional[npt.ArrayLike] = None,
              causal: _Causal = None,
              need_weights: Union[bool, str, None] = False,
              dropout: float = 0.0, training: bool = False,
              dropout_seed: int = 0, num_threads: int = 0,
              return_lse: bool = False, cache: Optional[KVCache] = None,
              rope: _Rope = None, alibi: _Alibi = False,
              window: _Window = None, softcap: Optional[float] = None,
              sinks: Optional[npt.ArrayLike] = None,
              q_positions: Optional[npt.ArrayLike] = None,
              k_positions: Optional[npt.ArrayLike] = None,
              attention_chunk: Optional[int] = None
              ) -> Union[np.ndarray, Tuple[np.ndarray, ...]]:
    """Attention on projected heads (mha_attention):

        out[b, i, h*d_h ..] = softmax(q_h k_g^T * scale + mask) v_g,
        g = h // (H / H_kv)

    q (B, Lq, H*d_h), k (B, Lk, H_kv*d_h) and v (B, Lk, H_kv*d_v) (values
    of another head width than the keys, as DeepSeek's MLA; out is then
    (B, Lq, H*d_v); float32 only) float32, or all float16,
    or all bfloat16 (ml_dtypes' type): libmha's 16-bit attention, out of
    the same dtype (the weights and the lse float32); d_h = q's last
    dimension / num_heads.  Masks, causal and need_weights as in
    Module.forward; dropout p applied when training.  Modifiers: rope,
    alibi, window, softcap, attention_chunk as in Module; sinks (H)
    float32 logits.  cache: a KVCache holding the keys (k, v None; append them first).

    Returns out, then the weights (need_weights) and the lse (B, H, Lq)
    (return_lse), as a tuple when there is more than out.
    """
    if causal is None and attn_mask is None and key_padding_mask is None \
            and key_lengths is None and not need_weights and not training \
            and not return_lse and cache is None and rope is None and \
            alibi is False and window is None and not softcap and \
            sinks is None and q_positions is None and k_positions is None \
            and attention_chunk is None:
        out = _attention_plain(q, k, v, num_heads, num_kv_heads, scale,
                               num_threads)
        if out is not None:
            return out
    a, unbatched, dt = _attention_args(
        q, k, v, num_heads, num_kv_heads, scale, attn_mask,
        key_padding_mask, key_lengths, causal, need_weights, dropout,
        training, dropout_seed, num_threads, cache, rope, alibi, window,
        softcap, sinks, q_positions, k_positions, attention_chunk)
    B, H, Lq = a["batch"], a["num_heads"], a["q_len"]
    dv = a["v_head_dim"] or a["head_dim"]
    out = np.empty(a["q"].shape[:2] + (H * dv,), a["q"].dtype)
    w = lse = None
    if a["need_weights"]:
        lk = max(cache.lengths) if cache is not None else a["kv_len"]
        w = np.empty((B, Lq, lk) if a["need_weights"] == 1
                     else (B, H, Lq, lk), np.float32)
    if return_lse:
        lse = np.empty((B, H, Lq), np.float32)
    _run_attention(out=out, attn_weights=w, lse=lse, **a)
    out = out.view(dt)
    if unbatched:
        out = out[0]
        w = None if w is None else w[0]
        lse = None if lse is None else lse[0]
    res = (out,) + ((w,) if a["need_weights"] else ()) + \
        ((lse,) if return_lse else ())
    return res if len(res) > 1 else out


def attention_backward(grad_out: npt.ArrayLike, q: npt.ArrayLike,
                       k: npt.ArrayLike, v: npt.ArrayLike, *,
                       num_heads: int, num_kv_heads: Optional[int] = None,
                       scale: Optional[float] = None,
                       attn_mask: _MaskArg = None,
                       key_padding_mask: _MaskArg = None,
                       key_lengths: Optional[npt.ArrayLike] = None,
                       causal: _Causal = None, dropout: float = 0.0,
                       training: bool = False, dropout_seed: int = 0,
                       num_threads: int = 0, rope: _Rope = None,
                       alibi: _Alibi = False, window: _Window = None,
                       softcap: Optional[float] = None,
                       sinks: Optional[npt.ArrayLike] = None,
                       q_positions: Optional[npt.ArrayLike] = None,
                       k_positions: Optional[npt.ArrayLike] = None,
                       attention_chunk: Optional[int] = None
                       ) -> Tuple[np.ndarray, ...]:
    """The gradients of ``sum(attention(...) * grad_out)`` with respect to
    q, k and v (mha_attention_backward), the same arguments as attention.
    Returns (grad_q, grad_k, grad_v), and grad_sinks (H) last when sinks
    are given.  16-bit data gives 16-bit gradients (grad_sinks float32)."""
    a, unbatched, dt = _attention_args(
        q, k, v, num_heads, num_kv_heads, scale, attn_mask,
        key_padding_mask, key_lengths, causal, None, dropout, training,
        dropout_seed, num_threads, None, rope, alibi, window, softcap, sinks,
        q_positions, k_positions, attention_chunk)
    go = _array(grad_out, "grad_out", dt)
    if a["dtype"]:
        go = go.view(np.uint16)
    if unbatched:
        go = go.reshape((1,) + go.shape)
    oshape = a["q"].shape[:2] + (a["num_heads"] *
                                 (a["v_head_dim"] or a["head_dim"]),)
    if go.shape != oshape:
        raise ValueError("grad_out must have the output's shape %s, got %s"
                         % (oshape, go.shape))
    gq = np.empty_like(a["q"])
    gk = np.empty_like(a["k"])
    gv = np.empty_like(a["v"])
    gs = (np.empty(a["num_heads"], np.float32) if a["sinks"] is not None
          else None)
    _run_attention(out=None, grad_out=go, grad_q=gq, grad_k=gk, grad_v=gv,
                   grad_sinks=gs, **a)
    gq, gk, gv = gq.view(dt), gk.view(dt), gv.view(dt)
    if unbatched:
        gq, gk, gv = gq[0], gk[0], gv[0]
    return (gq, gk, gv) + ((gs,) if gs is not None else ())


# ---- small functions -------------------------------------------------------------

def bf16_kernel() -> str:
    """Which kernels bf16 attention runs on (mha_bf16_kernel): 'amx' (AMX
    tiles), 'avx512bf16' (AVX512-BF16 dot products), 'bfdot' (aarch64's
    BFDOT) or 'float32' (bf16 and f16 inputs widened in C); MHA_BF16 in the
    environment caps it."""
    return _core.bf16_kernel()


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The default ALiBi slopes of H heads (mha_alibi_slopes)."""
    out = np.empty(int(num_heads), np.float32)
    _core.alibi_slopes(int(num_heads), out)
    return out


def rope_apply(x: npt.ArrayLike, num_heads: int, rope: _Rope = "neox",
               positions: Optional[npt.ArrayLike] = None,
               pos0: int = 0) -> np.ndarray:
    """Returns x (rows, H*d_h) float32 with RoPE applied (mha_rope_apply):
    row r at positions[r] (None: pos0 + r)."""
    x = _array(x, "x").copy()
    if x.ndim != 2 or x.shape[1] % int(num_heads):
        raise ValueError("x must be (rows, num_heads*head_dim), got %s"
                         % (x.shape,))
    m = _modifiers(int(num_heads), rope=rope)
    _core.rope_apply(x, x.shape[0], int(num_heads),
                     x.shape[1] // int(num_heads), m[6], m[7], m[8], m[9],
                     _int64(positions, "positions"), int(pos0))
    return x


def kernel_tier() -> Optional[str]:
    """The attention kernels in use: 'avx512', 'avx2', 'scalar' or 'ref'."""
    return _core.kernel_tier()


def gemm_backend() -> Optional[str]:
    """The projections' GEMM backend: 'onednn' or 'cblas' (MHA_GEMM forces
    one); None if MHA_GEMM names one this build lacks."""
    return _core.gemm_backend()


def dropout_keep(seed: int, p: float, b: int, h: int, i: int,
                 j: int) -> bool:
    """Whether the dropout hash keeps probability (b, h, i, j)."""
    return _core.dropout_keep(int(seed), float(p), int(b), int(h), int(i),
                              int(j))
