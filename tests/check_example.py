#!/usr/bin/python3
"""Checks `mha example` against an independent NumPy float64 computation
of the seeds' worked example (section 5.5 of seeds/003: h = 2, d = 4).

Usage: /usr/bin/python3 check_example.py path/to/mha
(Debian's interpreter: it has python3-numpy.)
"""
import re
import subprocess
import sys

import numpy as np

X = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 0, 0]], dtype=np.float64)
# W[head] = (W_Q, W_K, W_V), each (4 x 2), used as X @ W.  Heads are
# numbered from 0, as everywhere in mha (the seed's W1_*, W2_*).
W = {
    0: ([[1, 0], [0, 1], [0, 0], [0, 0]],
        [[0, 1], [1, 0], [0, 0], [0, 0]],
        [[1, 0], [0, 0], [1, 0], [0, 0]]),
    1: ([[0, 0], [0, 0], [1, 0], [0, 1]],
        [[0, 0], [0, 0], [0, 1], [1, 0]],
        [[0, 1], [0, 1], [0, 0], [0, 0]]),
}


def expected():
    heads = {}
    for h, (wq, wk, wv) in W.items():
        q, k, v = (X @ np.array(w, dtype=np.float64) for w in (wq, wk, wv))
        s = q @ k.T / np.sqrt(2.0)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        heads[h] = {"Q": q, "K": k, "V": v, "scores": s, "softmax": p,
                    "out": p @ v}
    return heads


def blocks(text):
    """Maps each printed title line to the matrix printed under it."""
    out, title, rows = {}, None, []
    for line in text.splitlines():
        m = re.match(r"^\s+\[((?:\s+-?\d+\.\d{4})+) \]$", line)
        if m:
            rows.append([float(t) for t in m.group(1).split()])
            continue
        if title is not None and rows:
            out[title] = np.array(rows)
        title, rows = line.strip(), []
    if title is not None and rows:
        out[title] = np.array(rows)
    return out


def main():
    run = subprocess.run([sys.argv[1], "example"], capture_output=True,
                         text=True, check=True)
    got = blocks(run.stdout)
    exp = expected()
    checked = 0
    for h in (0, 1):
        e = exp[h]
        want = {
            f"Q{h} = X W{h}_Q:": e["Q"], f"K{h} = X W{h}_K:": e["K"],
            f"V{h} = X W{h}_V:": e["V"],
            f"scaled scores Q{h} K{h}^T / sqrt(2):": e["scores"],
            f"head {h} output = weights V{h}:": e["out"],
        }
        for title, val in want.items():
            assert title in got, f"missing block {title!r}"
            np.testing.assert_allclose(got[title], val, atol=5.1e-5,
                                       err_msg=title)
            checked += 1
    concat = np.concatenate([exp[0]["out"], exp[1]["out"]], axis=1)
    # blocks() keys the concat matrix by its (empty) title line.
    mats = [v for v in got.values() if v.shape == (3, 4)]
    assert any(np.allclose(m, concat, atol=5.1e-5) for m in mats), \
        "concatenation not found"
    # The softmax blocks share one title, so they are parsed in order.
    soft_rows = re.findall(
        r"softmax weights \(each row sums to 1\):\n((?:\s+\[.*\]\n){3})",
        run.stdout)
    assert len(soft_rows) == 2, "expected two softmax blocks"
    for h, block in zip((0, 1), soft_rows):
        val = np.array([[float(t) for t in r.strip()[1:-1].split()]
                        for r in block.strip().splitlines()])
        np.testing.assert_allclose(val, exp[h]["softmax"], atol=5.1e-5)
        checked += 1
    # The causal step: head 0 under a causal mask (query i sees keys <= i).
    q, k, v = (X @ np.array(w, dtype=np.float64) for w in W[0])
    s = np.where(np.tril(np.ones((3, 3), bool)), q @ k.T / np.sqrt(2.0),
                 -np.inf)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(got["head 0 softmax weights, causal:"], p,
                               atol=5.1e-5)
    assert not np.allclose(p, exp[0]["softmax"], atol=1e-3), \
        "the causal weights must differ from the plain ones"
    causal_out = got["output, causal:"]
    np.testing.assert_allclose(causal_out[:, :2], p @ v, atol=5.1e-5)
    checked += 2
    # The tiles step: keys {1} and {2, 3} of head 0, each tile's (max, sum)
    # printed and merged into the same output as the whole softmax.
    sc = q @ k.T / np.sqrt(2.0)
    tiles = re.findall(r"row (\d): A \(m\s+(\S+), l (\S+)\)\s+"
                       r"B \(m\s+(\S+), l (\S+)\)", run.stdout)
    assert len(tiles) == 3, "the two tiles' (m, l) of each row"
    for row, ma, la, mb, lb in tiles:
        i = int(row) - 1
        for part, m_txt, l_txt in ((sc[i, :1], ma, la), (sc[i, 1:], mb, lb)):
            assert abs(float(m_txt) - part.max()) <= 5.1e-5, (row, m_txt)
            assert abs(float(l_txt) - np.exp(part - part.max()).sum()) \
                <= 5.1e-5, (row, l_txt)
    np.testing.assert_allclose(got["head 0 output from the two tiles:"],
                               exp[0]["out"], atol=5.1e-5)
    checked += 2
    assert "Row 3 of Q1 is zero" in run.stdout, "the zero query's note"
    assert np.all(exp[1]["Q"][2] == 0) and \
        np.allclose(exp[1]["softmax"][2], 1 / 3), "the note's claim"
    assert "differ by chance" in run.stdout and \
        "Different heads put their weight" not in run.stdout, \
        "part 2 must not read chance as specialisation"
    assert "do not follow" in run.stdout, "the note on the seed's slips"
    assert "-- Head 0 --" in run.stdout and "-- Head 2 --" not in run.stdout
    assert "head 3" in run.stdout and "head 4" not in run.stdout, \
        "the larger demo's heads 0..3"
    print(f"mha example: {checked + 1} blocks match NumPy float64")


if __name__ == "__main__":
    main()
