"""mha.nn.MultiheadAttention moved to bfloat16 or float16 (module.to(dtype)),
as torch's own module is: libmha's 16-bit forward (forward16.c) and
backward (backward16.c) against float64 on the rounded inputs and
parameters (torch's module in float64 with the 16-bit module's values),
within 2x the error torch 2.13's module makes in that dtype on the same
inputs (docs/TESTING.md's rule for every half-precision path).  Attention
weights and dropout are refused by name."""
import pytest
import torch

from mha import nn as mnn

CASES = [  # E, H, kdim, vdim, B, Lq, Lk (0: self-attention), mask
    (256, 4, None, None, 2, 50, 0, None),
    (256, 4, None, None, 2, 50, 0, "causal"),
    (256, 4, None, None, 3, 41, 0, "padding"),
    (128, 4, 96, 160, 2, 20, 45, "padding"),
    (96, 3, None, None, 1, 70, 0, "float"),   # d_h 32, an additive mask
    (80, 2, None, None, 2, 33, 0, None),      # d_h 40: attention widened
]


def _pair(E, H, kdim, vdim, dtype, seed):
    torch.manual_seed(seed)
    t = torch.nn.MultiheadAttention(E, H, kdim=kdim, vdim=vdim,
                                    batch_first=True).eval()
    with torch.no_grad():   # biases too (torch starts them at zero)
        for p in t.parameters():
            p.uniform_(-0.3, 0.3)
    t = t.to(dtype)
    m = mnn.MultiheadAttention(E, H, kdim=kdim, vdim=vdim,
                               batch_first=True).eval().to(dtype)
    m.load_state_dict(t.state_dict())
    ref = torch.nn.MultiheadAttention(E, H, kdim=kdim, vdim=vdim,
                                      batch_first=True).eval().double()
    ref.load_state_dict({k: v.double() for k, v in t.state_dict().items()})
    return t, m, ref


def _masks(kind, B, Lq, Lk, g):
    if kind == "causal":
        return torch.ones(Lq, Lk, dtype=torch.bool).triu(1), None
    if kind == "float":
        return torch.rand(Lq, Lk, generator=g) * 2 - 1, None
    if kind == "padding":
        pad = torch.rand(B, Lk, generator=g) < 0.3
        pad[:, 0] = False
        return None, pad
    return None, None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_module_half_within_twice_torch(dtype, case):
    E, H, kdim, vdim, B, Lq, Lk, kind = case
    t, m, ref = _pair(E, H, kdim, vdim, dtype, 5)
    g = torch.Generator().manual_seed(7)
    q = (torch.rand(B, Lq, E, generator=g) * 2 - 1).to(dtype)
    if Lk:
        k = (torch.rand(B, Lk, kdim, generator=g) * 2 - 1).to(dtype)
        v = (torch.rand(B, Lk, vdim, generator=g) * 2 - 1).to(dtype)
    else:
        k = v = q
    am, kpm = _masks(kind, B, Lq, Lk or Lq, g)
    with torch.no_grad():
        want = ref(q.double(), k.double(), v.double(), need_weights=False,
                   attn_mask=None if am is None else
                   (am if am.dtype == torch.bool else am.double()),
                   key_padding_mask=kpm)[0]
        theirs = t(q, k, v, need_weights=False,
                   attn_mask=None if am is None else am.to(
                       torch.bool if am.dtype == torch.bool else dtype),
                   key_padding_mask=kpm)[0]
        got = m(q, k, v, need_weights=False, attn_mask=am,
                key_padding_mask=kpm)[0]
    assert got.dtype == dtype and got.shape == want.shape
    err = (got.double() - want).abs().max().item()
    torch_err = (theirs.double() - want).abs().max().item()
    assert torch_err > 0
    assert err <= 2 * torch_err, (err, torch_err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_module_half_gradients_within_twice_torch(dtype, case):
    """dL/d query, key, value and every parameter of L = sum(out * G):
    ours and torch's 16-bit module against float64, each tensor's largest
    error within 2x torch's (ours: float32 sums rounded at torch's points,
    the parameters' gradients rounded to the dtype once)."""
    E, H, kdim, vdim, B, Lq, Lk, kind = case
    t, m, ref = _pair(E, H, kdim, vdim, dtype, 5)
    for mod in (t, m, ref):
        mod.train()   # (dropout 0: nothing changes but the mode)
    g = torch.Generator().manual_seed(7)
    q = (torch.rand(B, Lq, E, generator=g) * 2 - 1).to(dtype)
    k = v = None
    if Lk:
        k = (torch.rand(B, Lk, kdim, generator=g) * 2 - 1).to(dtype)
        v = (torch.rand(B, Lk, vdim, generator=g) * 2 - 1).to(dtype)
    G = (torch.rand(B, Lq, E, generator=g) * 2 - 1).to(dtype)
    am, kpm = _masks(kind, B, Lq, Lk or Lq, g)

    def grads(mod, dt, mask_dt):
        xs = [x.to(dt).requires_grad_() if x is not None else None
              for x in (q, k, v)]
        qq, kk, vv = xs
        if kk is None:
            kk = vv = qq
        mask = None if am is None else (
            am if am.dtype == torch.bool else am.to(mask_dt))
        out = mod(qq, kk, vv, need_weights=False, attn_mask=mask,
                  key_padding_mask=kpm)[0]
        (out.double() * G.double()).sum().backward()
        got = [x.grad for x in xs if x is not None]
        got += [p.grad for p in mod.parameters()]
        mod.zero_grad(set_to_none=True)
        return got

    want = grads(ref, torch.float64, torch.float64)
    theirs = grads(t, dtype, dtype)
    ours = grads(m, dtype, torch.float32)
    names = ["query", "key", "value"][:1 if not Lk else 3]
    names += [n for n, _ in m.named_parameters()]
    assert len(ours) == len(want) == len(theirs) == len(names)
    for n, o, th, w in zip(names, ours, theirs, want):
        assert o.dtype == dtype and o.shape == w.shape, n
        err = (o.double() - w).abs().max().item()
        torch_err = (th.double() - w).abs().max().item()
        assert torch_err > 0, n
        assert err <= 2 * torch_err, (n, err, torch_err)


def test_module_half_training_step_threads_and_double_backward():
    """A bf16 training step: the same gradient bits for 1, 2 and 3
    threads, an optimizer step that the next forward computes with, and a
    second derivative refused by name."""
    _, m, _ = _pair(128, 4, None, None, torch.bfloat16, 3)
    m.train()
    x = torch.rand(2, 30, 128).to(torch.bfloat16)
    n = torch.get_num_threads()
    got = []
    try:
        for th in (1, 2, 3):
            torch.set_num_threads(th)
            xx = x.clone().requires_grad_()
            m(xx, xx, xx, need_weights=False)[0].float().sum().backward()
            got.append([xx.grad] + [p.grad for p in m.parameters()])
            m.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(n)
    for other in got[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got[0], other))
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    before = m(x, x, x, need_weights=False)[0].detach()
    m(x, x, x, need_weights=False)[0].float().sum().backward()
    opt.step()
    with torch.no_grad():
        after = m(x, x, x, need_weights=False)[0]
    assert not torch.equal(before, after)
    xx = x.clone().requires_grad_()
    out = m(xx, xx, xx, need_weights=False)[0]
    (gx,) = torch.autograd.grad(out.float().sum(), xx, create_graph=True)
    with pytest.raises(RuntimeError):
        gx.float().sum().backward()


def test_module_half_threads_layouts_and_updates():
    t, m, _ = _pair(256, 4, None, None, torch.bfloat16, 9)
    x = torch.rand(2, 40, 256).to(torch.bfloat16)
    n = torch.get_num_threads()
    try:
        outs = []
        with torch.no_grad():
            for th in (1, 2, 3):
                torch.set_num_threads(th)
                outs.append(m(x, x, x, need_weights=False)[0])
    finally:
        torch.set_num_threads(n)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    with torch.no_grad():
        # sequence-first and unbatched inputs, as torch's module takes them
        seq = mnn.MultiheadAttention(256, 4).eval().to(torch.bfloat16)
        seq.load_state_dict(m.state_dict())
        xs = x.transpose(0, 1)
        assert torch.equal(seq(xs, xs, xs, need_weights=False)[0],
                           outs[0].transpose(0, 1))
        assert torch.equal(m(x[1], x[1], x[1], need_weights=False)[0],
                           m(x[1:], x[1:], x[1:], need_weights=False)[0][0])
        # a parameter changed in place is what the next call computes with
        m.out_proj.bias.add_(1.0)
        t.out_proj.bias.add_(1.0)
        moved = m(x, x, x, need_weights=False)[0]
        assert (moved.double() - outs[0].double()).mean().item() == \
            pytest.approx(1.0, abs=0.02)


def test_module_half_refusals():
    _, m, _ = _pair(64, 2, None, None, torch.bfloat16, 1)
    x = torch.rand(1, 8, 64).to(torch.bfloat16)
    with torch.no_grad():
        with pytest.raises(NotImplementedError, match="need_weights"):
            m(x, x, x)   # torch's default need_weights=True
        with pytest.raises(TypeError, match="bfloat16"):
            m(x.float(), x.float(), x.float(), need_weights=False)
        m.train()
        m.dropout = 0.1
        with pytest.raises(NotImplementedError, match="dropout"):
            m(x, x, x, need_weights=False)
        m.eval()
    # a module moved back to float32 computes in float32 again
    m.dropout = 0.0
    m32 = m.float()
    with torch.no_grad():
        y = m32(x.float(), x.float(), x.float(), need_weights=False)[0]
    assert y.dtype == torch.float32
