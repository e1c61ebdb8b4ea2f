"""Shared helpers of the Python tests.

The error rule (as tests/torch_live/parity.py): the reference is PyTorch
in float64 on the same float32-valued inputs; our error must be within a
factor of torch-float32's own error on the same computation,

    forward   max|ours - ref64| <= 2 * max|torch32 - ref64| + 1e-6 (1 + max|ref64|)
    backward  max|ours - ref64| <= 3 * max|torch32 - ref64| + eps32 max|ref64|
"""
import numpy as np
import pytest
import torch

torch.set_num_threads(1)

FLT_EPS = float(np.finfo(np.float32).eps)


def _a(x):
    if isinstance(x, torch.Tensor):
        return x.detach().double().numpy()
    return np.asarray(x, dtype=np.float64)


def check_close(ours, t32, ref64, factor, name, backward=False):
    ours, t32, ref64 = _a(ours), _a(t32), _a(ref64)
    assert ours.shape == ref64.shape, "%s: shape %s, expected %s" % (
        name, ours.shape, ref64.shape)
    assert np.isfinite(ref64).all(), "%s: the reference has NaN" % name
    big = float(np.abs(ref64).max()) if ref64.size else 0.0
    err = float(np.abs(ours - ref64).max()) if ref64.size else 0.0
    terr = float(np.abs(t32 - ref64).max()) if ref64.size else 0.0
    floor = FLT_EPS * big if backward else 1e-6 * (1.0 + big)
    bound = factor * terr + floor
    assert err <= bound, ("%s: error %.3g > bound %.3g (torch float32's "
                          "error %.3g)" % (name, err, bound, terr))


@pytest.fixture
def rng():
    return np.random.default_rng(12345)
