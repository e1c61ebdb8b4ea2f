#!/usr/bin/python3
"""Times a mixed ragged step (the serving issue's target): prefill chunks
and single decode tokens of many sequences in one call,
mha.attention_ragged on a paged cache, against the same work as separate
calls, each sequence on a cache of its own (mha.attention with cache=):
the issue asks the one call for >= 0.9x the time of the separate ones.
With --shared-prefix N: --seqs forks of one N-token prompt, --own tokens
each of their own, one decode step with share_prefix on and off (the
issue asks for >= 6x at 32 sequences, N = 4096, 256 own).

    .venv/bin/python bench/ragged_step.py [--prefill 4] [--chunk 512]
        [--decodes 60] [--held 2048] [--heads 32] [--kv-heads 8]
        [--head-dim 128] [--threads 2] [--repeat 7]

Every sequence holds `held` tokens before the step (f16 pages of 64); the
first `prefill` sequences get `chunk` new tokens, the next `decodes` one
each (their keys and values appended, untimed, before both ways).  Prints
the medians of `repeat` timed runs (after one warm-up) and their ratio,
and checks that both ways gave the same bits.
"""
import argparse
import time

import numpy as np

import mha


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prefill", type=int, default=4)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--decodes", type=int, default=60)
    p.add_argument("--held", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="instead: --seqs forks of one prompt of this many "
                        "tokens, each with --own tokens of its own, one "
                        "decode step with share_prefix on and off")
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--own", type=int, default=256)
    a = p.parse_args()
    if a.shared_prefix:
        return shared(a)
    B = a.prefill + a.decodes
    new = [a.chunk] * a.prefill + [1] * a.decodes
    cap = a.held + max(new)
    row = a.kv_heads * a.head_dim
    rng = np.random.default_rng(1)
    paged = mha.PagedKVCache(B, a.kv_heads, a.head_dim, cap, page_size=64,
                             dtype="f16")
    own = [mha.KVCache(1, a.kv_heads, a.head_dim, cap, dtype="f16")
           for _ in range(B)]
    for b in range(B):
        n = a.held + new[b]
        k = rng.uniform(-1, 1, (n, row)).astype(np.float32)
        v = rng.uniform(-1, 1, (n, row)).astype(np.float32)
        paged.append(b, k, v)
        own[b].append(0, k, v)
    q_start = np.cumsum([0] + new)
    q = rng.uniform(-1, 1, (q_start[-1], a.heads * a.head_dim)
                    ).astype(np.float32)

    def one_call():
        return mha.attention_ragged(q, q_start, paged, num_heads=a.heads,
                                    num_threads=a.threads)

    def separate():
        return np.concatenate([
            mha.attention(q[None, q_start[b]:q_start[b + 1]],
                          num_heads=a.heads, cache=own[b],
                          num_threads=a.threads)[0] for b in range(B)])

    def timed(f):
        f()
        ts = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            out = f()
            ts.append((time.perf_counter() - t0) * 1e3)
        return float(np.median(ts)), min(ts), max(ts), out

    m1, lo1, hi1, o1 = timed(one_call)
    m2, lo2, hi2, o2 = timed(separate)
    same = np.array_equal(o1, o2)
    print("ragged step: %d prefill chunks of %d + %d decodes, %d held each, "
          "H %d / H_kv %d, d_h %d, f16 pages of 64, %d threads"
          % (a.prefill, a.chunk, a.decodes, a.held, a.heads, a.kv_heads,
             a.head_dim, a.threads))
    print("  one call       median %.2f ms (%.2f .. %.2f)" % (m1, lo1, hi1))
    print("  separate calls median %.2f ms (%.2f .. %.2f)" % (m2, lo2, hi2))
    print("  separate / one call = %.3f; the same bits: %s"
          % (m2 / m1, same))
    if not same:
        raise SystemExit("the one call and the separate calls differ")


def timed_call(f, repeat):
    f()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = f()
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ts)), min(ts), max(ts), out


def shared(a):
    """One decode step of --seqs sequences forked from one prompt."""
    B, row = a.seqs, a.kv_heads * a.head_dim
    cap = a.shared_prefix + a.own + 1
    rng = np.random.default_rng(1)
    c = mha.PagedKVCache(B, a.kv_heads, a.head_dim, cap, page_size=64,
                         dtype="f16")
    kv = rng.uniform(-1, 1, (2, a.shared_prefix, row)).astype(np.float32)
    c.append(0, kv[0], kv[1])
    for b in range(1, B):
        c.fork(0, b)
    for b in range(B):
        own = rng.uniform(-1, 1, (2, a.own + 1, row)).astype(np.float32)
        c.append(b, own[0], own[1])
    q_start = np.arange(B + 1)
    q = rng.uniform(-1, 1, (B, a.heads * a.head_dim)).astype(np.float32)
    u = c.usage()
    on = timed_call(lambda: mha.attention_ragged(
        q, q_start, c, num_heads=a.heads, num_threads=a.threads,
        share_prefix=True), a.repeat)
    off = timed_call(lambda: mha.attention_ragged(
        q, q_start, c, num_heads=a.heads, num_threads=a.threads),
        a.repeat)
    print("shared prefix: %d sequences forked from %d tokens, %d own each, "
          "one decode token; H %d / H_kv %d, d_h %d, f16 pages of 64, %d "
          "threads; pages %d (%.1f MiB held for %.1f MiB of tokens)"
          % (B, a.shared_prefix, a.own, a.heads, a.kv_heads, a.head_dim,
             a.threads, u["pages_used"], u["bytes"] / 2**20,
             u["token_bytes"] / 2**20))
    print("  share_prefix on   median %.2f ms (%.2f .. %.2f)" % on[:3])
    print("  share_prefix off  median %.2f ms (%.2f .. %.2f)" % off[:3])
    print("  off / on = %.2f; largest difference %.2g"
          % (off[0] / on[0], float(np.abs(on[3] - off[3]).max())))


if __name__ == "__main__":
    main()
