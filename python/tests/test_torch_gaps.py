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
