#!/usr/bin/python3
"""Checks `mha viz` (--ascii and --png) against independent NumPy float64
weights: the seeds' worked example (section 5.5 of seeds/003: h = 2, d = 4,
tests/check_example.py's X and W), a causal 300-token self-attention that
both renderings max-pool, and, for batch items, masks, the extra keys and
dropout, the weights `mha forward --attn-weights --per-head` writes.

--ascii: every cell's shade is the documented level of w / (the map's
largest w): ' ' < 0.1 <= '░' < 0.25 <= '▒' < 0.5 <= '▓' < 0.75 <= '█',
after max-pooling to at most 64 cells per axis; the labels are those asked.
--png: the file decodes with libpng (tests/support/png_probe.c) as 8-bit
RGB of exactly the size the layout at the top of tools/cmd_viz.c gives
(mirrored in layout() below), and the centre of every cell of every panel
has the colour of its weight on the colour bar (within 2 of 255 per
channel).

Usage: /usr/bin/python3 check_viz.py MHA PNG_PROBE WORKDIR
"""
import math
import os
import re
import subprocess
import sys

import numpy as np

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "torch_live")]
import st  # noqa: E402  (tests/torch_live/st.py: a safetensors writer)
from check_example import W as SEED_W, X as SEED_X  # noqa: E402

THRESHOLDS = (0.1, 0.25, 0.5, 0.75)
SHADES = " ░▒▓█"
STOPS = np.array([[34, 18, 70], [52, 84, 140], [30, 150, 140],
                  [110, 200, 90], [250, 230, 40]], dtype=np.float64)

MHA, PROBE, WORK = sys.argv[1:4]
checked = {"cells": 0, "pixels": 0, "runs": 0}


def run(*args, ok=True, slice_bytes=None):
    """mha ARGS; slice_bytes: MHA_VIZ_SLICE_BYTES, the memory `mha viz`
    gives one slice of query rows' weights (small: many slices)."""
    env = dict(os.environ)
    if slice_bytes is not None:
        env["MHA_VIZ_SLICE_BYTES"] = str(slice_bytes)
    p = subprocess.run([MHA, *map(str, args)], capture_output=True, text=True,
                       env=env)
    if ok and p.returncode != 0:
        raise AssertionError(f"mha {' '.join(map(str, args))}: {p.stderr}")
    checked["runs"] += 1
    return p.stdout


def path(name):
    return os.path.join(WORK, name)


def save_module(name, inp, H, bias=None, extra=None):
    """A state_dict: in_proj_weight (3E, E), optional biases, W_O = I."""
    E = inp.shape[1]
    t = {"in_proj_weight": inp.astype(np.float32)}
    if bias is not None:
        t["in_proj_bias"] = bias.astype(np.float32)
    t["out_proj.weight"] = np.eye(E, dtype=np.float32)
    if bias is not None:
        t["out_proj.bias"] = np.zeros(E, np.float32)
    t.update(extra or {})
    st.save(path(name), t, {"num_heads": str(H)})
    return path(name)


def npy(name, a):
    np.save(path(name), a)
    return path(name)


def reference(inp, bias, H, x, allow=None):
    """Per-head softmax weights in float64, (H, L, L); a row with no key
    allowed is zero, as mha gives it."""
    E = inp.shape[1]
    dh = E // H
    b = np.zeros(3 * E) if bias is None else bias.astype(np.float64)
    x = x.astype(np.float64)
    q = x @ inp[:E].T.astype(np.float64) + b[:E]
    k = x @ inp[E:2 * E].T.astype(np.float64) + b[E:2 * E]
    out = []
    for h in range(H):
        s = q[:, h * dh:(h + 1) * dh] @ k[:, h * dh:(h + 1) * dh].T
        s /= math.sqrt(dh)
        if allow is not None:
            s = np.where(allow, s, -np.inf)
        m = s.max(axis=1, keepdims=True)
        e = np.exp(s - np.where(np.isfinite(m), m, 0))
        z = e.sum(axis=1, keepdims=True)
        out.append(np.divide(e, z, out=np.zeros_like(e), where=z > 0))
    return np.array(out)


def with_mean(w):
    """(H, Lq, Lt) -> (H + 1, Lq, Lt): the heads, then their mean."""
    return np.concatenate([w, w.mean(axis=0, keepdims=True)])


def max_pool(maps, f_r, f_c):
    n, r, c = maps.shape
    pad = np.zeros((n, -(-r // f_r) * f_r, -(-c // f_c) * f_c))
    pad[:, :r, :c] = maps
    return pad.reshape(n, pad.shape[1] // f_r, f_r, pad.shape[2] // f_c,
                       f_c).max(axis=(2, 4))


# ---- --ascii ---------------------------------------------------------------

def parse_ascii(text):
    """{title: (row label chars, column label chars, [[shade]])}."""
    panels, lines = {}, text.split("\n")
    for n, line in enumerate(lines):
        titles = list(re.finditer(r"(head \d+|mean)(?= )", line))
        if not titles or n + 2 >= len(lines) or " [ " not in lines[n + 2]:
            continue
        cols_line = lines[n + 1]
        rows = []
        for row in lines[n + 2:]:
            if " [ " not in row:
                break
            rows.append(row)
        for t in titles:
            x = t.start()
            nc = (rows[0].index("]", x) - x - 4) // 2
            assert rows[0][x + 2] == "[", f"panel {t.group(1)}: {rows[0]!r}"
            panels[t.group(1)] = (
                "".join(r[x] for r in rows),
                "".join(cols_line[x + 4 + 2 * j] for j in range(nc)),
                [[r[x + 4 + 2 * j] for j in range(nc)] for r in rows])
    return panels


def check_ascii(what, text, maps, row_labels=None, col_labels=None):
    """maps: (H + 1, Lq, Lt) float64, the heads and their mean."""
    H = maps.shape[0] - 1
    f_r = -(-maps.shape[1] // 64)
    f_c = -(-maps.shape[2] // 64)
    pooled = max_pool(maps, f_r, f_c)
    panels = parse_ascii(text)
    # heads numbered from 0, as --head-mask, --keep and the API count them
    titles = [f"head {h}" for h in range(H)] + ["mean"]
    assert sorted(panels) == sorted(titles), f"{what}: panels {list(panels)}"
    if f_r > 1 or f_c > 1:
        assert f"max-pooled {f_r} x {f_c}" in text, f"{what}: no pooling note"
    near = total = 0
    for k, title in enumerate(titles):
        rl, cl, shades = panels[title]
        p = pooled[k]
        assert (len(shades), len(shades[0])) == p.shape, \
            f"{what} {title}: {len(shades)} x {len(shades[0])} cells, " \
            f"expected {p.shape}"
        if row_labels is not None:
            assert rl == row_labels, f"{what} {title}: row labels {rl!r}"
        if col_labels is not None:
            assert cl == col_labels, f"{what} {title}: column labels {cl!r}"
        mx = p.max()
        for i in range(p.shape[0]):
            for j in range(p.shape[1]):
                r = p[i, j] / mx if mx > 0 else 0.0
                total += 1
                # float32 may fall either side of a threshold it is at
                if min(abs(r - t) for t in THRESHOLDS) < 1e-4:
                    near += 1
                    continue
                want = SHADES[sum(r >= t for t in THRESHOLDS)]
                assert shades[i][j] == want, \
                    f"{what} {title} cell ({i}, {j}): w/max = {r:.5f} " \
                    f"should be {want!r}, got {shades[i][j]!r}"
                checked["cells"] += 1
    assert near <= total // 100, f"{what}: {near} cells at a threshold"
    # The largest weight of each map, printed last.
    got = re.search(r"^largest w: (.*)$", text, re.M).group(1)
    for title, k in zip(titles, range(H + 1)):
        v = float(re.search(re.escape(title) + r" ([0-9.]+)", got).group(1))
        assert abs(v - pooled[k].max()) < 6e-5, f"{what} {title}: max {v}"


# ---- --png -----------------------------------------------------------------

def layout(H, Lq, Lt, rows, cols, wmax, item):
    """tools/cmd_viz.c's layout: (width, height, cell, [map origin per panel])."""
    M, G, CAP, TH = 12, 16, 16, 24
    gc = math.ceil(math.sqrt(H))
    gr = -(-H // gc)
    budget = min(256, max(64, 2304 // (gc + 1)))
    f_r, f_c = -(-Lq // budget), -(-Lt // budget)
    nr, nc = -(-Lq // f_r), -(-Lt // f_c)
    cell = min(32, max(1, budget // max(nr, nc)))
    ls = 2 if cell >= 16 else 1

    def longest(labels, f):
        need = -(-12 * ls // cell) * f
        step = next(s * 10 ** e for e in range(20) for s in (1, 2, 5)
                    if s * 10 ** e >= need)
        one = (step - 1) // f * cell >= 12 * ls
        return max([len(labels[p - 1]) for p in range(1, len(labels) + 1)
                    if p % step == 0 or (p == 1 and one)] + [0])

    RW = 6 * ls * longest(rows, f_r) + 4
    CH = 6 * ls * longest(cols, f_c) + 4
    IW = max(nc * cell, 12 * len(f"head {H - 1}"))   # the longest title
    PW, PH = RW + IW, TH + CH + nr * cell
    top = M + CAP
    mean_x = M + gc * (PW + G) + G
    bar_x, bar_y = mean_x + PW + G, top + TH + CH
    bar_h = max(nr * cell, 64)
    ticks = ["%.3g" % wmax, "%.3g" % (wmax / 2), "0"]
    caption = f"batch item {item}: queries (rows) x keys (columns)"
    if f_r > 1 or f_c > 1:
        caption += f", max-pooled {f_r} x {f_c}"
    width = max(bar_x + 20 + 6 * ls * max(map(len, ticks)) + M,
                2 * M + 6 * len(caption))
    height = max(top + gr * PH + (gr - 1) * G, bar_y + bar_h) + M
    origins = [(M + (h % gc) * (PW + G) + RW,
                top + (h // gc) * (PH + G) + TH + CH) for h in range(H)]
    origins.append((mean_x + RW, top + TH + CH))
    return width, height, cell, (f_r, f_c), origins


def ramp(t):
    t = np.clip(t, 0.0, 1.0)
    k = np.minimum((t * 4).astype(int), 3)
    f = (t * 4 - k)[..., None]
    return np.floor(STOPS[k] + f * (STOPS[k + 1] - STOPS[k]) + 0.5)


def check_png(what, png, stdout, maps, rows, cols, item=0):
    H, Lq, Lt = maps.shape[0] - 1, maps.shape[1], maps.shape[2]
    raw = png + ".rgb"
    p = subprocess.run([PROBE, png, raw], capture_output=True, text=True)
    assert p.returncode == 0, f"{what}: libpng cannot decode {png}: {p.stderr}"
    w, h, depth, ctype = map(int, p.stdout.split())
    assert (depth, ctype) == (8, 2), f"{what}: not 8-bit RGB: {p.stdout}"
    said = re.search(r"wrote .*: (\d+) x (\d+) px", stdout)
    assert said and (int(said.group(1)), int(said.group(2))) == (w, h), \
        f"{what}: decoded {w} x {h}, mha said {stdout!r}"
    wmax = maps.max()
    W_, H_, cell, (f_r, f_c), origins = layout(H, Lq, Lt, rows, cols,
                                               wmax, item)
    assert (w, h) == (W_, H_), f"{what}: {w} x {h} px, expected {W_} x {H_}"
    img = np.fromfile(raw, np.uint8).reshape(h, w, 3).astype(np.float64)
    pooled = max_pool(maps, f_r, f_c)
    for k, (x0, y0) in enumerate(origins):
        nr, nc = pooled[k].shape
        ys = y0 + np.arange(nr) * cell + cell // 2
        xs = x0 + np.arange(nc) * cell + cell // 2
        got = img[ys[:, None], xs[None, :]]
        want = ramp(pooled[k] / wmax)
        bad = np.abs(got - want).max(axis=-1) > 2
        assert not bad.any(), \
            f"{what} panel {k}: {bad.sum()} cells off the colour scale, " \
            f"first at {np.argwhere(bad)[0]}"
        checked["pixels"] += nr * nc


def labels_of(n):
    return [str(i + 1) for i in range(n)]


def digits(n, f=1):
    """--ascii's position labels: the last digit of each cell's first."""
    return "".join(str((i + 1) % 10) for i in range(0, n, f))


def main():
    os.makedirs(WORK, exist_ok=True)

    # -- the seeds' worked example: in_proj rows from the seed's W (X @ W)
    E, H, dh = 4, 2, 2
    inp = np.zeros((3 * E, E))
    for h in range(H):
        for p in range(3):
            inp[p * E + h * dh:p * E + (h + 1) * dh] = np.array(
                SEED_W[h][p]).T
    seed = save_module("seed.safetensors", inp, H)
    x = npy("x.npy", SEED_X.astype(np.float32))
    maps = with_mean(reference(inp, None, H, SEED_X))
    out = run("viz", "--weights", seed, "--query", x, "--ascii")
    check_ascii("worked example", out, maps, "123", "123")
    assert "batch item 0: 2 heads, 3 queries (rows) x 3 keys" in out, out
    # Tokens, on one line or one per line, label both axes.
    with open(path("tok1.txt"), "w") as f:
        f.write("The cat sat\n")
    with open(path("tok3.txt"), "w") as f:
        f.write("The\n  cat \nsat")
    for t in ("tok1.txt", "tok3.txt"):
        out = run("viz", "--weights", seed, "--query", x, "--ascii",
                  "--tokens", path(t))
        check_ascii("worked example, " + t, out, maps, "Tcs", "Tcs")
    # A batched query: --batch-index picks the item.
    xb = np.stack([SEED_X[::-1], SEED_X]).astype(np.float32)
    xbp = npy("xb.npy", xb)
    out = run("viz", "--weights", seed, "--query", xbp, "--ascii",
              "--batch-index", 1)
    check_ascii("worked example as batch item 1", out, maps, "123", "123")
    assert out.startswith("batch item 1: "), out
    out = run("viz", "--weights", seed, "--query", xbp, "--ascii")
    check_ascii("batch item 0", out,
                with_mean(reference(inp, None, H, SEED_X[::-1])))
    # The PNG, with and without tokens.
    for name, extra, rows in (("seed.png", [], labels_of(3)),
                              ("seed_tok.png", ["--tokens", path("tok1.txt")],
                               ["The", "cat", "sat"])):
        out = run("viz", "--weights", seed, "--query", x, "--png",
                  path(name), *extra)
        check_png("worked example " + name, path(name), out, maps, rows, rows)
    # Both at once.
    out = run("viz", "--weights", seed, "--query", x, "--ascii", "--png",
              path("both.png"))
    check_ascii("--ascii with --png", out, maps, "123", "123")
    check_png("--png with --ascii", path("both.png"), out, maps,
              labels_of(3), labels_of(3))

    # -- 300 tokens, causal, biases: max-pooled 5 x 5 (--ascii), 2 x 2 (--png)
    rng = np.random.default_rng(7)
    E, H, L = 16, 4, 300
    inp = rng.standard_normal((3 * E, E)).astype(np.float32)
    bias = rng.standard_normal(3 * E).astype(np.float32) * 0.1
    big = save_module("big.safetensors", inp, H, bias)
    xl = rng.standard_normal((L, E)).astype(np.float32)
    xlp = npy("xl.npy", xl)
    causal = np.tril(np.ones((L, L), bool))
    maps = with_mean(reference(inp, bias, H, xl, causal))
    out = run("viz", "--weights", big, "--query", xlp, "--causal", "--ascii")
    check_ascii("L=300 causal", out, maps, digits(L, 5), digits(L, 5))
    out = run("viz", "--weights", big, "--query", xlp, "--causal", "--png",
              path("big.png"))
    assert "max-pooled" in out, out
    check_png("L=300 causal", path("big.png"), out, maps, labels_of(L),
              labels_of(L))
    # The same in slices of 37 query rows (4 heads x 300 keys x 4 bytes a
    # row; the slices are evened out: 9 of 34 rows), pooled as they come:
    # slice and pooling-cell boundaries do not line up.
    row_bytes = H * L * 4
    out = run("viz", "--weights", big, "--query", xlp, "--causal", "--ascii",
              "--png", path("sliced.png"), slice_bytes=37 * row_bytes)
    check_ascii("L=300 causal, 9 slices", out, maps, digits(L, 5),
                digits(L, 5))
    check_png("L=300 causal, 9 slices", path("sliced.png"), out, maps,
              labels_of(L), labels_of(L))

    # -- 10 heads on 2 positions: the panels are as wide as their titles,
    # "head 0" .. "head 9" (12 px a character), not their 2 cells of 32 px
    E, H, L = 20, 10, 2
    inp = rng.standard_normal((3 * E, E)).astype(np.float32)
    ten = save_module("ten.safetensors", inp, H)
    xt = rng.standard_normal((L, E)).astype(np.float32)
    xtp = npy("xt.npy", xt)
    maps = with_mean(reference(inp, None, H, xt))
    out = run("viz", "--weights", ten, "--query", xtp, "--ascii")
    check_ascii("10 heads", out, maps, "12", "12")
    out = run("viz", "--weights", ten, "--query", xtp, "--png",
              path("ten.png"))
    check_png("10 heads", path("ten.png"), out, maps, labels_of(L),
              labels_of(L))

    # -- against mha forward's own weights: masks on batch item 1 (only that
    # item is computed), bias_k and the zero key, dropout (the whole batch).
    E, H = 8, 2
    wkv = path("wkv.safetensors")
    run("init", "--embed-dim", E, "--heads", H, "--add-bias-kv",
        "--add-zero-attn", "--seed", 4, "--out", wkv)
    q = npy("q.npy", rng.standard_normal((2, 5, E)).astype(np.float32))
    k = npy("k.npy", rng.standard_normal((2, 6, E)).astype(np.float32))
    am = npy("am.npy", np.where(rng.random((2, 5, 6)) < 0.8, 0,
                                -np.inf).astype(np.float32))
    km = npy("km.npy", np.array([[1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 0]],
                                bool))
    kl = npy("kl.npy", np.array([6, 4], np.int64))
    with open(path("ktok.txt"), "w") as f:
        f.write("alpha beta gamma delta epsilon zeta")
    b4 = npy("b4.npy", np.where(rng.random((2, 2, 5, 6)) < 0.7, 0,
                                -2.5).astype(np.float32))
    cases = [
        ("masks", [wkv, "--key", k, "--attn-mask", am, "--key-mask", km,
                   "--key-lengths", kl], 1),
        ("dropout", [wkv, "--key", k, "--train", "--dropout", "0.4",
                     "--seed", 3], 1),
        ("dropout item 0", [wkv, "--key", k, "--train", "--dropout", "0.4",
                            "--seed", 3], 0),
        # Everything that depends on a query's position, for the slices:
        # top-left causal with Lq != Lk, ALiBi, the window, RoPE; and a
        # (B, H, Lq, Lk) mask whose rows each slice copies.
        ("positions", [wkv, "--key", k, "--causal-top-left", "--alibi",
                       "--window", "3,1", "--rope", "neox", "--attn-mask",
                       b4], 1),
        ("positions, bottom-right", [wkv, "--key", k, "--causal", "--alibi",
                                     "--window", "2,0", "--rope", "gptj"], 0),
    ]
    for (what, args, item), sb in [(c, sb) for c in cases
                                   for sb in (None, 1, 2 * 2 * 8 * 4)]:
        # sb: the whole, then slices of one row, then of two rows of the
        # whole batch (--train) or of one item (2 heads x 8 keys x 4 bytes)
        what = what if sb is None else f"{what}, slices of {sb} bytes"
        fw = path("fw.npy")
        run("forward", "--weights", *args, "--query", q, "--out",
            path("fo.npy"), "--attn-weights", fw, "--per-head")
        maps = with_mean(np.load(fw)[item].astype(np.float64))
        if what.startswith("dropout"):   # nothing else masks a weight here
            assert (np.load(fw) == 0).any(), "dropout dropped nothing"
        out = run("viz", "--weights", *args, "--query", q, "--ascii",
                  "--batch-index", item, "--key-tokens", path("ktok.txt"),
                  slice_bytes=sb)
        # keys: the tokens' initials, then bias_k's and the zero key's
        check_ascii(what, out, maps, digits(5), "abgdezbz")
        out = run("viz", "--weights", *args, "--query", q, "--png",
                  path("kv.png"), "--batch-index", item, "--key-tokens",
                  path("ktok.txt"), slice_bytes=sb)
        check_png(what, path("kv.png"), out, maps, labels_of(5),
                  ["alpha", "beta", "gamma", "delta", "epsilo", "zeta",
                   "bias_k", "zero"], item)

    print(f"mha viz: {checked['cells']} ASCII cells and {checked['pixels']} "
          f"PNG cells match NumPy float64 and mha forward "
          f"({checked['runs']} runs)")


if __name__ == "__main__":
    main()
