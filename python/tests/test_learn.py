"""docs/LEARN.md and python/examples/attention_from_scratch.py: every
step of the learning path runs, and agrees with libmha.

Each check_* of the example builds a float64 NumPy reference from the
definition and asserts mha's float32 result within 1e-5 (1 + max|ref|)
of it (the example's TOL says why that bound); the NumPy rewrites
(online softmax, cached decoding) are held to 1e-12 of the plain
formula, since both are float64.  The document's Python blocks run here
in order, and every function it shows is the example's own text."""
import os
import re
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "..", "examples")
LEARN = os.path.join(HERE, "..", "..", "docs", "LEARN.md")
sys.path.insert(0, EXAMPLES)
import attention_from_scratch as afs  # noqa: E402


@pytest.mark.parametrize("name,fn", afs.STEPS, ids=[s[0] for s in afs.STEPS])
def test_step_agrees_with_mha(name, fn):
    fn()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_steps_on_other_inputs(seed):
    for fn in (afs.check_one_head, afs.check_masks, afs.check_multi_head,
               afs.check_online, afs.check_kv_cache, afs.check_gqa,
               afs.check_rope, afs.check_window_sink):
        fn(seed)


def test_the_checks_can_fail():
    """The bound is tight enough to catch the classic slips: no scale, and
    the row max left in the lse."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((4, 8)) for _ in range(3))
    good = afs.attention(q, k, v)
    unscaled = afs.softmax(q @ k.T) @ v
    with pytest.raises(AssertionError):
        afs.check(unscaled, good, "no scale")
    out, lse = afs.online_attention(q, k, v)
    with pytest.raises(AssertionError):
        afs.check(np.log(np.exp(q @ k.T / np.sqrt(8)).sum(1)) + 1, lse,
                  "lse off by one")


def test_online_attention_never_sees_all_keys_at_once():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((3, 4)) for _ in range(3))
    for tile in (1, 2, 3, 7):
        out, _ = afs.online_attention(q, k, v, tile=tile)
        np.testing.assert_allclose(out, afs.attention(q, k, v), atol=1e-12,
                                   rtol=0)


def python_blocks(text):
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_learn_md_blocks_run():
    with open(LEARN, encoding="utf-8") as f:
        blocks = python_blocks(f.read())
    assert len(blocks) >= 9, "docs/LEARN.md lost its steps"
    with open(os.path.join(EXAMPLES, "attention_from_scratch.py"),
              encoding="utf-8") as f:
        source = f.read()
    ns = {}
    exec("import sys; sys.path.insert(0, %r)\n"
         "from attention_from_scratch import *" % EXAMPLES, ns)
    for n, block in enumerate(blocks):
        if block.startswith("def "):
            # a function shown in the document is the example's, verbatim
            assert block in source, "LEARN.md block %d is not the " \
                "example's text:\n%s" % (n, block)
        exec(compile(block, "LEARN.md block %d" % n, "exec"), ns)
