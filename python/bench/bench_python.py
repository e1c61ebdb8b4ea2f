#!/usr/bin/env python3
"""Speed from Python, in one process: libmha through its binding against
the C figures of the same shapes (`mha bench --json`, run between the
Python timings) and against PyTorch's own nn.MultiheadAttention and
F.scaled_dot_product_attention; then all-MiniLM-L6-v2's encoding
throughput with libmha's attention against the unmodified model.

    .venv/bin/python python/bench/bench_python.py [--threads 2] [--rounds 5]
                     [--mha build/mha] [--markdown] [--quick]

Each round times every case once (W warm-up and N timed calls, the median
of the N), cases interleaved so that a slow spell of this shared machine
touches all of them alike; the table gives, per case, the median over the
rounds and the range [min, max].  Rows:

  module      mha.Module.forward (NumPy arrays)          vs `mha bench`
              mha.nn.MultiheadAttention (eval, no_grad)  vs `mha bench`
              torch.nn.MultiheadAttention (eval, no_grad, need_weights=False)
  attention   mha.attention (NumPy, (B, L, H*d))         vs `mha bench
                                                            --attention-only`
              mha.nn.functional.scaled_dot_product_attention ((B, H, L, d):
                  it copies to and from libmha's layout)
              torch.nn.functional.scaled_dot_product_attention
  overhead    binding = Python call / C call at the same shape; at the
              smallest shape the difference in microseconds per call.

Threads: torch.set_num_threads(T) and OMP/OPENBLAS/MKL_NUM_THREADS = T
before torch loads; num_threads = T for libmha; `mha bench --threads T`.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mha", default=os.path.join(REPO, "build", "mha"))
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="small shapes, 2 rounds (a smoke run)")
    ap.add_argument("--no-minilm", action="store_true")
    return ap.parse_args()


ARGS = parse()
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mha  # noqa: E402
import mha.nn  # noqa: E402
import mha.nn.functional  # noqa: E402

torch.set_num_threads(ARGS.threads)


def median_ms(fn, warmup, repeat):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def c_bench(kind, B, L, E, H, warmup, repeat):
    cmd = [ARGS.mha, "bench", "--batch", str(B), "--seq", str(L),
           "--embed-dim", str(E), "--heads", str(H), "--threads",
           str(ARGS.threads), "--repeat", str(repeat), "--warmup",
           str(warmup), "--json"]
    if kind == "attention":
        cmd.append("--attention-only")
    # this process's OpenMP pools (libmha's and torch's) spin for a while
    # after their last work: let them sleep before the C run takes the cores
    time.sleep(0.2)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    j = json.loads(out.stdout)
    return float(j["median_ms"])


class ModuleCase:
    def __init__(self, B, L, E, H, warmup, repeat):
        self.name = "module B=%d L=%d E=%d H=%d" % (B, L, E, H)
        self.shape = (B, L, E, H)
        self.warmup, self.repeat = warmup, repeat
        r = np.random.default_rng(0)
        self.x = r.uniform(-1, 1, (B, L, E)).astype(np.float32)
        self.m = mha.Module(E, H, seed=1)
        torch.manual_seed(0)
        self.ours = mha.nn.MultiheadAttention(E, H, batch_first=True).eval()
        self.torch = torch.nn.MultiheadAttention(E, H,
                                                 batch_first=True).eval()
        self.torch.load_state_dict(self.ours.state_dict())
        self.xt = torch.from_numpy(self.x)

    def run(self):
        T = ARGS.threads
        w, n = self.warmup, self.repeat
        res = {"C": c_bench("module", *self.shape, w, n)}
        res["numpy"] = median_ms(lambda: self.m.forward(self.x,
                                                        num_threads=T), w, n)
        with torch.no_grad():
            x = self.xt
            res["mha.nn"] = median_ms(
                lambda: self.ours(x, x, x, need_weights=False), w, n)
            res["torch"] = median_ms(
                lambda: self.torch(x, x, x, need_weights=False), w, n)
        return res


class AttentionCase:
    def __init__(self, B, L, H, d, warmup, repeat):
        self.name = "attention B=%d L=%d H=%d d=%d" % (B, L, H, d)
        self.shape = (B, L, H * d, H)
        self.H = H
        self.warmup, self.repeat = warmup, repeat
        r = np.random.default_rng(0)
        self.q, self.k, self.v = (r.uniform(-1, 1, (B, L, H * d))
                                  .astype(np.float32) for _ in range(3))
        self.qt, self.kt, self.vt = (torch.from_numpy(a).view(B, L, H, d)
                                     .transpose(1, 2).contiguous()
                                     for a in (self.q, self.k, self.v))

    def run(self):
        T = ARGS.threads
        w, n = self.warmup, self.repeat
        res = {"C": c_bench("attention", *self.shape, w, n)}
        res["numpy"] = median_ms(lambda: mha.attention(
            self.q, self.k, self.v, num_heads=self.H, num_threads=T), w, n)
        with torch.no_grad():
            q, k, v = self.qt, self.kt, self.vt
            res["mha.nn"] = median_ms(
                lambda: mha.nn.functional.scaled_dot_product_attention(
                    q, k, v), w, n)
            res["torch"] = median_ms(
                lambda: F.scaled_dot_product_attention(q, k, v), w, n)
        return res


def minilm_case(rounds):
    sys.path.insert(0, os.path.join(REPO, "python", "examples"))
    import minilm
    orig = minilm.load_model()
    ours, _ = minilm.convert(orig)
    text = " ".join(minilm.generated_sentences(40, seed=7))
    enc = orig.tokenizer([text] * 32, padding="max_length", truncation=True,
                         max_length=128, return_tensors="pt")
    assert enc["input_ids"].shape == (32, 128)
    res = {"original": [], "libmha": []}
    with torch.no_grad():
        for _ in range(rounds):
            for name, model in (("original", orig), ("libmha", ours)):
                bert = minilm.bert_of(model)
                res[name].append(median_ms(lambda: bert(**enc), 1, 5))
    return res


def fmt(v):
    return "%.3f" % v if v < 10 else "%.1f" % v


def summary(vals):
    return statistics.median(vals), min(vals), max(vals)


def main():
    if not os.path.exists(ARGS.mha):
        sys.exit("bench_python: %s not found (build the C project first, or "
                 "--mha PATH)" % ARGS.mha)
    R = 2 if ARGS.quick else ARGS.rounds
    if ARGS.quick:
        cases = [ModuleCase(1, 1, 64, 4, 20, 200),
                 ModuleCase(4, 64, 256, 4, 3, 10),
                 AttentionCase(2, 128, 4, 64, 3, 10)]
    else:
        cases = [ModuleCase(1, 1, 64, 4, 50, 2000),     # the smallest
                 ModuleCase(32, 10, 512, 8, 5, 50),
                 ModuleCase(8, 512, 768, 12, 2, 10),
                 AttentionCase(1, 1, 4, 16, 50, 2000),  # the smallest
                 AttentionCase(8, 512, 12, 64, 2, 10),
                 AttentionCase(1, 4096, 8, 64, 1, 3)]
    runs = {c.name: [] for c in cases}
    for r in range(R):
        for c in cases:
            runs[c.name].append(c.run())
        print("round %d of %d done" % (r + 1, R), file=sys.stderr)

    print("libmha %s (%s tier), torch %s, %d threads, %d rounds; medians "
          "over rounds [min, max], ms per call" % (
              mha.__version__, mha.kernel_tier(), torch.__version__,
              ARGS.threads, R))
    hdr = ("| case | C (mha bench) | NumPy level | binding cost | mha.nn "
           "| binding cost | torch 2.13 | torch / mha.nn |")
    print(hdr)
    print("|---|---|---|---|---|---|---|---|")
    for c in cases:
        rs = runs[c.name]
        cols = {k: summary([x[k] for x in rs]) for k in rs[0]}
        # the binding's cost: each round's Python time over that round's C
        ov_np = summary([x["numpy"] / x["C"] - 1 for x in rs])
        ov_nn = summary([x["mha.nn"] / x["C"] - 1 for x in rs])
        us_np = summary([1e3 * (x["numpy"] - x["C"]) for x in rs])
        us_nn = summary([1e3 * (x["mha.nn"] - x["C"]) for x in rs])
        ratio = summary([x["torch"] / x["mha.nn"] for x in rs])

        def cell(t):
            return "%s [%s, %s]" % (fmt(t[0]), fmt(t[1]), fmt(t[2]))

        def cost(p, us):
            return "%+.1f%% (%+.1f µs) [%+.1f, %+.1f]%%" % (
                100 * p[0], us[0], 100 * p[1], 100 * p[2])
        print("| %s | %s | %s | %s | %s | %s | %s | %.2f [%.2f, %.2f] |" % (
            c.name, cell(cols["C"]), cell(cols["numpy"]), cost(ov_np, us_np),
            cell(cols["mha.nn"]), cost(ov_nn, us_nn), cell(cols["torch"]),
            *ratio))
    if not ARGS.no_minilm:
        m = minilm_case(R)
        o, l = summary(m["original"]), summary(m["libmha"])
        sp = summary([a / b for a, b in zip(m["original"], m["libmha"])])
        print()
        print("all-MiniLM-L6-v2, batch 32 x 128 tokens, BertModel forward "
              "(no_grad): original %s ms [%s, %s] = %.0f sentences/s; "
              "libmha's attention %s ms [%s, %s] = %.0f sentences/s; "
              "original / libmha %.2f [%.2f, %.2f]" % (
                  fmt(o[0]), fmt(o[1]), fmt(o[2]), 32e3 / o[0],
                  fmt(l[0]), fmt(l[1]), fmt(l[2]), 32e3 / l[0], *sp))


if __name__ == "__main__":
    main()
