"""mha.transformers: libmha as an attention implementation of Hugging Face
transformers.

    import mha.transformers
    mha.transformers.register()          # once: the name "mha"
    model = AutoModelForCausalLM.from_pretrained(
        name, attn_implementation="mha")   # or model.set_attn_implementation

Two functions are registered under the name: ``attention`` with
transformers' AttentionInterface (it replaces the model's
scaled_dot_product_attention call) and ``mask`` with its
AttentionMaskInterface (it replaces the dense masks the model would build).

What a model's mask says reaches libmha as libmha's own options, never as a
dense (B, 1, Lq, Lk) tensor where one of them exists:

    causal (decoders)             causal bottom-right: the queries are the
                                  last Lq positions of the keys (prefill,
                                  decoding with a cache, chunked prefill)
    sliding window w (Mistral,    window=(w - 1, 0): a key is seen when it
    Gemma 2, gpt-oss layers)      is among the w positions up to the query
    chunked attention C (Llama 4  attention_chunk=C: a key is seen when it
    layers, no left padding, keys is in the query's own chunk of C
    from position 0)              positions
    bidirectional (encoders)      no mask; bidirectional windows (w, w)
    padding (the 2-D              key_lengths when every row is right-
    attention_mask)               padded, else a (B, Lk) key mask
    softcap (Gemma 2)             libmha's softcap
    s_aux (gpt-oss sinks)         libmha's sinks (a logit per head)
    scaling, dropout, GQA         scale, dropout_p, enable_gqa (K/V heads
                                  read in place, never repeated)

Where nothing is masked (the causal pattern without padding, window or
chunk, on one query row or on a prefill of its own keys), ``mask`` returns
None as transformers' sdpa_mask does, and ``attention`` takes a decoding
step's short way (one C call, its output written as the (B, 1, H, d) the
model reads), as does a decoding step of a left-padded batch, its key mask
passed along.

Any other mask (a model's own or_/and_mask_function, packed sequences,
chunks shifted by left padding or by a cache that dropped keys, block
overlays, a static cache whose keys do not end at
the last query) falls back to transformers' own dense boolean mask, which
libmha then applies as attn_mask: always correct, only slower.  A model that
passes a ready 4-D mask gets it applied as given.

Differences from transformers' "sdpa": output_attentions is not supported
(weights are not returned: None, as sdpa); a query row that sees no key (a
left-padding position) gives zeros rather than NaN or a uniform average
(libmha's rule; those rows are padding and never reach a real token).

transformers is an optional dependency: ``import mha`` never imports it,
this module does.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers import masking_utils as _mu

from .nn import functional as _F

__all__ = ["register", "attention", "mask", "Mask"]


class Mask(torch.Tensor):
    """What a model's mask says, in libmha's terms (the result of
    ``mask``, passed by the model to ``attention``).

    causal       keys after the query's own position are hidden
                 (bottom-right: the last query is the last key)
    window       (left, right) or None: libmha's window
    chunk        C or None: libmha's attention_chunk
    key_lengths  (B,) int64 tensor or None: right padding
    key_mask     (B, Lk) bool tensor or None: True = the key takes part

    It is a (B, 1, Lq, Lk) bool tensor of no memory (one element, strides
    0), as torch's own CausalBias is a tensor: transformers passes a 4-D
    tensor on as a ready mask (generate() with a static cache builds the
    masks ahead).  Anything but asking its shape raises: its element is
    not the mask, and no code other than ``attention`` may read it.
    """

    @staticmethod
    def __new__(cls, shape: Tuple[int, ...], causal: bool,
                window: Optional[Tuple[int, int]] = None,
                key_lengths: Optional[torch.Tensor] = None,
                key_mask: Optional[torch.Tensor] = None,
                chunk: Optional[int] = None) -> Mask:
        t = torch.Tensor._make_subclass(
            cls, torch.zeros((), dtype=torch.bool).expand(shape))
        t.causal = causal
        t.window = window
        t.chunk = chunk
        t.key_lengths = key_lengths
        t.key_mask = key_mask
        return t

    # what transformers may ask of a ready mask: its shape, and itself
    _METADATA = {torch.Tensor.shape.__get__, torch.Tensor.ndim.__get__,
                 torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
                 torch.Tensor.dim, torch.Tensor.size,
                 torch.Tensor.is_contiguous}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls._METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise TypeError("an mha.transformers.Mask is read by "
                        "attn_implementation='mha' alone, not by %s"
                        % getattr(func, "__name__", func))

    def contiguous(self, *args, **kwargs):
        """Itself (generate() asks a ready mask for its contiguous form)."""
        return self

    def __repr__(self, *args, **kwargs):
        pad = ("key_lengths=%s" % self.key_lengths.tolist()
               if self.key_lengths is not None else
               "key_mask of %s" % (tuple(self.key_mask.shape),)
               if self.key_mask is not None else "no padding")
        return "mha.transformers.Mask(causal=%s, window=%s, chunk=%s, %s)" % (
            self.causal, self.window, self.chunk, pad)


def _and_parts(fn):
    """The mask functions that transformers' and_masks(...) combined into
    fn, or None when fn is not such a combination."""
    if getattr(fn, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    cells = dict(zip(fn.__code__.co_freevars,
                     (c.cell_contents for c in fn.__closure__ or ())))
    parts = cells.get("mask_functions")
    return tuple(parts) if isinstance(parts, tuple) else None


def _cells(fn, qualname):
    """The closure of a transformers overlay named qualname, or {}."""
    if getattr(fn, "__qualname__", "") != qualname or not fn.__closure__:
        return {}
    return dict(zip(fn.__code__.co_freevars,
                    (c.cell_contents for c in fn.__closure__)))


def _overlay_width(fn, qualname):
    """The sliding_window a transformers overlay closure holds, or None."""
    w = _cells(fn, qualname).get("sliding_window")
    return w if isinstance(w, int) and w > 0 else None


def _overlay_chunk(fn):
    """The chunk_size of transformers' chunked overlay when no sequence is
    left-padded (padding shifts a sequence's chunks: no libmha option says
    that), else None."""
    cells = _cells(fn, "chunked_overlay.<locals>.inner_mask")
    c, pad = cells.get("chunk_size"), cells.get("left_padding")
    if not (isinstance(c, int) and c > 0 and isinstance(pad, torch.Tensor)):
        return None
    return c if not bool(pad.any()) else None


def _pattern(fn):
    """(causal, window, chunk, code) for transformers' own mask functions:
    causal, bidirectional, their sliding-window forms and the chunked
    causal one; None for anything else (the caller then builds the dense
    mask).  code: None for the two functions themselves (known by
    identity), else the overlay's code, which _agrees checks once."""
    if fn is _mu.causal_mask_function:
        return True, None, None, None
    if fn is _mu.bidirectional_mask_function:
        return False, None, None, None
    parts = _and_parts(fn)
    if parts is None or len(parts) != 2:
        return None
    overlay, base = parts
    if base is _mu.causal_mask_function:
        c = _overlay_chunk(overlay)
        if c is not None:   # kv // c == q // c, from position 0
            return True, None, c, overlay.__code__
        w = _overlay_width(overlay, "sliding_window_overlay.<locals>."
                                    "inner_mask")
        # kv > q - w: the w positions up to the query, itself included
        return None if w is None else (True, (w - 1, 0), None,
                                       overlay.__code__)
    if base is _mu.bidirectional_mask_function:
        w = _overlay_width(overlay, "sliding_window_bidirectional_overlay."
                                    "<locals>.inner_mask")
        # |q - kv| <= w
        return None if w is None else (False, (w, w), None, overlay.__code__)
    return None


# overlay code _agrees found to be what _pattern says (once per code)
_VERIFIED = set()


def _agrees(fn, causal, window, chunk, q_length, kv_length, q_offset,
            kv_offset):
    """Whether fn, on a few whole query rows (the first, the last and
    evenly spaced ones between), is the pattern (causal, window, chunk)
    says: a guard against a transformers version whose functions
    changed."""
    rows = sorted({0, q_length - 1} |
                  {i * (q_length - 1) // 7 for i in range(1, 7)})
    q = torch.tensor(rows)[:, None] + q_offset
    kv = torch.arange(kv_length)[None, :] + kv_offset
    b = torch.zeros((), dtype=torch.long)
    got = torch.as_tensor(fn(b, b, q, kv)).expand(len(rows), kv_length)
    want = torch.ones(len(rows), kv_length, dtype=torch.bool)
    if causal:
        want &= kv <= q
    if window is not None:
        want &= (kv >= q - window[0]) & (kv <= q + window[1])
    if chunk is not None:
        want &= kv // chunk == q // chunk
    return bool((got == want).all())


def _padding(attention_mask, kv_length, kv_offset):
    """The 2-D padding mask (B, seen tokens) cut to the keys: (key_lengths,
    key_mask), at most one of them set; (None, None) without padding."""
    if attention_mask is None or (
            kv_offset == 0 and attention_mask.shape[-1] == kv_length and
            bool(attention_mask.all())):
        return None, None
    pad = _mu.prepare_padding_mask(attention_mask.to(torch.bool), kv_length,
                                   kv_offset)
    pad = pad[:, kv_offset:kv_offset + kv_length]
    if bool(pad.all()):
        return None, None
    n = pad.sum(1)
    if bool((pad == (torch.arange(kv_length)[None, :] < n[:, None])).all()):
        return n.to(torch.int64), None
    return None, pad.contiguous()


def mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
         kv_offset: int = 0, mask_function: Any = _mu.causal_mask_function,
         attention_mask: Optional[torch.Tensor] = None,
         local_size: Optional[int] = None, allow_is_causal_skip: bool = True,
         allow_is_bidirectional_skip: bool = False, use_vmap: bool = False,
         device: Any = "cpu", **kwargs: Any) -> Optional[torch.Tensor]:
    """transformers' mask hook: a Mask where the mask is one of
    transformers' own patterns on keys that end at the last query, else
    transformers' own dense boolean mask (sdpa_mask)."""
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    pat = _pattern(mask_function)
    if pat is not None:
        causal, window, chunk, code = pat
        aligned = q_offset + q_length == kv_offset + kv_length
        # libmha counts chunks from key 0: the keys must start at position 0
        if (aligned or not (causal or window)) and (
                chunk is None or kv_offset == 0) and (
                code is None or code in _VERIFIED or _agrees(
                    mask_function, causal, window, chunk, q_length,
                    kv_length, q_offset, kv_offset)):
            if code is not None:
                _VERIFIED.add(code)
            lengths, keys = _padding(attention_mask, kv_length, kv_offset)
            if allow_is_causal_skip and causal and window is None and \
                    chunk is None and lengths is None and keys is None and \
                    (q_length == 1 or q_length == kv_length):
                # nothing to mask, as sdpa_mask's skip: attention then
                # sees None (one query row sees every key; a prefill of
                # its own keys is causal, top-left = bottom-right)
                return None
            return Mask((batch_size, 1, q_length, kv_length), causal, window,
                        lengths, keys, chunk)
    return _mu.sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length,
        q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
        attention_mask=attention_mask, local_size=local_size,
        allow_is_causal_skip=allow_is_causal_skip,
        allow_is_bidirectional_skip=allow_is_bidirectional_skip,
        use_vmap=use_vmap, device=device, **kwargs)


def attention(module: torch.nn.Module, query: torch.Tensor,
              key: torch.Tensor, value: torch.Tensor,
              attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
              scaling: Optional[float] = None,
              is_causal: Optional[bool] = None,
              softcap: Optional[float] = None,
              s_aux: Optional[torch.Tensor] = None,
              **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """transformers' attention hook: query (B, H, Lq, d), key and value
    (B, H_kv, Lk, d); returns ((B, Lq, H, d), None) as its sdpa does."""
    Lq, Lk = query.shape[2], key.shape[2]
    m = attention_mask
    if Lq == 1 and not dropout and softcap is None and s_aux is None and (
            m is None or type(m) is Mask and m.window is None and
            m.key_lengths is None and m.chunk is None) and \
            not torch.is_grad_enabled():
        # a decoding step that sees every key (or every key its padding
        # mask keeps): the short way, its output (B, 1, H, d) as libmha
        # writes it (None: the full way below)
        out = _F._sdpa_plain(query, key, value, 0, scaling,
                             key.shape[1] != query.shape[1], rows_out=True,
                             key_mask=None if m is None else m.key_mask)
        if out is not None:
            return out, None
    kw = dict(dropout_p=dropout, scale=scaling,
              enable_gqa=key.shape[1] != query.shape[1], softcap=softcap,
              sinks=None if s_aux is None else s_aux.float())
    if isinstance(attention_mask, Mask):
        m = attention_mask
        # one query that is the last key sees every key: no mask needed
        if m.causal and Lq > 1:
            kw["attn_mask"] = causal_lower_right(Lq, Lk)
        kw.update(window=m.window, key_lengths=m.key_lengths,
                  key_mask=m.key_mask, attention_chunk=m.chunk)
    elif attention_mask is None:
        # as transformers' sdpa: a causal module's prefill is causal
        # (top-left), its keys cut to the queries when a static cache is
        # longer
        causal = is_causal if is_causal is not None else getattr(
            module, "is_causal", True)
        kw["is_causal"] = bool(causal) and Lq > 1
        if kw["is_causal"] and Lk > Lq:
            key, value = key[:, :, :Lq], value[:, :, :Lq]
    else:
        kw["attn_mask"] = attention_mask
    out = _F.scaled_dot_product_attention(query, key, value, **kw)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = "mha") -> str:
    """Register libmha under `name` with transformers' AttentionInterface
    and AttentionMaskInterface: from then on attn_implementation=name (in
    from_pretrained, from_config or set_attn_implementation) runs it."""
    AttentionInterface.register(name, attention)
    _mu.AttentionMaskInterface.register(name, mask)
    return name
