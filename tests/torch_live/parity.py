#!/usr/bin/python3
"""parity.py -- live parity of `mha` with PyTorch's nn.MultiheadAttention.

    /usr/bin/python3 parity.py MHA_BINARY TORCH_LIVE_DRIVER

The user's flow, for seeded random configurations: build
torch.nn.MultiheadAttention(batch_first=True) with random biases, save its
state_dict as safetensors (st.py), save the inputs with numpy.save, run
`mha forward` (or torch_live_driver, the same through the C API), load the
outputs with numpy.load.  And the reverse: `mha init` -> st.py -> torch
load_state_dict(strict=True) -> the same comparison.

The reference is the same torch module deep-copied to float64 on the same
(float32-valued) inputs.  For every output the test requires

    max|mha - ref64| <= 2 * max|torch32 - ref64| + 1e-6 * (1 + max|ref64|)

over the entries where ref64 is not NaN.  Where ref64 is NaN (a query row
whose every key is masked: PyTorch 1.13 gives NaN), mha's output row must be
out_proj.bias (0 without bias) and its weights 0.

The backward, through torch_live_driver (mha_plan_forward +
mha_plan_backward, checked bitwise against mha_backward): for seeded random
configurations and a random G, torch autograd's gradients of sum(out * G)
(every parameter, query, key, value; summed where one tensor serves as
several inputs), float32 and float64, against the driver's, for every
gradient tensor separately:

    max|mha - ref64| <= 3 * max|torch32 - ref64| + FLT_EPSILON * max|ref64|

(within 3 x torch-float32's own error; the floor is one float32 epsilon of
the largest value).  Where a query row has no key, torch's gradients are
NaN; the reference is then the documented semantics (the row gives
out_proj.bias and contributes zero gradients), computed by torch autograd
as in tests/fixtures/make_torch_fixtures.py: the masks merged into one
additive mask, those rows unblocked, G zero on them, and
grad out_proj.bias += their G.

Prints one line per case with error / bound, then `N passed, M failed`;
exits non-zero on any failure.
"""
import copy
import math
import os
import subprocess
import sys
import tempfile
import time

try:
    import numpy as np
    import torch
    import torch.nn.functional as F
except ImportError as e:  # CI installs python3-torch: its absence is a failure
    print("torch_live_parity: FAILED: cannot import torch / numpy (%s).\n"
          "Install Debian's python3-torch and python3-numpy "
          "(scripts/install-deps.sh) and run this with /usr/bin/python3." % e)
    sys.exit(1)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402

torch.set_num_threads(1)

if len(sys.argv) != 3:
    print("usage: parity.py MHA_BINARY TORCH_LIVE_DRIVER")
    sys.exit(2)
MHA, DRIVER = sys.argv[1], sys.argv[2]

passes = 0
fails = 0
worst = {"out": 0.0, "weights": 0.0, "grads": 0.0}
FLT_EPSILON = float(np.finfo(np.float32).eps)


class CaseFailure(Exception):
    pass


# ---------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------

def compare(what, got, t32, ref, factor=2.0, floor_rel=1e-6, floor_abs=1e-6,
            kind=None):
    """Checks mha (got) against ref64 with the bound set by torch32:
    factor * max|t32 - ref| + floor_rel * max|ref| + floor_abs.
    Returns the ratio error / bound (NaN entries of ref are skipped)."""
    if got.shape != ref.shape:
        raise CaseFailure("%s: mha shape %s, torch shape %s"
                          % (what, got.shape, ref.shape))
    fin = ~np.isnan(ref)
    if not fin.any():
        return 0.0
    if not np.isfinite(got[fin]).all():
        raise CaseFailure("%s: mha gives NaN/Inf where torch float64 is finite"
                          % what)
    err = float(np.max(np.abs(got[fin].astype(np.float64) - ref[fin])))
    err_t = float(np.max(np.abs(t32[fin].astype(np.float64) - ref[fin])))
    bound = (factor * err_t + floor_rel * float(np.max(np.abs(ref[fin])))
             + floor_abs)
    ratio = err / bound if bound > 0 else (0.0 if err == 0 else float("inf"))
    kind = kind or what
    worst[kind] = max(worst[kind], ratio)
    if ratio > 1.0:
        idx = np.unravel_index(np.argmax(np.where(
            fin, np.abs(got.astype(np.float64) - np.nan_to_num(ref)), -1)),
            ref.shape)
        raise CaseFailure("%s: error %.3g > bound %.3g (torch32 error %.3g); "
                          "worst at %s: mha %r, ref %r"
                          % (what, err, bound, err_t, idx, float(got[idx]),
                             float(ref[idx])))
    return ratio


def check_masked_rows(out, w, ref_out, ref_w, out_bias, E):
    """Where torch float64 is NaN: the output row is out_proj.bias, the
    weights row is 0.  Returns how many NaN rows were checked."""
    rows = np.isnan(ref_out).any(axis=-1)        # (B, Lq) or (Lq)
    n = int(rows.sum())
    if n:
        want = out_bias if out_bias is not None else np.zeros(E, np.float32)
        got = out[rows]
        if not np.array_equal(got, np.broadcast_to(want, got.shape)):
            raise CaseFailure("fully masked rows: output %s, expected "
                              "out_proj.bias %s"
                              % (got.tolist()[:2], want.tolist()))
    if w is not None:
        wrows = np.isnan(ref_w).any(axis=-1)
        if wrows.any():
            if not (w[wrows] == 0).all():
                raise CaseFailure("fully masked rows: weights %s, expected 0"
                                  % w[wrows].tolist()[:2])
    return n


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------

def pick_dims(rng, E=None, H=None):
    if E is None:
        H = int(rng.choice([1, 2, 3, 4]))
        E = H * int(rng.choice([2, 3, 4, 5, 8]))
    return E, H


def ensure_allowed(blocked, real, rng):
    """blocked: (..., Lq, Lk) bool, real: broadcastable (..., 1, Lk) bool.
    Unblocks one real key in every row that has none left."""
    eff = blocked | ~real
    empty = eff.all(axis=-1)
    for idx in zip(*np.nonzero(empty)):
        r = np.broadcast_to(real, blocked.shape)[idx]
        cand = np.nonzero(r)[0]
        if len(cand) == 0:
            continue  # the key padding blocks the whole row: intended
        blocked[idx + (int(rng.choice(cand)),)] = False
    return blocked


def make_case(c, rng, tmp):
    """Builds the torch module, inputs and masks of case `c`, writes the
    files, and returns what is needed to run mha and torch."""
    E, H = c["E"], c["H"]
    kdim, vdim = c.get("kdim", E), c.get("vdim", E)
    bias = c.get("bias", True)
    cross = c.get("cross", False) or kdim != E or vdim != E
    B = c.get("B", 2)                 # None: unbatched
    Lq = c.get("Lq", 4)
    Lk = c.get("Lk", 5) if cross else Lq
    m = torch.nn.MultiheadAttention(E, H, bias=bias,
                                    add_bias_kv=c.get("bias_kv", False),
                                    add_zero_attn=c.get("zero_attn", False),
                                    kdim=kdim, vdim=vdim, batch_first=True)
    m.eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "bias" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    sd = m.state_dict()
    meta = {"num_heads": str(H)} if c.get("meta_heads") else {}
    if c.get("zero_attn") and c.get("via") == "driver":
        # the driver has no flag for it: the file says so, as
        # mha_module_save's files do
        meta["add_zero_attn"] = "true"
    wpath = os.path.join(tmp, "w.safetensors")
    st.save(wpath, {k: v.float() for k, v in sd.items()}, meta or None)

    Bn = 1 if B is None else B
    lead = () if B is None else (B,)
    q = rng.randn(*lead, Lq, E).astype(np.float32)
    k = rng.randn(*lead, Lk, kdim).astype(np.float32) if cross else None
    v = rng.randn(*lead, Lk, vdim).astype(np.float32) if cross else None

    if c.get("kv_shared"):            # one tensor as key and value
        assert cross and kdim == vdim
        v = None
    files = {"query": q}
    if cross:
        files["key"] = k
        if v is not None:
            files["value"] = v
    mha_args, drv_args = [], []
    torch_kw = {}

    # key padding first: the attention masks keep a real key in every row
    real = np.ones((Bn, Lk), bool)
    kp = c.get("keypad")
    if kp == "mask":
        pad = rng.rand(Bn, Lk) < 0.35
        for b in range(Bn):
            if pad[b].all():
                pad[b, rng.randint(Lk)] = False
        if c.get("full_row"):
            pad[Bn - 1, :] = True     # a batch element with no real key
        real = ~pad
        tp = pad if B is not None else pad[0]
        torch_kw["key_padding_mask"] = tp
        if c.get("via") == "driver":
            files["key_padding"] = tp             # torch polarity: block
            drv_args += ["--key-padding-kind", "block"]
        else:
            files["key_mask"] = ~tp               # ours: true = real key
    elif kp == "lengths":
        lens = rng.randint(1, Lk + 1, size=Bn).astype(np.int64)
        if c.get("full_row"):
            lens[0] = 0
        pad = np.arange(Lk)[None, :] >= lens[:, None]
        real = ~pad
        torch_kw["key_padding_mask"] = pad if B is not None else pad[0]
        files["key_lengths"] = lens

    am = c.get("mask")
    if am in ("bool2d", "float2d"):
        # (a row left without keys here is so for every head: allowed)
        blocked = rng.rand(Lq, Lk) < 0.35
        blocked = ensure_allowed(blocked, np.ones((1, Lk), bool), rng)
        if c.get("full_row"):
            blocked[Lq // 2, :] = True
        if am == "bool2d":
            torch_kw["attn_mask"] = blocked
            if c.get("via") == "driver":
                files["attn_mask"] = blocked
                drv_args += ["--mask-kind", "block"]
            else:
                files["attn_mask"] = ~blocked     # ours: bool = allow
        else:
            add = (rng.randn(Lq, Lk) * 0.7).astype(np.float32)
            add[blocked] = -np.inf
            torch_kw["attn_mask"] = add
            files["attn_mask"] = add
            if c.get("via") == "driver":
                drv_args += ["--mask-kind", "additive"]
    elif am in ("bool3d", "float3d"):
        blocked = rng.rand(Bn, H, Lq, Lk) < 0.35
        blocked = ensure_allowed(blocked, real[:, None, None, :], rng)
        if c.get("full_row"):
            blocked[0, :, Lq - 1, :] = True       # every head of one row
        tb = blocked.reshape(Bn * H, Lq, Lk)      # torch: (B*H, Lq, Lk)
        if am == "bool3d":
            torch_kw["attn_mask"] = tb
            if c.get("via") == "driver":
                files["attn_mask"] = blocked
                drv_args += ["--mask-kind", "block"]
            else:
                files["attn_mask"] = ~blocked      # (B, H, Lq, Lk) allow
        else:
            add = (rng.randn(Bn, H, Lq, Lk) * 0.7).astype(np.float32)
            add[blocked] = -np.inf
            torch_kw["attn_mask"] = add.reshape(Bn * H, Lq, Lk)
            files["attn_mask"] = add
            if c.get("via") == "driver":
                drv_args += ["--mask-kind", "additive"]
    elif am == "bool_batch":                      # H = 1: (B, Lq, Lk) both
        assert H == 1
        blocked = rng.rand(Bn, 1, Lq, Lk) < 0.35
        blocked = ensure_allowed(blocked, real[:, None, None, :], rng)[:, 0]
        torch_kw["attn_mask"] = blocked
        files["attn_mask"] = ~blocked
    elif am in ("causal", "causal_tl"):
        i = np.arange(Lq)[:, None]
        j = np.arange(Lk)[None, :]
        blocked = j > i + (Lk - Lq) if am == "causal" else j > i
        torch_kw["attn_mask"] = blocked
        mha_args.append("--causal" if am == "causal" else "--causal-top-left")
        drv_args += ["--causal",
                     "bottom_right" if am == "causal" else "top_left"]

    if not c.get("meta_heads"):
        mha_args += ["--heads", str(H)]
        drv_args += ["--heads", str(H)]
    if c.get("zero_attn"):
        mha_args.append("--add-zero-attn")
    return dict(m=m, q=q, k=k, v=v, files=files, mha_args=mha_args,
                drv_args=drv_args, torch_kw=torch_kw, wpath=wpath,
                out_bias=(sd["out_proj.bias"].numpy() if bias else None),
                batched=B is not None, E=E)


def run_torch(m, q, k, v, kw, per_head, dtype):
    mm = m if dtype == torch.float32 else copy.deepcopy(m).double()
    cvt = (lambda a: None if a is None else torch.from_numpy(a).to(dtype))
    tq = cvt(q)
    tk = cvt(k) if k is not None else tq
    tv = cvt(v) if v is not None else tk
    targs = {}
    for name, a in kw.items():
        t = torch.from_numpy(np.ascontiguousarray(a))
        targs[name] = t if a.dtype == np.bool_ else t.to(dtype)
    # Grad mode stays on (the parameters require grad) so that torch takes
    # its documented path, F.multi_head_attention_forward, and not the
    # inference fast path (_native_multi_head_attention), which in 1.13
    # fails on bias=False modules.
    out, w = mm(tq, tk, tv, need_weights=True,
                average_attn_weights=not per_head, **targs)
    return out.detach().double().numpy(), w.detach().double().numpy()


def run(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       universal_newlines=True)
    if p.returncode != 0:
        raise CaseFailure("%s exited %d: %s"
                          % (" ".join(os.path.basename(x) for x in cmd[:2]),
                             p.returncode, p.stdout.strip()))
    return p.stdout


def forward_case(c, rng):
    with tempfile.TemporaryDirectory(prefix="mha_live_") as tmp:
        d = make_case(c, rng, tmp)
        paths = {}
        for name, a in d["files"].items():
            paths[name] = os.path.join(tmp, name + ".npy")
            np.save(paths[name], a)
        weights = c.get("weights")            # None, "avg", "per_head"
        out_path = os.path.join(tmp, "out.npy")
        w_path = os.path.join(tmp, "attn.npy")
        if c.get("via") == "driver":
            cmd = [DRIVER, "--weights", d["wpath"], "--out", out_path]
            opt = {"query": "--query", "key": "--key", "value": "--value",
                   "attn_mask": "--attn-mask", "key_padding": "--key-padding",
                   "key_lengths": "--key-lengths"}
            for name, p in paths.items():
                cmd += [opt[name], p]
            cmd += d["drv_args"]
            if weights:
                cmd += ["--weights-out", w_path]
        else:
            cmd = [MHA, "forward", "--weights", d["wpath"], "--out", out_path]
            opt = {"query": "--query", "key": "--key", "value": "--value",
                   "attn_mask": "--attn-mask", "key_mask": "--key-mask",
                   "key_lengths": "--key-lengths"}
            for name, p in paths.items():
                cmd += [opt[name], p]
            cmd += d["mha_args"]
            if weights:
                cmd += ["--attn-weights", w_path]
        if weights == "per_head":
            cmd.append("--per-head")
        run(cmd)
        out = np.load(out_path)
        w = np.load(w_path) if weights else None
        if out.dtype != np.float32 or (w is not None and w.dtype != np.float32):
            raise CaseFailure("outputs are not float32")
    per_head = weights == "per_head"
    o32, w32 = run_torch(d["m"], d["q"], d["k"], d["v"], d["torch_kw"],
                         per_head, torch.float32)
    o64, w64 = run_torch(d["m"], d["q"], d["k"], d["v"], d["torch_kw"],
                         per_head, torch.float64)
    r_out = compare("out", out, o32, o64)
    r_w = compare("weights", w, w32, w64) if weights else None
    nmasked = check_masked_rows(out, w, o64, w64, d["out_bias"], d["E"])
    if c.get("full_row") and not (c.get("zero_attn") or c.get("bias_kv")) \
            and nmasked == 0:
        raise CaseFailure("the case meant to have a fully masked row has none")
    return r_out, r_w, nmasked


# ---------------------------------------------------------------------------
# The backward
# ---------------------------------------------------------------------------

def merged_mask(kw, Bn, H, Lq, Lk):
    """attn_mask and key_padding_mask of torch_kw as one additive float64
    (Bn*H, Lq, Lk) mask, merged as F.multi_head_attention_forward does."""
    merged = np.zeros((Bn * H, Lq, Lk))
    am = kw.get("attn_mask")
    if am is not None:
        a = np.where(am, -np.inf, 0.0) if am.dtype == np.bool_ \
            else am.astype(np.float64)
        if a.ndim == 3 and a.shape[0] != Bn * H:      # (B, Lq, Lk), H = 1
            a = np.repeat(a, H, axis=0)
        merged = merged + a
    kp = kw.get("key_padding_mask")
    if kp is not None:
        k = np.where(kp.reshape(Bn, 1, 1, Lk), -np.inf, 0.0)
        merged = merged + np.broadcast_to(k, (Bn, H, 1, Lk)).reshape(
            Bn * H, 1, Lk)
    return merged


def torch_grads(m, q, k, v, kw, G, dtype, nan_rows):
    """torch autograd's gradients of sum(out * G) in `dtype`, as float64
    numpy arrays: every parameter by name, then query (key, value for the
    tensors given; a missing one is the tensor before it, as in the driver).
    nan_rows: the query rows with no key (see the top of the file)."""
    mm = copy.deepcopy(m).to(dtype)
    mm.zero_grad(set_to_none=True)

    def leaf(a):
        return torch.from_numpy(a).to(dtype).requires_grad_()
    tq = leaf(q)
    tk = leaf(k) if k is not None else tq
    tv = leaf(v) if v is not None else tk
    g = torch.from_numpy(G).to(dtype)
    targs = {}
    for name, a in kw.items():
        t = torch.from_numpy(np.ascontiguousarray(a))
        targs[name] = t if a.dtype == np.bool_ else t.to(dtype)
    emulate = bool(nan_rows.any())
    if emulate:
        Bn = 1 if q.ndim == 2 else q.shape[0]
        H, Lq, Lk = m.num_heads, q.shape[-2], tk.shape[-2]
        merged = merged_mask(kw, Bn, H, Lq, Lk)
        full = np.isinf(merged).all(axis=-1).reshape(Bn, H, Lq)
        if not (full == nan_rows.reshape(Bn, 1, Lq)).all():
            raise CaseFailure("a query row masked in some heads only: the "
                              "reference cannot be emulated")
        merged[full.reshape(Bn * H, Lq)] = 0.0
        targs = {"attn_mask": torch.from_numpy(merged).to(dtype)}
        g = g.masked_fill(torch.from_numpy(nan_rows)[..., None], 0.0)
    out, _ = mm(tq, tk, tv, need_weights=False, **targs)
    (out * g).sum().backward()
    params = dict(mm.named_parameters())
    grads = {}
    for name in m.state_dict():
        gr = params[name].grad.detach().clone()
        if emulate and name == "out_proj.bias":
            gr += torch.from_numpy(G).to(dtype)[torch.from_numpy(nan_rows)] \
                .sum(dim=0)
        grads[name] = gr
    grads["query"] = tq.grad
    if k is not None:
        grads["key"] = tk.grad
    if v is not None:
        grads["value"] = tv.grad
    return {name: t.detach().double().numpy() for name, t in grads.items()}


def backward_case(c, rng):
    """torch_live_driver's forward and gradients against torch's."""
    with tempfile.TemporaryDirectory(prefix="mha_live_") as tmp:
        d = make_case(c, rng, tmp)
        q = d["q"]
        G = rng.randn(*q.shape[:-1], d["E"]).astype(np.float32)
        d["files"]["grad_out"] = G
        paths = {}
        for name, a in d["files"].items():
            paths[name] = os.path.join(tmp, name + ".npy")
            np.save(paths[name], a)
        out_path = os.path.join(tmp, "out.npy")
        w_path = os.path.join(tmp, "attn.npy")
        g_path = os.path.join(tmp, "grads.safetensors")
        cmd = [DRIVER, "--weights", d["wpath"], "--out", out_path,
               "--grads-out", g_path]
        weights = c.get("weights")            # None, "avg", "per_head"
        if weights:   # the plan's forward writes them before its backward
            cmd += ["--weights-out", w_path]
        if weights == "per_head":
            cmd.append("--per-head")
        opt = {"query": "--query", "key": "--key", "value": "--value",
               "attn_mask": "--attn-mask", "key_padding": "--key-padding",
               "key_lengths": "--key-lengths", "grad_out": "--grad-out"}
        for name, p in paths.items():
            cmd += [opt[name], p]
        cmd += d["drv_args"]
        run(cmd)
        out = np.load(out_path)
        w = np.load(w_path) if weights else None
        got, _ = st.load(g_path)
    per_head = weights == "per_head"
    o32, w32 = run_torch(d["m"], q, d["k"], d["v"], d["torch_kw"], per_head,
                         torch.float32)
    o64, w64 = run_torch(d["m"], q, d["k"], d["v"], d["torch_kw"], per_head,
                         torch.float64)
    r_out = compare("out", out, o32, o64)
    if weights:
        compare("weights", w, w32, w64)
    nmasked = check_masked_rows(out, w, o64, w64, d["out_bias"], d["E"])
    if c.get("full_row") and not (c.get("zero_attn") or c.get("bias_kv")) \
            and nmasked == 0:
        raise CaseFailure("the case meant to have a fully masked row has none")
    nan_rows = np.isnan(o64).any(axis=-1)
    g32 = torch_grads(d["m"], q, d["k"], d["v"], d["torch_kw"], G,
                      torch.float32, nan_rows)
    g64 = torch_grads(d["m"], q, d["k"], d["v"], d["torch_kw"], G,
                      torch.float64, nan_rows)
    if sorted(got) != sorted(g64):
        raise CaseFailure("the driver's gradients are %s, torch's %s"
                          % (list(got), list(g64)))
    r_grad, worst_name, vs32 = 0.0, None, 0.0
    for name, ref in g64.items():
        if not np.isfinite(ref).all():
            raise CaseFailure("torch float64 gradient of %s is not finite"
                              % name)
        if got[name].dtype != np.float32:
            raise CaseFailure("gradient %s is %s" % (name, got[name].dtype))
        r = compare("grad " + name, got[name], g32[name], ref, factor=3.0,
                    floor_rel=FLT_EPSILON, floor_abs=0.0, kind="grads")
        e32 = float(np.max(np.abs(g32[name] - ref)))
        if e32 > 0:
            vs32 = max(vs32, float(np.max(np.abs(got[name] - ref))) / e32)
        if r >= r_grad:
            r_grad, worst_name = r, name
    return r_out, r_grad, worst_name, vs32, nmasked


def init_case(c, rng):
    """mha init -> st.load -> torch load_state_dict(strict=True) -> compare
    torch with mha forward on the same file."""
    with tempfile.TemporaryDirectory(prefix="mha_live_") as tmp:
        wpath = os.path.join(tmp, "init.safetensors")
        run([MHA, "init", "--embed-dim", str(c["E"]), "--heads", str(c["H"]),
             "--seed", str(c["seed"]), "--out", wpath] + c["flags"])
        tensors, meta = st.load(wpath)
        E, H = int(meta["embed_dim"]), int(meta["num_heads"])
        kdim, vdim = int(meta["kdim"]), int(meta["vdim"])
        if (E, H) != (c["E"], c["H"]):
            raise CaseFailure("metadata embed_dim/num_heads %s" % meta)
        m = torch.nn.MultiheadAttention(
            E, H, bias=meta["bias"] == "true",
            add_bias_kv=meta["add_bias_kv"] == "true",
            add_zero_attn=meta["add_zero_attn"] == "true",
            kdim=kdim, vdim=vdim, batch_first=True)
        m.eval()
        if list(tensors) != list(m.state_dict()):
            raise CaseFailure("tensor order %s, torch state_dict order %s"
                              % (list(tensors), list(m.state_dict())))
        try:
            m.load_state_dict({k: torch.from_numpy(a) for k, a in
                               tensors.items()}, strict=True)
        except RuntimeError as e:
            raise CaseFailure("load_state_dict(strict=True): %s" % e)
        for name, a in tensors.items():
            if a.dtype != np.float32:
                raise CaseFailure("%s is %s, not float32" % (name, a.dtype))
            if name in ("in_proj_bias", "out_proj.bias") and a.any():
                raise CaseFailure("%s is not zero after init" % name)
        B, Lq = 2, 5
        cross = kdim != E or vdim != E
        Lk = 3 if cross else Lq
        q = rng.randn(B, Lq, E).astype(np.float32)
        k = rng.randn(B, Lk, kdim).astype(np.float32) if cross else None
        v = rng.randn(B, Lk, vdim).astype(np.float32) if cross else None
        out_path = os.path.join(tmp, "out.npy")
        w_path = os.path.join(tmp, "w.npy")
        cmd = [MHA, "forward", "--weights", wpath, "--out", out_path,
               "--attn-weights", w_path]
        for name, a in (("query", q), ("key", k), ("value", v)):
            if a is not None:
                p = os.path.join(tmp, name + ".npy")
                np.save(p, a)
                cmd += ["--" + name, p]
        run(cmd)
        out, w = np.load(out_path), np.load(w_path)
    o32, w32 = run_torch(m, q, k, v, {}, False, torch.float32)
    o64, w64 = run_torch(m, q, k, v, {}, False, torch.float64)
    return compare("out", out, o32, o64), compare("weights", w, w32, w64), 0


# ---------------------------------------------------------------------------
# The configurations
# ---------------------------------------------------------------------------

def case_adder(rng, cases, **fixed):
    """add(**kw) appends a case to `cases`: the given fields, `fixed`, and
    random E, H (unless given), Lq, B (and Lk for cross-attention) drawn
    from rng in a fixed order, meta_heads alternating, bias on."""
    def add(**kw):
        E, H = pick_dims(rng, kw.pop("E", None), kw.pop("H", None))
        if kw.get("cross") and "Lk" not in kw:
            kw["Lk"] = int(rng.randint(1, 8))
        kw.setdefault("Lq", int(rng.randint(2, 7)))
        kw.setdefault("B", int(rng.randint(1, 4)))
        kw.setdefault("meta_heads", len(cases) % 2 == 0)
        kw.setdefault("bias", True)
        cases.append(dict(E=E, H=H, **fixed, **kw))
    return add


def configurations(rng):
    cases = []
    add = case_adder(rng, cases)

    add(weights="avg")                                      # plain self-attn
    add(B=None, weights="per_head")                         # unbatched
    add(cross=True, Lq=3, Lk=6, kdim=5, vdim=7, mask="bool2d",
        weights="per_head")
    add(cross=True, Lq=5, Lk=2, mask="float2d", weights="avg")
    add(mask="bool3d", weights="per_head")                  # per-head mask
    add(mask="float3d", B=None, weights="avg")              # unbatched 3-D
    add(keypad="mask", full_row=True, weights="per_head")   # all keys padded
    add(keypad="lengths", full_row=True, cross=True, B=3, Lk=4, weights="avg")
    add(mask="bool2d", full_row=True, bias=False, weights="avg")
    add(mask="float2d", full_row=True, weights="per_head")
    add(mask="bool3d", full_row=True, keypad="mask", B=2, weights="avg")
    add(bias_kv=True, keypad="mask", weights="per_head")
    add(zero_attn=True, mask="bool2d", full_row=True, weights="per_head")
    add(bias_kv=True, zero_attn=True, cross=True, kdim=3, vdim=9,
        keypad="lengths", full_row=True, weights="avg")
    add(bias=False, mask="float3d", keypad="lengths", weights="per_head")
    add(E=6, H=1, mask="bool_batch", weights="avg")         # 3-D (B, Lq, Lk)
    add(B=None, keypad="mask", mask="bool3d", cross=True, vdim=3,
        weights="per_head")
    add(E=4, H=4, cross=True, Lq=1, Lk=1, weights="avg")    # d_h 1, L 1
    add(E=64, H=8, B=2, Lq=16, weights="avg")               # larger
    add(cross=True, Lq=6, Lk=3, mask="causal", weights="avg")   # Lq > Lk
    add(cross=True, Lq=3, Lk=6, mask="causal_tl", weights="per_head")
    add(mask="causal", zero_attn=True, weights="avg")
    add(B=None, keypad="lengths", mask="bool2d")            # no weights
    # through the C API (torch_live_driver): masks in torch's own polarity
    add(via="driver", mask="bool2d", keypad="mask", weights="avg")
    add(via="driver", cross=True, kdim=5, mask="float3d", weights="per_head")
    add(via="driver", mask="bool3d", keypad="lengths", full_row=True,
        weights="per_head")
    add(via="driver", B=None, bias_kv=True, mask="float2d", keypad="mask",
        full_row=True, weights="avg")
    return cases


def long_configurations(rng):
    """Forward cases longer than one 64-key tile (the cases above have
    L <= 16, inside one tile): self-attention over 2 and 3 tiles, causal
    (diagonal tiles), key padding, cross-attention with Lk != Lq either
    way, extra keys, and the decoding path that splits >= 1024 keys in
    chunks (Lq <= 64).  Their own generator, so that the cases above see
    the same random numbers as before."""
    cases = []
    add = case_adder(rng, cases)

    add(Lq=100, mask="causal", weights="per_head")
    add(Lq=130, keypad="mask", weights="avg")
    add(cross=True, Lq=70, Lk=200, mask="float2d", keypad="lengths",
        weights="per_head")
    add(cross=True, Lq=200, Lk=130, kdim=5, vdim=7, mask="causal_tl",
        weights="avg")
    add(cross=True, Lq=3, Lk=1100, keypad="mask", mask="causal",
        weights="per_head")                     # split keys
    add(via="driver", Lq=130, mask="bool3d", keypad="mask",
        weights="per_head")
    add(via="driver", cross=True, Lq=100, Lk=200, bias_kv=True,
        zero_attn=True, mask="causal", weights="avg")
    return cases


def backward_configurations(rng):
    """Seeded random configurations for the backward, all through the
    driver (the C API).  None leaves a query row without keys by chance:
    the bool and float masks keep a real key in every row and the causal
    ones have no key padding; full_row asks for such a row on purpose."""
    cases = []
    add = case_adder(rng, cases, via="driver")

    add()                                                   # self-attention
    add(B=None, mask="bool3d", weights="per_head")          # unbatched
    add(cross=True, kdim=5, vdim=7, mask="float3d")         # q/k/v_proj
    add(cross=True, kv_shared=True, keypad="mask")          # key is value
    add(bias=False, mask="bool3d", keypad="lengths")
    add(bias_kv=True, zero_attn=True, cross=True, kdim=3, vdim=9,
        keypad="lengths", full_row=True)                    # zero key saves
    add(mask="float2d")
    add(cross=True, Lq=3, Lk=6, mask="causal", weights="avg")  # bottom-r.
    add(cross=True, Lq=6, Lk=3, mask="causal_tl")           # top-left
    add(keypad="mask", full_row=True)                       # no key at all
    add(E=4, H=4, cross=True, Lq=1, Lk=1)                   # d_h 1, L 1
    add(E=64, H=8, B=2, Lq=16, mask="bool3d")               # larger
    # Long rows: sums over a thousand keys or queries, where a float32
    # chain as long as L (or delta taken from the rounded context) once
    # made dq, dk, dv and the bias sums several times torch's error.
    add(E=128, H=2, B=1, Lq=1024)
    add(E=16, H=2, B=1, cross=True, Lq=2048, Lk=16)
    return cases


def init_configurations():
    return [
        dict(E=8, H=2, seed=1, flags=[]),
        dict(E=12, H=3, seed=2, flags=["--kdim", "5", "--vdim", "7"]),
        dict(E=8, H=4, seed=3, flags=["--no-bias"]),
        dict(E=16, H=2, seed=4, flags=["--add-bias-kv", "--add-zero-attn"]),
        dict(E=6, H=3, seed=5, flags=["--kdim", "6", "--vdim", "4",
                                      "--no-bias", "--add-bias-kv"]),
    ]


def describe(c):
    keys = ["via", "cross", "kdim", "vdim", "kv_shared", "bias", "bias_kv",
            "zero_attn", "mask", "keypad", "full_row", "weights", "meta_heads"]
    parts = ["E=%d H=%d B=%s Lq=%d" % (c["E"], c["H"], c["B"], c["Lq"])]
    if c.get("cross") or "kdim" in c or "vdim" in c:
        parts.append("Lk=%s" % c.get("Lk", 5))
    for k in keys:
        if k in c and c[k] not in (None, False) and not (k == "bias"):
            parts.append(k if c[k] is True else "%s=%s" % (k, c[k]))
    if c.get("bias") is False:
        parts.append("no-bias")
    return " ".join(parts)


# ---------------------------------------------------------------------------
# Grouped-query attention: no nn.MultiheadAttention has it, so the reference
# is PyTorch's own ops, as Llama-family code writes it (Debian's 1.13 has no
# scaled_dot_product_attention(enable_gqa=...)): q, k, v by F.linear, the
# K/V heads repeat_interleave'd to the query heads, softmax(q k^T / sqrt(d_h)
# + mask) v, the output projection.
# ---------------------------------------------------------------------------

def gqa_torch(P, x, H, Hkv, causal, dtype):
    t = {k: torch.from_numpy(v).to(dtype) for k, v in P.items()}
    xt = torch.from_numpy(x).to(dtype)
    B, L, E = x.shape
    dh = E // H
    bq, bk, bv = torch.split(t["in_proj_bias"], [E, Hkv * dh, Hkv * dh])
    q = F.linear(xt, t["q_proj_weight"], bq).view(B, L, H, dh).transpose(1, 2)
    k = F.linear(xt, t["k_proj_weight"], bk).view(B, L, Hkv, dh).transpose(1, 2)
    v = F.linear(xt, t["v_proj_weight"], bv).view(B, L, Hkv, dh).transpose(1, 2)
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(dh)
    if causal:
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1),
                          float("-inf"))
    ctx = (torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(B, L, E)
    out = F.linear(ctx, t["out_proj.weight"], t["out_proj.bias"])
    return out.double().numpy()


def gqa_case(c, rng):
    E, H, Hkv, B, L = c["E"], c["H"], c["Hkv"], c["B"], c["L"]
    dh = E // H
    a = 1.0 / math.sqrt(E)
    P = {"q_proj_weight": rng.uniform(-a, a, (E, E)),
         "k_proj_weight": rng.uniform(-a, a, (Hkv * dh, E)),
         "v_proj_weight": rng.uniform(-a, a, (Hkv * dh, E)),
         "in_proj_bias": rng.uniform(-0.1, 0.1, (E + 2 * Hkv * dh,)),
         "out_proj.weight": rng.uniform(-a, a, (E, E)),
         "out_proj.bias": rng.uniform(-0.1, 0.1, (E,))}
    P = {k: v.astype(np.float32) for k, v in P.items()}
    x = rng.uniform(-1.5, 1.5, (B, L, E)).astype(np.float32)
    with tempfile.TemporaryDirectory(prefix="mha_live_") as tmp:
        wpath = os.path.join(tmp, "w.safetensors")
        st.save(wpath, {k: torch.from_numpy(v) for k, v in P.items()},
                {"num_heads": str(H)})
        qpath, opath = os.path.join(tmp, "q.npy"), os.path.join(tmp, "o.npy")
        np.save(qpath, x)
        cmd = [MHA, "forward", "--weights", wpath, "--query", qpath,
               "--out", opath] + (["--causal"] if c["causal"] else [])
        run(cmd)
        got = np.load(opath)
        if c["causal"]:   # and through a KV cache, token by token
            dpath = os.path.join(tmp, "d.npy")
            run([MHA, "decode", "--weights", wpath, "--query", qpath,
                 "--out", dpath])
            dec = np.load(dpath)
    ref = gqa_torch(P, x, H, Hkv, c["causal"], torch.float64)
    t32 = gqa_torch(P, x, H, Hkv, c["causal"], torch.float32)
    r = compare("out", got, t32, ref)
    if c["causal"]:
        r = max(r, compare("out", dec, t32, ref))
    return r


def gqa_configurations():
    return [dict(E=32, H=4, Hkv=2, B=2, L=9, causal=False),
            dict(E=32, H=4, Hkv=1, B=2, L=11, causal=True),
            dict(E=64, H=8, Hkv=2, B=1, L=130, causal=True),
            dict(E=48, H=6, Hkv=3, B=3, L=70, causal=False)]


# ---------------------------------------------------------------------------
# The score modifiers and RoPE against PyTorch written the way the models'
# reference code computes them: Hugging Face's rotary embedding (inverse
# frequencies theta^(-2k/dims), rotate_half for NeoX, interleaved pairs for
# GPT-J, partial rotary), Gemma 2's softcap, the ALiBi paper's get_slopes
# and bias, a (left, right) band, gpt-oss's sinks (a logit column joined
# to the scores and dropped after the softmax).  The module file carries
# `sinks`; the modifiers are `mha forward` / `mha decode` flags.
# ---------------------------------------------------------------------------

def paper_slopes(n):
    def pow2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        return [start * start ** i for i in range(n)]
    if math.log2(n).is_integer():
        return pow2(n)
    p2 = 2 ** math.floor(math.log2(n))
    return pow2(p2) + paper_slopes(2 * p2)[0::2][:n - p2]


def rope_torch(x, style, dims, theta, scale):
    """x (B, H, L, dh) at positions 0 .. L-1, as Hugging Face rotates."""
    L = x.shape[2]
    inv = 1.0 / (theta ** (torch.arange(0, dims, 2, dtype=torch.float64)
                           / dims))
    ang = (torch.arange(L, dtype=torch.float64) / scale)[:, None] * inv
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    xr, rest = x[..., :dims], x[..., dims:]
    if style == "neox":
        cos2, sin2 = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        half = dims // 2
        rot_half = torch.cat([-xr[..., half:], xr[..., :half]], -1)
        out = xr * cos2 + rot_half * sin2
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos],
                          -1).flatten(-2)
    return torch.cat([out, rest], -1)


def mods_torch(P, x, c, dtype):
    t = {k: torch.from_numpy(v).to(dtype) for k, v in P.items()}
    xt = torch.from_numpy(x).to(dtype)
    B, L, E = x.shape
    H = c["H"]
    dh = E // H
    W, bias = t["in_proj_weight"], t["in_proj_bias"]
    q, k, v = [F.linear(xt, W[i * E:(i + 1) * E], bias[i * E:(i + 1) * E])
               .view(B, L, H, dh).transpose(1, 2) for i in range(3)]
    if c.get("rope"):
        q = rope_torch(q, c["rope"], c["dims"], c["theta"], c["scale"])
        k = rope_torch(k, c["rope"], c["dims"], c["theta"], c["scale"])
    s = q @ k.transpose(-1, -2) / math.sqrt(dh)
    if c.get("softcap"):
        s = c["softcap"] * torch.tanh(s / c["softcap"])
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    if c.get("alibi"):
        slopes = torch.tensor(paper_slopes(H), dtype=dtype)
        s = s - slopes[:, None, None] * (i - j).abs().to(dtype)
    blocked = torch.zeros(L, L, dtype=torch.bool)
    if c["causal"]:
        blocked |= j > i
    if c.get("window"):
        left, right = c["window"]
        if left >= 0:
            blocked |= j < i - left
        if right >= 0:
            blocked |= j > i + right
    s = s.masked_fill(blocked, float("-inf"))
    if "sinks" in t:
        col = t["sinks"].view(1, H, 1, 1).expand(B, H, L, 1)
        p = torch.softmax(torch.cat([s, col], -1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    ctx = (p @ v).transpose(1, 2).reshape(B, L, E)
    out = F.linear(ctx, t["out_proj.weight"], t["out_proj.bias"])
    return out.double().numpy()


def mods_case(c, rng):
    E, H, B, L = c["E"], c["H"], c["B"], c["L"]
    a = 1.0 / math.sqrt(E)
    P = {"in_proj_weight": rng.uniform(-3 * a, 3 * a, (3 * E, E)),
         "in_proj_bias": rng.uniform(-0.1, 0.1, (3 * E,)),
         "out_proj.weight": rng.uniform(-a, a, (E, E)),
         "out_proj.bias": rng.uniform(-0.1, 0.1, (E,))}
    if c.get("sinks"):
        P["sinks"] = rng.uniform(-1.0, 2.0, (H,))
    P = {k: v.astype(np.float32) for k, v in P.items()}
    x = rng.uniform(-1.5, 1.5, (B, L, E)).astype(np.float32)
    flags = ["--causal"] if c["causal"] else []
    mflags = []
    if c.get("rope"):
        mflags += ["--rope", c["rope"], "--rope-dim", str(c["dims"]),
                   "--rope-theta", repr(c["theta"]),
                   "--rope-scale", repr(c["scale"])]
    if c.get("alibi"):
        mflags += ["--alibi"]
    if c.get("softcap"):
        mflags += ["--softcap", repr(c["softcap"])]
    wflags = (["--window", "%d,%d" % tuple(c["window"])]
              if c.get("window") else [])
    with tempfile.TemporaryDirectory(prefix="mha_live_") as tmp:
        wpath = os.path.join(tmp, "w.safetensors")
        st.save(wpath, {k: torch.from_numpy(v) for k, v in P.items()},
                {"num_heads": str(H)})
        qpath, opath = os.path.join(tmp, "q.npy"), os.path.join(tmp, "o.npy")
        np.save(qpath, x)
        run([MHA, "forward", "--weights", wpath, "--query", qpath,
             "--out", opath] + flags + mflags + wflags)
        got = np.load(opath)
        dec = None
        if c["causal"] and not c.get("window"):
            dpath = os.path.join(tmp, "d.npy")
            run([MHA, "decode", "--weights", wpath, "--query", qpath,
                 "--chunk", "3", "--out", dpath] + mflags)
            dec = np.load(dpath)
    ref = mods_torch(P, x, c, torch.float64)
    t32 = mods_torch(P, x, c, torch.float32)
    r = compare("out", got, t32, ref)
    if dec is not None:
        r = max(r, compare("out", dec, t32, ref))
    return r


def mods_configurations():
    return [dict(E=32, H=4, B=2, L=20, causal=True, rope="neox", dims=8,
                 theta=10000.0, scale=1.0),
            dict(E=48, H=3, B=1, L=70, causal=True, rope="gptj", dims=12,
                 theta=500.0, scale=2.0),
            dict(E=40, H=5, B=2, L=33, causal=True, alibi=True),
            dict(E=32, H=4, B=1, L=90, causal=False, window=(7, 3)),
            dict(E=32, H=2, B=2, L=40, causal=True, softcap=2.0),
            dict(E=32, H=4, B=2, L=30, causal=True, sinks=True),
            dict(E=64, H=4, B=1, L=80, causal=True, rope="neox", dims=16,
                 theta=10000.0, scale=1.0, alibi=True, softcap=5.0,
                 sinks=True, window=(20, 0))]


def main():
    global passes, fails
    t0 = time.time()
    torch.manual_seed(20240601)
    rng = np.random.RandomState(20240601)
    todo = [("forward", c, rng) for c in configurations(rng)]
    todo += [("init", c, rng) for c in init_configurations()]
    # The long and the backward cases come last, each with its own
    # generator, so that the cases above see the same random numbers as
    # before they were added.
    lrng = np.random.RandomState(20240603)
    todo += [("forward", c, lrng) for c in long_configurations(lrng)]
    brng = np.random.RandomState(20240602)
    todo += [("backward", c, brng) for c in backward_configurations(brng)]
    grng = np.random.RandomState(20240604)
    todo += [("gqa", c, grng) for c in gqa_configurations()]
    mrng = np.random.RandomState(20240605)
    todo += [("mods", c, mrng) for c in mods_configurations()]
    for n, (kind, c, crng) in enumerate(todo):
        label = ("init " + " ".join(c["flags"]) + " E=%d H=%d" % (c["E"], c["H"])
                 if kind == "init" else
                 "backward " + describe(c) if kind == "backward" else
                 "gqa E=%d H=%d H_kv=%d B=%d L=%d%s (cli forward%s)"
                 % (c["E"], c["H"], c["Hkv"], c["B"], c["L"],
                    " causal" if c["causal"] else "",
                    ", decode" if c["causal"] else "")
                 if kind == "gqa" else
                 "modifiers E=%d H=%d B=%d L=%d %s (cli forward%s)"
                 % (c["E"], c["H"], c["B"], c["L"],
                    " ".join(k for k in ("rope", "alibi", "window",
                                         "softcap", "sinks") if c.get(k)),
                    ", decode" if c["causal"] and not c.get("window") else "")
                 if kind == "mods" else
                 ("driver " if c.get("via") == "driver" else "cli ") +
                 describe(c))
        try:
            if kind == "gqa":
                msg = "out %.3f" % gqa_case(c, crng)
            elif kind == "mods":
                msg = "out %.3f" % mods_case(c, crng)
            elif kind == "backward":
                r_out, r_g, gname, vs32, nm = backward_case(c, crng)
                msg = "out %.3f  grads %.3f (worst %s; max err / torch32 " \
                      "err %.2f)" % (r_out, r_g, gname, vs32)
                if nm:
                    msg += "  (%d fully masked rows)" % nm
            else:
                if kind == "init":
                    r_out, r_w, nm = init_case(c, crng)
                else:
                    r_out, r_w, nm = forward_case(c, crng)
                msg = "out %.3f" % r_out
                if r_w is not None:
                    msg += "  weights %.3f" % r_w
                if nm:
                    msg += "  (%d fully masked rows: out_proj.bias, " \
                           "weights 0)" % nm
            print("ok   %2d %-62s error/bound: %s" % (n, label, msg))
            passes += 1
        except CaseFailure as e:
            print("FAIL %2d %s: %s" % (n, label, e))
            fails += 1
        sys.stdout.flush()
    print("worst error/bound: out %.3f, weights %.3f, gradients %.3f (%.1f s)"
          % (worst["out"], worst["weights"], worst["grads"], time.time() - t0))
    print("%d passed, %d failed" % (passes, fails))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
