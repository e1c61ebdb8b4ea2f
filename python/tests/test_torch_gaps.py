"""Issue 42's findings from PyTorch users, each against torch 2.13 itself:
mha.nn reachable from ``import mha`` (and torch not imported by it),
mha.nn.MultiheadAttention inside torch's TransformerEncoder(Layer), double
backward refused, empty batches and sequences, the thread count followed
per call, kdim / vdim of 0 refused."""
import copy
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import mha
import mha.nn as mnn
from conftest import check_close


def run_python(code, tmp_path):
    """Runs ``code`` in a fresh interpreter (-P, from an empty directory:
    the installed mha, not python/mha's sources); returns its stdout."""
    r = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


# ---- 6: mha.nn after a plain `import mha`, torch imported only then ---------

def test_mha_nn_is_an_attribute_after_import_mha(tmp_path):
    out = run_python(
        "import mha\n"
        "m = mha.nn.MultiheadAttention(8, 2)\n"
        "f = mha.nn.functional.scaled_dot_product_attention\n"
        "import mha.nn, mha.nn.functional\n"
        "assert m.__class__ is mha.nn.MultiheadAttention\n"
        "assert f is mha.nn.functional.scaled_dot_product_attention\n"
        "from mha import nn\n"
        "assert nn is mha.nn\n"
        "assert 'nn' in dir(mha)\n"
        "print(type(m).__module__)\n", tmp_path)
    assert out.strip() == "mha.nn"


def test_import_mha_alone_does_not_import_torch(tmp_path):
    out = run_python(
        "import sys, mha\n"
        "mha.Module(8, 2)\n"
        "print(sorted(n for n in sys.modules if n == 'torch' or\n"
        "             n.startswith(('torch.', 'mha.nn'))))\n"
        "try:\n"
        "    mha.no_such_name\n"
        "except AttributeError as e:\n"
        "    print(e)\n", tmp_path)
    lines = out.splitlines()
    assert lines[0] == "[]"
    assert "no_such_name" in lines[1]


# ---- helpers: one module, torch's twin in float32 and float64 ---------------

def twins(E=8, H=2, seed=0, **kw):
    """(ours, torch float32, torch float64) holding the same weights, the
    biases made nonzero so that bias-only outputs are visible."""
    torch.manual_seed(seed)
    t32 = nn.MultiheadAttention(E, H, **kw)
    with torch.no_grad():
        for name, p in t32.named_parameters():
            if "bias" in name:
                p.normal_(0.0, 0.5)
    ours = mnn.MultiheadAttention(E, H, **kw)
    ours.load_state_dict(t32.state_dict())
    t64 = nn.MultiheadAttention(E, H, dtype=torch.float64, **kw)
    t64.load_state_dict(t32.state_dict())
    return ours, t32, t64


def leaf(x, dtype=None):
    return x.detach().to(dtype or x.dtype).requires_grad_(True)


# ---- 2: double backward refused, first order as torch's ---------------------

def test_double_backward_raises_and_first_order_matches_torch():
    ours, t32, t64 = twins(batch_first=True)
    x = torch.randn(2, 5, 8)
    results = []
    for m, dtype in ((ours, torch.float32), (t32, torch.float32),
                     (t64, torch.float64)):
        xi = leaf(x, dtype)
        out, _ = m(xi, xi, xi, need_weights=False)
        # a gradient penalty: d/dx of a loss that also holds x**3, so that
        # the first gradient has a graph of its own besides ours
        loss = (out * out).sum() + (xi ** 3).sum()
        gx, gw = torch.autograd.grad(loss, (xi, m.in_proj_weight),
                                     create_graph=True)
        results.append((gx, gw))
        if m is ours:
            # the second-order term through libmha's backward does not
            # exist: refused, not dropped (torch 2.13's own module raises
            # too, its CPU attention kernel having no double backward)
            with pytest.raises(RuntimeError, match="differentiate twice"):
                (gx.pow(2).sum() + gw.pow(2).sum()).backward()
    (ogx, ogw), (tgx, tgw), (rgx, rgw) = results
    check_close(ogx, tgx, rgx, 3, "d loss / d x", backward=True)
    check_close(ogw, tgw, rgw, 3, "d loss / d in_proj_weight", backward=True)


# ---- 5: the thread count read at every call; kdim / vdim of 0 refused -------

class RecordingCore:
    """Stands in for a module's libmha handle and records the num_threads
    of every call that computes (run: forward or backward; forward_fast:
    the short way, its 6th argument)."""

    def __init__(self, core):
        self._core = core
        self.threads = []

    def run(self, **kw):
        self.threads.append(kw.get("num_threads", 0))
        return self._core.run(**kw)

    def forward_fast(self, *args):
        self.threads.append(args[5])
        return self._core.forward_fast(*args)

    def __getattr__(self, name):
        return getattr(self._core, name)


def test_thread_count_follows_torch_set_num_threads():
    ours, _, _ = twins(batch_first=True)
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        ours(x, x, x)                       # the libmha module is made
    rec = ours._core = RecordingCore(ours._core)
    before = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            with torch.no_grad():
                fast, _ = ours(x, x, x, need_weights=False)   # short way
                full, w = ours(x, x, x)                     # full way
            xg = leaf(x)
            out, _ = ours(xg, xg, xg, need_weights=False)   # autograd
            out.backward(torch.ones_like(out))
            results.append((fast, full, w, out.detach(), xg.grad,
                            ours.in_proj_weight.grad.clone()))
            ours.zero_grad()
    finally:
        torch.set_num_threads(before)
    # four calls per count (short, full, autograd forward, backward), each
    # given torch's count of that moment, the second 1 after a 2 included
    assert rec.threads == [1] * 4 + [2] * 4 + [1] * 4
    for r in results[1:]:                   # the same bits for every count
        for a, b in zip(results[0], r):
            assert torch.equal(a, b)


@pytest.mark.parametrize("which", ["kdim", "vdim"])
@pytest.mark.parametrize("value", [0, -3])
def test_kdim_vdim_below_one_refused(which, value):
    with pytest.raises(ValueError, match=which):
        mnn.MultiheadAttention(8, 2, **{which: value})


def test_kdim_not_an_integer_refused():
    with pytest.raises(TypeError, match="kdim"):
        mnn.MultiheadAttention(8, 2, kdim=2.5)


# ---- 1: inside torch's TransformerEncoderLayer and TransformerEncoder -------

E_T, H_T, L_T = 16, 4, 7
LENGTHS = (7, 5, 3)          # right padding, as torch's nested path wants


def count_calls(attn):
    """Counts the calls of attn.forward (an instance attribute: a forward
    hook would itself turn torch's fast path off)."""
    attn.calls = 0
    forward = attn.forward

    def counted(*args, **kw):
        attn.calls += 1
        return forward(*args, **kw)
    attn.forward = counted
    return attn


def ours_in(layer):
    """layer's self_attn replaced by mha.nn's with the same weights."""
    t = layer.self_attn
    m = mnn.MultiheadAttention(E_T, H_T, dropout=0.0, batch_first=True)
    m.load_state_dict(t.state_dict())
    layer.self_attn = count_calls(m)
    return m


def torch_layer(seed):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(E_T, H_T, dim_feedforward=32,
                                       dropout=0.0, batch_first=True)
    with torch.no_grad():
        layer.self_attn.in_proj_bias.normal_(0.0, 0.5)
        layer.self_attn.out_proj.bias.normal_(0.0, 0.5)
    return layer


def stack(kind, seed=3):
    """(ours, torch float32, torch float64, our attention modules).
    kind 'layer': one TransformerEncoderLayer; 'encoder_after': a
    TransformerEncoder of torch's layers whose self_attn are replaced
    afterwards (it decided on its nested-tensor path in __init__, with
    torch's module); 'encoder_before': one built from a layer that holds
    ours already."""
    t32 = torch_layer(seed)
    if kind == "layer":
        ours = copy.deepcopy(t32)
        attns = [ours_in(ours)]
    elif kind == "encoder_after":
        t32 = nn.TransformerEncoder(t32, 2)
        ours = copy.deepcopy(t32)
        attns = [ours_in(layer) for layer in ours.layers]
    else:
        t32 = nn.TransformerEncoder(t32, 2)
        ours = copy.deepcopy(t32)
        proto = copy.deepcopy(t32.layers[0])
        ours_in(proto)
        with warnings.catch_warnings():   # "enable_nested_tensor is True,
            warnings.simplefilter("ignore")  # but ... was not True"
            ours = nn.TransformerEncoder(proto, 2)
        attns = [layer.self_attn for layer in ours.layers]
        for a in attns:
            count_calls(a)
        ours.load_state_dict(t32.state_dict())
    t64 = copy.deepcopy(t32).double()
    return ours, t32, t64, attns


def masks(which):
    pad = torch.arange(L_T)[None, :] >= torch.tensor(LENGTHS)[:, None]
    causal = torch.ones(L_T, L_T, dtype=torch.bool).triu(1)  # True: blocked
    return dict(src_key_padding_mask=pad if "pad" in which else None,
                mask=causal if "causal" in which else None,
                is_causal="causal" in which), ~pad


def call(model, x, m):
    if isinstance(model, nn.TransformerEncoderLayer):
        return model(x, src_mask=m["mask"],
                     src_key_padding_mask=m["src_key_padding_mask"],
                     is_causal=m["is_causal"])
    return model(x, **m)


NESTED_WARNING = "ignore:The PyTorch API of nested tensors"   # torch's own


@pytest.mark.filterwarnings(NESTED_WARNING)
@pytest.mark.parametrize("kind", ["layer", "encoder_after", "encoder_before"])
@pytest.mark.parametrize("which", ["pad", "causal", "pad+causal"])
def test_transformer_encoder_eval_no_grad(kind, which):
    """torch's fast path (eval + no_grad) declines, and libmha computes the
    attention: the output within 2x torch float32's own error of torch
    float64 (conftest's rule), on the rows of real tokens (torch leaves
    the padded rows' output unspecified: its nested path writes 0 there,
    its dense path computes them)."""
    ours, t32, t64, attns = stack(kind)
    x = torch.randn(len(LENGTHS), L_T, E_T)
    m, real = masks(which)
    outs = []
    for model, dtype in ((ours, torch.float32), (t32, torch.float32),
                         (t64, torch.float64)):
        model.eval()
        mi = {k: v.to(dtype) if isinstance(v, torch.Tensor) and
              v.is_floating_point() else v for k, v in m.items()}
        with torch.no_grad():
            outs.append(call(model, x.to(dtype), mi)[real])
    assert [a.calls for a in attns] == [1] * len(attns)
    check_close(*outs, 2, "%s, %s: output" % (kind, which))


@pytest.mark.parametrize("kind", ["layer", "encoder_after"])
@pytest.mark.parametrize("which", ["pad", "pad+causal"])
def test_transformer_encoder_train_with_grad(kind, which):
    """Training mode with autograd (dropout 0): the output within 2x and
    the gradients of the input and of every parameter within 3x torch
    float32's error of torch float64 (conftest's rules), the loss taken
    on the rows of real tokens."""
    ours, t32, t64, attns = stack(kind)
    x = torch.randn(len(LENGTHS), L_T, E_T)
    g = torch.randn(len(LENGTHS), L_T, E_T)
    m, real = masks(which)
    res = []
    for model, dtype in ((ours, torch.float32), (t32, torch.float32),
                         (t64, torch.float64)):
        model.train()
        mi = {k: v.to(dtype) if isinstance(v, torch.Tensor) and
              v.is_floating_point() else v for k, v in m.items()}
        xi = leaf(x, dtype)
        out = call(model, xi, mi)
        (out * g.to(dtype) * real[..., None]).sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        res.append((out[real], xi.grad, grads))
    assert [a.calls for a in attns] == [1] * len(attns)
    (o, gx, gp), (o32, gx32, gp32), (o64, gx64, gp64) = res
    check_close(o, o32, o64, 2, "output")
    check_close(gx, gx32, gx64, 3, "d/d src", backward=True)
    assert gp.keys() == gp64.keys()
    for n in gp:
        check_close(gp[n], gp32[n], gp64[n], 3, "d/d " + n, backward=True)


@pytest.mark.filterwarnings(NESTED_WARNING)
def test_nested_input_as_torch_module():
    """Nested tensors (what TransformerEncoder's nested path gives its
    layers) straight into the module, against torch's module on the same
    nested tensors: each sequence's output within 2x torch float32's error
    of torch float64."""
    ours, t32, t64 = twins(E_T, H_T, batch_first=True)
    seqs = [torch.randn(n, E_T) for n in LENGTHS]
    outs = []
    for m, dtype in ((ours, torch.float32), (t32, torch.float32),
                     (t64, torch.float64)):
        m.eval()
        x = torch.nested.nested_tensor([t.to(dtype) for t in seqs])
        with torch.no_grad():
            out, _ = m(x, x, x, need_weights=False)
        assert out.is_nested
        assert [t.shape for t in out.unbind()] == [t.shape for t in seqs]
        outs.append(torch.cat(out.unbind()))
    check_close(*outs, 2, "nested output")


@pytest.mark.filterwarnings(NESTED_WARNING)
def test_nested_input_refused_where_torch_refuses_it():
    ours, _, _ = twins(E_T, H_T, batch_first=True)
    x = torch.nested.nested_tensor([torch.randn(n, E_T) for n in LENGTHS])
    with pytest.raises(ValueError, match="autograd"):
        ours(x, x, x)                       # the parameters require grad
    with torch.no_grad():
        with pytest.raises(ValueError, match="attn_mask"):
            ours(x, x, x, attn_mask=torch.zeros(L_T, L_T, dtype=torch.bool))
        with pytest.raises(ValueError, match="all nested"):
            ours(x, torch.randn(3, L_T, E_T), torch.randn(3, L_T, E_T))


# ---- 3: empty batches and sequences -----------------------------------------

EMPTY = [(0, 4, 5), (2, 0, 5), (2, 4, 0), (0, 0, 0)]     # (B, L, S)
CONFIGS = {"plain": {}, "bias_kv+zero_attn": dict(add_bias_kv=True,
                                                   add_zero_attn=True),
           "kdim_vdim": dict(kdim=5, vdim=3)}
F32, F64 = torch.float32, torch.float64


def compare(ours, t32, t64, what):
    """Each output or gradient of ours against torch's: the same shape
    and None-ness, values within conftest's bounds (2x torch float32's
    error for outputs, 3x for gradients; empty and exactly-zero tensors
    have bound 0, so they must be exact)."""
    for name, a, b, c in zip(what, ours, t32, t64):
        if c is None:
            assert a is None and b is None, name
            continue
        grad = name.startswith("d")
        check_close(a, b, c, 3 if grad else 2, name, backward=grad)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("shape", EMPTY, ids=["B0", "L0", "S0", "all0"])
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_nn_empty_batch_and_lengths_as_torch(cfg, shape, batch_first):
    """Batch 0, query length 0, key length 0: outputs, weights (averaged
    and per head) and every gradient as torch 2.13's (whose key length 0
    gives out_proj.bias, libmha's rule for a row with no key: no NaN),
    with and without (empty) masks, autograd and the no-grad short way."""
    ours, t32, t64 = twins(batch_first=batch_first, **CONFIGS[cfg])
    B, L, S = shape
    kd, vd = ours.kdim, ours.vdim

    def t(n, w):
        return torch.randn((B, n, w) if batch_first else (n, B, w))
    q, k, v, g = t(L, 8), t(S, kd), t(S, vd), t(L, 8)
    masks = dict(key_padding_mask=torch.zeros(B, S, dtype=torch.bool),
                 attn_mask=torch.zeros(L, S, dtype=torch.bool))
    for mk in ({}, masks):
        for avg in (True, False):
            res = []
            for m, dt in ((ours, F32), (t32, F32), (t64, F64)):
                m.zero_grad(set_to_none=True)
                qi, ki, vi = leaf(q, dt), leaf(k, dt), leaf(v, dt)
                out, w = m(qi, ki, vi, average_attn_weights=avg, **mk)
                (out * g.to(dt)).sum().backward()
                res.append([out, w, qi.grad, ki.grad, vi.grad] +
                           [p.grad for _, p in m.named_parameters()])
            names = ["out", "weights", "dquery", "dkey", "dvalue"] + \
                ["d" + n for n, _ in t64.named_parameters()]
            compare(*res, names)
    res = []
    for m, dt in ((ours, F32), (t32, F32), (t64, F64)):
        m.eval()
        with torch.no_grad():
            res.append(m(q.to(dt), k.to(dt), v.to(dt), need_weights=False))
    compare(*res, ["out (no grad)", "weights (none)"])


@pytest.mark.parametrize("shape", [(0, 4), (2, 0), (0, 0)])
def test_nn_empty_self_attention_and_unbatched(shape):
    ours, t32, t64 = twins(batch_first=True)
    B, L = shape
    x, g = torch.randn(B, L, 8), torch.randn(B, L, 8)
    res = []
    for m, dt in ((ours, F32), (t32, F32), (t64, F64)):
        xi = leaf(x, dt)
        out, w = m(xi, xi, xi)
        (out * g.to(dt)).sum().backward()
        res.append([out, w, xi.grad, m.in_proj_weight.grad])
        if B:                                   # unbatched: (L, E)
            x1 = leaf(x[0], dt)
            o1, w1 = m(x1, x1, x1)
            k0 = torch.zeros(0, 8, dtype=dt)
            o2, w2 = m(x1, k0, k0)              # no key: (L, E) of bias
            res[-1] += [o1, w1, o2, w2]
    compare(*res, ["out", "weights", "dx", "din_proj_weight", "out 2-D",
                   "weights 2-D", "out 2-D, S=0", "weights 2-D, S=0"])


def numpy_twin(cfg):
    """mha.Module holding the weights of twins(batch_first=True, **cfg)."""
    _, t32, t64 = twins(batch_first=True, **CONFIGS[cfg])
    c = CONFIGS[cfg]
    m = mha.Module(8, 2, kdim=c.get("kdim"), vdim=c.get("vdim"),
                   add_bias_kv=c.get("add_bias_kv", False),
                   add_zero_attn=c.get("add_zero_attn", False))
    m.load_state_dict({n: p.numpy() for n, p in t32.state_dict().items()})
    return m, t32, t64


@pytest.mark.parametrize("shape", EMPTY, ids=["B0", "L0", "S0", "all0"])
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_numpy_module_empty_as_torch(cfg, shape):
    """mha.Module.forward / backward with batch 0, query length 0 and a key
    of 0 rows (libmha's kv_len 0 means "as many as the queries": the key's
    real length must be what counts), against torch's module."""
    m, t32, t64 = numpy_twin(cfg)
    B, L, S = shape
    r = np.random.default_rng(1)

    def a(*s):
        return r.standard_normal(s).astype(np.float32)
    q, k, v, g = a(B, L, 8), a(B, S, m.kdim), a(B, S, m.vdim), a(B, L, 8)
    for weights in ("average", "per_head"):
        out, w = m.forward(q, k, v, need_weights=weights)
        grads = m.backward(g, q, k, v)
        res = [[out, w, grads["query"], grads["key"], grads["value"]] +
               [grads["params"][n] for n in m.parameter_names()]]
        for t, dt in ((t32, F32), (t64, F64)):
            t.zero_grad(set_to_none=True)
            qi, ki, vi = (leaf(torch.from_numpy(x), dt) for x in (q, k, v))
            o, wt = t(qi, ki, vi, average_attn_weights=weights == "average")
            (o * torch.from_numpy(g).to(dt)).sum().backward()
            params = dict(t.named_parameters())
            res.append([o, wt, qi.grad, ki.grad, vi.grad] +
                       [params[n].grad for n in m.parameter_names()])
        compare(*res, ["out", "weights", "dquery", "dkey", "dvalue"] +
                ["d" + n for n in m.parameter_names()])


@pytest.mark.parametrize("shape", EMPTY, ids=["B0", "L0", "S0", "all0"])
def test_numpy_attention_empty_as_sdpa(shape):
    """mha.attention / attention_backward with batch 0, query length 0 and
    key length 0, against torch's scaled_dot_product_attention (which
    gives zeros for a key of 0 rows); the lse of a row with no key is
    -inf (log of an empty sum), per head weights of 0 columns."""
    B, L, S = shape
    H, dh = 2, 4
    r = np.random.default_rng(2)

    def a(*s):
        return r.standard_normal(s).astype(np.float32)
    q, k, v, g = a(B, L, H * dh), a(B, S, H * dh), a(B, S, H * dh), \
        a(B, L, H * dh)
    out, w, lse = mha.attention(q, k, v, num_heads=H,
                                need_weights="per_head", return_lse=True)
    gq, gk, gv = mha.attention_backward(g, q, k, v, num_heads=H)
    res = [[out, w, gq, gk, gv]]

    def heads(x, dt):                       # (B, L, H*dh) -> (B, H, L, dh)
        t = torch.from_numpy(x).to(dt)
        return t.reshape(t.shape[0], t.shape[1], H, dh).transpose(1, 2)

    def rows(t):                            # back to (B, L, H*dh)
        return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], H * dh)
    for dt in (F32, F64):
        qi, ki, vi = (leaf(heads(x, dt)) for x in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi)
        (rows(o) * torch.from_numpy(g).to(dt)).sum().backward()
        p = torch.softmax(qi @ ki.transpose(-1, -2) / dh ** 0.5, -1)
        res.append([rows(o), p, rows(qi.grad), rows(ki.grad),
                    rows(vi.grad)])
    compare(*res, ["out", "weights", "dq", "dk", "dv"])
    assert lse.shape == (B, H, L)
    if S == 0:
        assert np.all(lse == -np.inf)


def test_empty_problems_still_check_their_arguments():
    m, _, _ = numpy_twin("plain")
    q0, k0 = np.zeros((0, 4, 8), np.float32), np.zeros((0, 5, 8), np.float32)
    with pytest.raises(ValueError, match="attn_mask"):
        m.forward(q0, k0, k0, attn_mask=mha.block(np.zeros((4, 6), bool)))
    with pytest.raises(ValueError, match="key_padding_mask"):
        m.forward(q0, k0, k0,
                  key_padding_mask=mha.block(np.zeros((3, 5), bool)))
    q, ke = np.ones((2, 4, 8), np.float32), np.zeros((2, 0, 8), np.float32)
    with pytest.raises(ValueError, match="key_lengths"):
        m.forward(q, ke, ke, key_lengths=[1, 0])
    with pytest.raises(ValueError, match="attn_mask"):
        mha.attention(q, ke, ke, num_heads=2,
                      attn_mask=mha.block(np.zeros((4, 1), bool)))
    # what an empty key's masks may say: nothing (no column to block)
    out = m.forward(q, ke, ke, attn_mask=mha.block(np.zeros((4, 0), bool)),
                    key_padding_mask=mha.block(np.zeros((2, 0), bool)),
                    key_lengths=[0, 0])
    assert np.array_equal(out, np.broadcast_to(m["out_proj.bias"],
                                               out.shape))
