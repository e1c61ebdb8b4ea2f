"""MLA's absorbed decoding step at DeepSeek-V3's head shapes on libmha's
latent cache (docs/BENCHMARKS.md): 128 query heads on one latent K/V
head of 576 = kv_lora_rank 512 + qk_rope_head_dim 64, values the first
512 of each key, stored once in f16; one new token per step against
--keys cached tokens.  Prints the median step time, the step's arithmetic
(128 x Lk x (576 + 512) multiply-adds) against an FMA probe of this
machine, and the cache's bytes against the naive one (128 heads x
(192 + 128) per token in f16).

    .venv/bin/python bench/mla_decode.py [--keys 32768] [--repeat 7]
"""
import argparse
import os
import time

import numpy as np

import mha

p = argparse.ArgumentParser()
p.add_argument("--keys", type=int, default=32768)
p.add_argument("--repeat", type=int, default=7)
p.add_argument("--threads", type=int, default=int(os.environ.get(
    "OMP_NUM_THREADS", "2")))
p.add_argument("--dtype", default="f16")
args = p.parse_args()

H, R, RO, DV = 128, 512, 64, 512
L = args.keys
rng = np.random.default_rng(1)
cache = mha.KVCache(1, 1, R + RO, L + 1, dtype=args.dtype, v_head_dim=DV,
                    latent=True)
step = 4096
for t0 in range(0, L, step):
    n = min(step, L - t0)
    cache.append(0, rng.uniform(-1, 1, (n, R + RO)).astype(np.float32), None)
q = rng.uniform(-1, 1, (1, 1, H * (R + RO))).astype(np.float32)
new = rng.uniform(-1, 1, (1, R + RO)).astype(np.float32)
times = []
for it in range(args.repeat + 2):
    cache.append(0, new, None)
    t = time.perf_counter()
    mha.attention(q, num_heads=H, cache=cache, num_threads=args.threads,
                  scale=1 / np.sqrt(192))
    dt = time.perf_counter() - t
    cache.truncate(0, L)
    if it >= 2:
        times.append(dt)
med = float(np.median(times)) * 1e3
flops = 2.0 * H * (L + 1) * (R + RO + DV)
u = cache.usage()
naive = (L + 1) * H * (192 + 128) * 2
print("mla decode: H=%d, latent %d + rope %d, values %d, %d keys, %s, "
      "%d threads" % (H, R, RO, DV, L + 1, args.dtype, args.threads))
print("  step    median %.2f ms (min %.2f, max %.2f over %d)"
      % (med, min(times) * 1e3, max(times) * 1e3, len(times)))
print("  work    %.2f GFLOP: %.1f GFLOP/s" % (flops * 1e-9,
                                              flops / med * 1e-6))
print("  cache   %.1f MiB held (%d bytes a token) against the naive "
      "cache's %.1f MiB: 1/%.1f" % (u["bytes"] / 2 ** 20,
                                    u["bytes"] // (L + 1),
                                    naive / 2 ** 20, naive / u["bytes"]))
