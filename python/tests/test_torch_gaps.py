"""Issue 42's findings from PyTorch users, each against torch 2.13 itself:
mha.nn reachable from ``import mha`` (and torch not imported by it),
mha.nn.MultiheadAttention inside torch's TransformerEncoder(Layer), double
backward refused, empty batches and sequences, the thread count followed
per call, kdim / vdim of 0 refused."""
import subprocess
import sys

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


# ---- 6: mha.nn after a plain `import mha`, torch imported only then ----------

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
        "print(sorted(n for n in sys.modules\n"
        "             if n == 'torch' or n.startswith(('torch.', 'mha.nn'))))\n"
        "try:\n"
        "    mha.no_such_name\n"
        "except AttributeError as e:\n"
        "    print(e)\n", tmp_path)
    lines = out.splitlines()
    assert lines[0] == "[]"
    assert "no_such_name" in lines[1]


# ---- helpers: one module, torch's twin in float32 and float64 -----------------

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


# ---- 2: double backward refused, first order as torch's ------------------------

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


# ---- 5: the thread count read at every call; kdim / vdim of 0 refused ---------

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
