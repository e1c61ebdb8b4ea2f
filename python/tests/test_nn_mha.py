"""mha.nn.MultiheadAttention against torch.nn.MultiheadAttention (2.13):
outputs and every gradient within torch-float32's own error of torch in
float64; state_dict interchange; pickling; training with Adam."""
import copy
import gc
import io
import pickle
import weakref

import numpy as np
import pytest
import torch
from torch import nn

import mha
import mha.nn as mnn
from conftest import check_close


def random_config(r):
    H = int(r.choice([1, 2, 3, 4]))
    dh = int(r.choice([2, 4, 5, 8]))
    cross = r.random() < 0.4
    return dict(embed_dim=H * dh, num_heads=H,
                bias=bool(r.random() < 0.7),
                add_bias_kv=bool(r.random() < 0.3),
                add_zero_attn=bool(r.random() < 0.3),
                kdim=int(r.integers(3, 12)) if cross and r.random() < 0.5
                else None,
                vdim=int(r.integers(3, 12)) if cross and r.random() < 0.5
                else None,
                batch_first=bool(r.random() < 0.5))


def randomize(module, r, scale=0.4):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.from_numpy(
                r.standard_normal(p.shape).astype(np.float32) * scale))


def make_inputs(r, cfg, B, Lq, Lk, self_attn):
    E = cfg["embed_dim"]
    kd = cfg["kdim"] or E
    vd = cfg["vdim"] or E

    def t(*s):
        return torch.from_numpy(r.standard_normal(s).astype(np.float32))

    shape = (lambda L, W: (B, L, W)) if cfg["batch_first"] else \
        (lambda L, W: (L, B, W))
    q = t(*shape(Lq, E))
    if self_attn:
        return q, q, q
    return q, t(*shape(Lk, kd)), t(*shape(Lk, vd))


def random_masks(r, cfg, B, Lq, Lk):
    """attn_mask and key_padding_mask in torch MHA's polarity, leaving
    every query row at least one key (torch gives NaN for the others)."""
    H = cfg["num_heads"]
    am = kpm = None
    choice = r.integers(0, 5)
    if choice == 1:   # bool 2-D, True = blocked
        m = r.random((Lq, Lk)) < 0.3
        m[:, 0] = False
        am = torch.from_numpy(m)
    elif choice == 2:  # bool 3-D (B*H, Lq, Lk)
        m = r.random((B * H, Lq, Lk)) < 0.3
        m[:, :, -1] = False
        am = torch.from_numpy(m)
    elif choice == 3:  # float additive 2-D with some -inf
        m = r.standard_normal((Lq, Lk)).astype(np.float32)
        m[r.random((Lq, Lk)) < 0.2] = -np.inf
        m[:, 0] = 0.5
        am = torch.from_numpy(m)
    if r.random() < 0.5:
        k = r.random((B, Lk)) < 0.3
        k[:, 0] = False
        if am is not None and am.dtype == torch.bool and am.dim() == 3:
            k[:, -1] = False
        kpm = torch.from_numpy(k)
    return am, kpm


def run_case(seed):
    r = np.random.default_rng(seed)
    cfg = random_config(r)
    B, Lq = int(r.integers(1, 4)), int(r.integers(1, 8))
    self_attn = cfg["kdim"] is None and cfg["vdim"] is None and \
        r.random() < 0.5
    Lk = Lq if self_attn else int(r.integers(1, 9))
    ours = mnn.MultiheadAttention(**cfg)
    randomize(ours, r)
    ref = torch.nn.MultiheadAttention(**cfg)
    ref.load_state_dict(ours.state_dict())
    ref64 = copy.deepcopy(ref).double()
    q, k, v = make_inputs(r, cfg, B, Lq, Lk, self_attn)
    am, kpm = random_masks(r, cfg, B, Lq, Lk)
    avg = bool(r.random() < 0.5)
    kw = dict(key_padding_mask=kpm, attn_mask=am, need_weights=True,
              average_attn_weights=avg)
    G = torch.from_numpy(
        r.standard_normal((B, Lq, cfg["embed_dim"])).astype(np.float32))
    if not cfg["batch_first"]:
        G = G.transpose(0, 1)

    def run(module, dtype):
        ins = [x.detach().to(dtype).requires_grad_() for x in
               ((q,) if self_attn else (q, k, v))]
        qq, kk, vv = (ins * 3) if self_attn else ins
        kw2 = dict(kw)
        if am is not None and am.dtype != torch.bool:
            kw2["attn_mask"] = am.to(dtype)
        out, w = module(qq, kk, vv, **kw2)
        params = list(module.parameters())
        grads = torch.autograd.grad((out * G.to(dtype)).sum(),
                                    ins + params)
        return out, w, grads

    o, w, g = run(ours, torch.float32)
    o32, w32, g32 = run(ref, torch.float32)
    o64, w64, g64 = run(ref64, torch.float64)
    name = "seed %d %s" % (seed, cfg)
    check_close(o, o32, o64, 2, name + " out")
    check_close(w, w32, w64, 2, name + " weights")
    names = (["query"] if self_attn else ["query", "key", "value"]) + \
        [n for n, _ in ours.named_parameters()]
    assert len(g) == len(g64)
    for n, a, b, c in zip(names, g, g32, g64):
        check_close(a, b, c, 3, name + " grad " + n, backward=True)


@pytest.mark.parametrize("seed", range(40))
def test_parity_random(seed):
    run_case(seed)


def test_init_matches_torch_under_manual_seed():
    for cfg in (dict(embed_dim=12, num_heads=3),
                dict(embed_dim=8, num_heads=2, kdim=5, vdim=7,
                     add_bias_kv=True),
                dict(embed_dim=8, num_heads=4, bias=False)):
        torch.manual_seed(7)
        a = torch.nn.MultiheadAttention(**cfg)
        torch.manual_seed(7)
        b = mnn.MultiheadAttention(**cfg)
        sa, sb = a.state_dict(), b.state_dict()
        assert list(sa) == list(sb)
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("cfg", [
    dict(embed_dim=8, num_heads=2),
    dict(embed_dim=8, num_heads=2, kdim=3, vdim=5, bias=False),
    dict(embed_dim=6, num_heads=3, add_bias_kv=True, add_zero_attn=True),
])
def test_state_dict_round_trip(cfg):
    r = np.random.default_rng(3)
    t = torch.nn.MultiheadAttention(**cfg, batch_first=True)
    randomize(t, r)
    ours = mnn.MultiheadAttention(**cfg, batch_first=True)
    ours.load_state_dict(t.state_dict())          # torch -> ours
    back = torch.nn.MultiheadAttention(**cfg, batch_first=True)
    back.load_state_dict(ours.state_dict())       # ours -> torch
    for key, val in t.state_dict().items():
        assert torch.equal(back.state_dict()[key], val)
    E = cfg["embed_dim"]
    q = torch.randn(2, 4, E)
    k = torch.randn(2, 5, cfg.get("kdim") or E)
    v = torch.randn(2, 5, cfg.get("vdim") or E)
    torch.testing.assert_close(ours(q, k, v)[0], t(q, k, v)[0],
                               rtol=1e-5, atol=1e-5)
    # a torch.save'd state_dict loads too
    buf = io.BytesIO()
    torch.save(t.state_dict(), buf)
    buf.seek(0)
    again = mnn.MultiheadAttention(**cfg, batch_first=True)
    again.load_state_dict(torch.load(buf))
    assert torch.equal(again(q, k, v)[0], ours(q, k, v)[0])


def test_pickle_and_deepcopy():
    m = mnn.MultiheadAttention(8, 2, add_bias_kv=True, batch_first=True)
    randomize(m, np.random.default_rng(1))
    x = torch.randn(2, 3, 8)
    y = m(x, x, x)[0]  # the libmha module now exists and is not pickled
    m2 = pickle.loads(pickle.dumps(m))
    m3 = copy.deepcopy(m)
    assert torch.equal(m2(x, x, x)[0], y)
    assert torch.equal(m3(x, x, x)[0], y)
    with torch.no_grad():
        m3.out_proj.bias.add_(1.0)
    assert not torch.equal(m3(x, x, x)[0], m(x, x, x)[0])


def test_training_with_adam_matches_torch():
    torch.manual_seed(0)
    E, H, B, L = 16, 4, 4, 6

    class Net(torch.nn.Module):
        def __init__(self, attn_cls):
            super().__init__()
            self.attn = attn_cls(E, H, batch_first=True)
            self.head = torch.nn.Linear(E, 3)

        def forward(self, x, mask):
            y, _ = self.attn(x, x, x, key_padding_mask=mask,
                             need_weights=False)
            return self.head(torch.tanh(y)).mean(1)

    ref = Net(torch.nn.MultiheadAttention)
    ours = Net(mnn.MultiheadAttention)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(B, L, E)
    target = torch.randn(B, 3)
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[1, 4:] = True
    losses = {}
    for name, net in (("ref", ref), ("ours", ours)):
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        losses[name] = []
        for _ in range(8):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x, mask), target)
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    assert losses["ours"][-1] < losses["ours"][0]  # it learns
    np.testing.assert_allclose(losses["ours"], losses["ref"], rtol=2e-4,
                               atol=1e-6)
    for (n, a), (_, b) in zip(ref.named_parameters(),
                              ours.named_parameters()):
        if n == "attn.in_proj_bias":
            # b_k's gradient is exactly zero in exact arithmetic (softmax
            # does not see a constant added to every score of a row), so
            # both libraries' b_k gradients are rounding noise and Adam
            # turns noise into steps of size lr: compare b_q and b_v only
            a = torch.cat([a[:E], a[2 * E:]])
            b = torch.cat([b[:E], b[2 * E:]])
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-4, msg=n)


def test_unbatched_and_seq_first():
    torch.manual_seed(1)
    t = torch.nn.MultiheadAttention(8, 2)
    ours = mnn.MultiheadAttention(8, 2)
    ours.load_state_dict(t.state_dict())
    x = torch.randn(5, 8)      # unbatched (L, E)
    a, wa = t(x, x, x, average_attn_weights=False)
    b, wb = ours(x, x, x, average_attn_weights=False)
    assert b.shape == a.shape and wb.shape == wa.shape
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(wb, wa, rtol=1e-5, atol=1e-6)
    x = torch.randn(5, 3, 8)   # (L, N, E)
    torch.testing.assert_close(ours(x, x, x)[0], t(x, x, x)[0], rtol=1e-5,
                               atol=1e-6)
    assert ours(x, x, x, need_weights=False)[1] is None


def test_is_causal():
    torch.manual_seed(2)
    t = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    ours = mnn.MultiheadAttention(8, 2, batch_first=True)
    ours.load_state_dict(t.state_dict())
    x = torch.randn(2, 5, 8)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5)
    ref = t(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(
        ours(x, x, x, attn_mask=causal, is_causal=True)[0], ref,
        rtol=1e-5, atol=1e-6)
    # without the mask: the causal mask is applied (torch asks for it)
    torch.testing.assert_close(ours(x, x, x, is_causal=True)[0], ref,
                               rtol=1e-5, atol=1e-6)


def test_is_causal_with_a_mask_that_is_not_causal():
    # is_causal is torch's hint that attn_mask is causal; with an explicit
    # mask that is not, the mask alone applies (docs: "with one, the mask
    # is used as given"), never the mask and causal masking together.
    # The oracle: torch's forward with the same mask and no hint.
    torch.manual_seed(3)
    t = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    ours = mnn.MultiheadAttention(8, 2, batch_first=True)
    ours.load_state_dict(t.state_dict())
    x = torch.randn(2, 5, 8)
    mask = torch.zeros(5, 5, dtype=torch.bool)   # True: blocked
    mask[0, 1] = True                            # row 0 keeps later keys
    mask[3, 0] = True
    ref = t(x, x, x, attn_mask=mask, need_weights=False)[0]
    for need_weights in (False, True):
        torch.testing.assert_close(
            ours(x, x, x, attn_mask=mask, is_causal=True,
                 need_weights=need_weights)[0], ref, rtol=1e-5, atol=1e-6)
    with torch.no_grad():   # the short way too
        torch.testing.assert_close(
            ours(x, x, x, attn_mask=mask, is_causal=True,
                 need_weights=False)[0], ref, rtol=1e-5, atol=1e-6)


def test_fully_masked_row_gives_bias_not_nan():
    ours = mnn.MultiheadAttention(8, 2, batch_first=True)
    randomize(ours, np.random.default_rng(5))
    x = torch.randn(1, 3, 8, requires_grad=True)
    mask = torch.zeros(3, 3, dtype=torch.bool)
    mask[1, :] = True   # row 1 sees nothing
    out, w = ours(x, x, x, attn_mask=mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0, 1], ours.out_proj.bias.detach())
    assert (w[0, 1] == 0).all()
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_dropout_training_mode():
    m = mnn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
    x = torch.randn(2, 6, 8, requires_grad=True)
    m.eval()
    ev = m(x, x, x)[0]
    m.train()
    torch.manual_seed(3)
    a, wa = m(x, x, x, average_attn_weights=False)
    torch.manual_seed(3)
    b, wb = m(x, x, x, average_attn_weights=False)
    assert torch.equal(a, b)               # reproducible under manual_seed
    assert not torch.allclose(a, ev)       # and it drops something
    kept = wa[wa != 0]
    assert (wa == 0).any() and kept.numel() > 0
    # the gradient of the dropped forward: the NumPy level, same seed
    torch.manual_seed(3)
    seed = int(torch.randint(0, 2 ** 62, (1,)).item())
    core = mha.Module(8, 2, dropout=0.5)
    core.load_state_dict({k: v.detach().numpy()
                          for k, v in m.state_dict().items()})
    y = core.forward(x.detach().numpy(), training=True, dropout_seed=seed)
    np.testing.assert_array_equal(y, a.detach().numpy())
    g = torch.randn_like(a)
    a.backward(g)
    gn = core.backward(g.numpy(), x.detach().numpy(), training=True,
                       dropout_seed=seed)
    np.testing.assert_allclose(x.grad.numpy(), gn["query"], rtol=1e-6,
                               atol=1e-7)


@pytest.mark.parametrize("seed", range(8))
def test_no_grad_short_way_is_the_same_call(seed):
    """Under no_grad, forward's short way (no masks, no weights) gives the
    bits of the autograd path, for self-, shared-K/V and cross-attention,
    both batch layouts, causal or not; and a parameter replaced or changed
    in place, or set to NaN, is seen there too."""
    r = np.random.default_rng(300 + seed)
    cfg = random_config(r)
    cfg["dropout"] = 0.3        # eval mode: no dropout on either path
    torch.manual_seed(seed)
    m = mnn.MultiheadAttention(**cfg).eval()
    E, kd, vd = m.embed_dim, m.kdim, m.vdim
    B, Lq, Lk = int(r.integers(1, 4)), int(r.integers(1, 7)), \
        int(r.integers(1, 7))
    bf = cfg["batch_first"]

    def t(L, w):
        x = torch.from_numpy(r.standard_normal((B, L, w)).astype(np.float32))
        return x if bf else x.transpose(0, 1)   # seq-first: a view

    if kd == vd == E and seed % 3 == 0:
        q = k = v = t(Lq, E)
    elif kd == vd and seed % 3 == 1:
        q, k = t(Lq, E), t(Lk, kd)
        v = k
    else:
        q, k, v = t(Lq, E), t(Lk, kd), t(Lk, vd)
    causal = bool(seed % 2) and q is k
    ref = m(q, k, v, need_weights=False, is_causal=causal)[0]
    assert ref.requires_grad   # the autograd path ran
    with torch.no_grad():
        out, w = m(q, k, v, need_weights=False, is_causal=causal)
        assert w is None and not out.requires_grad
        assert torch.equal(out, ref.detach())
        m.out_proj.weight.mul_(2.0)                       # in place
        m.out_proj.bias = nn.Parameter(torch.ones(E))     # replaced
    ref2 = m(q, k, v, need_weights=False, is_causal=causal)[0]
    with torch.no_grad():
        assert torch.equal(m(q, k, v, need_weights=False,
                             is_causal=causal)[0], ref2.detach())
        assert not torch.equal(ref2, ref)
        m.out_proj.weight[0, 0] = float("nan")
        with pytest.raises(mha.NonFiniteError):
            m(q, k, v, need_weights=False, is_causal=causal)


def test_short_way_sees_every_parameter_change():
    """forward_fast skips _sync only while every parameter is the view
    _link made, unchanged since: a parameter rebound through .data, a new
    out_proj, load_state_dict and a deep copy are all seen; and the libmha
    module watches its owner weakly (no cycle: the nn module is freed)."""
    torch.manual_seed(6)
    t = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    ours = mnn.MultiheadAttention(8, 2, batch_first=True).eval()
    ours.load_state_dict(t.state_dict())
    x = torch.randn(2, 3, 8)

    def same(a, b):
        with torch.no_grad():
            torch.testing.assert_close(a(x, x, x, need_weights=False)[0],
                                       b(x, x, x, need_weights=False)[0],
                                       rtol=1e-5, atol=1e-6)
    same(ours, t)
    w = torch.randn(8, 8)
    t.out_proj.weight.data = w.clone()                # a new data pointer
    ours.out_proj.weight.data = w.clone()
    same(ours, t)
    lin = nn.Linear(8, 8)
    t.out_proj = lin
    ours.out_proj = copy.deepcopy(lin)                # a new submodule
    same(ours, t)
    sd = {k: torch.randn_like(v) for k, v in t.state_dict().items()}
    t.load_state_dict(sd)
    ours.load_state_dict(sd)
    same(ours, t)
    c, tc = copy.deepcopy(ours), copy.deepcopy(t)
    with torch.no_grad():
        c.in_proj_weight.mul_(0.5)
        tc.in_proj_weight.mul_(0.5)
    same(c, tc)
    same(ours, t)
    keep = ours.in_proj_weight
    ref = weakref.ref(ours)
    del ours
    gc.collect()
    assert ref() is None
    assert torch.isfinite(keep).all()       # the memory lives on with it


def test_parameters_follow_in_place_changes():
    torch.manual_seed(4)
    t = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    ours = mnn.MultiheadAttention(8, 2, batch_first=True)
    ours.load_state_dict(t.state_dict())
    x = torch.randn(1, 4, 8)
    ours(x, x, x)
    with torch.no_grad():
        for p in list(t.parameters()) + list(ours.parameters()):
            p.mul_(1.5)
    torch.testing.assert_close(ours(x, x, x)[0], t(x, x, x)[0], rtol=1e-5,
                               atol=1e-6)


def test_parameters_are_libmha_memory_and_every_change_is_seen():
    """The parameters are views of the libmha module's memory: writes that
    bypass autograd's version counters (.data) are seen too; a parameter
    replaced by another tensor is copied in; NaN written in place after
    the first call is refused; a first call under inference_mode leaves
    ordinary parameters; a changed dropout keeps the values."""
    torch.manual_seed(5)
    t = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    ours = mnn.MultiheadAttention(8, 2, batch_first=True)
    ours.load_state_dict(t.state_dict())
    x = torch.randn(1, 4, 8)

    def same():
        torch.testing.assert_close(ours(x, x, x)[0], t(x, x, x)[0],
                                   rtol=1e-5, atol=1e-6)
    with torch.inference_mode():
        ours(x, x, x)
    same()
    for p in (t.in_proj_weight, ours.in_proj_weight):
        p.data[3:5] *= -2.0                       # no version bump
    same()
    new_b = torch.randn(8)
    t.out_proj.bias = nn.Parameter(new_b.clone())
    ours.out_proj.bias = nn.Parameter(new_b.clone())
    same()
    with torch.no_grad():                           # the copy path follows
        t.out_proj.bias.add_(1.0)
        ours.out_proj.bias.add_(1.0)
    same()
    ours.dropout = 0.25                             # a new libmha module
    ours.eval()
    same()
    with torch.no_grad():
        ours.in_proj_weight[1, 2] = float("inf")
    with pytest.raises(mha.NonFiniteError, match="in_proj_weight"):
        ours(x, x, x)
    with torch.no_grad():
        ours.in_proj_weight[1, 2] = 0.0
        t.in_proj_weight[1, 2] = 0.0
    same()
    # the state_dict's tensors outlive the module safely
    sd = ours.state_dict()
    del ours
    t.load_state_dict(sd)


BAD = [
    ("float64 query", TypeError,
     lambda m, x: m(x.double(), x.double(), x.double())),
    ("int query", TypeError, lambda m, x: m(x.long(), x, x)),
    ("list query", TypeError, lambda m, x: m([1.0], x, x)),
    ("None key", TypeError, lambda m, x: m(x, None, x)),
    ("wrong embed", ValueError, lambda m, x: m(x[..., :7], x, x)),
    ("4-D query", ValueError, lambda m, x: m(x[None], x[None], x[None])),
    ("batch mismatch", ValueError, lambda m, x: m(x, x[:1], x[:1])),
    ("bad mask shape", ValueError,
     lambda m, x: m(x, x, x, attn_mask=torch.zeros(3, 3, dtype=torch.bool))),
    ("int mask", TypeError,
     lambda m, x: m(x, x, x, attn_mask=torch.zeros(4, 4, dtype=torch.int32))),
    ("bad kpm shape", ValueError,
     lambda m, x: m(x, x, x, key_padding_mask=torch.zeros(2, 3,
                                                          dtype=torch.bool))),
    ("NaN additive mask", mha.NonFiniteError,
     lambda m, x: m(x, x, x, attn_mask=torch.full((4, 4), float("nan")))),
]


@pytest.mark.parametrize("name,exc,fn", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs(name, exc, fn):
    m = mnn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 4, 8)
    with pytest.raises(exc):
        fn(m, x)


def test_bad_construction_and_parameters():
    with pytest.raises(ValueError):
        mnn.MultiheadAttention(10, 3)
    with pytest.raises(ValueError):
        mnn.MultiheadAttention(0, 1)
    with pytest.raises(TypeError):
        mnn.MultiheadAttention(8, 2, dtype=torch.float64)
    with pytest.raises(ValueError):
        mnn.MultiheadAttention(8, 2, device="meta")
    m = mnn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 3, 8)
    with torch.no_grad():
        m.in_proj_weight[0, 0] = float("nan")
    with pytest.raises(mha.NonFiniteError, match="in_proj_weight|finite"):
        m(x, x, x)
    m2 = mnn.MultiheadAttention(8, 2, batch_first=True).double()
    with pytest.raises(TypeError):
        m2(x, x, x)


def test_non_cpu_tensor_refused():
    # "meta" tensors have a device and no data: the check must come first
    m = mnn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 3, 8, device="meta")
    with pytest.raises(ValueError, match="CPU"):
        m(x, x, x)
    y = torch.randn(1, 3, 8)
    with pytest.raises(ValueError, match="CPU"):
        m(y, x, x)
