#!/usr/bin/python3
"""Times `mha bench` against PyTorch's nn.MultiheadAttention, shape by shape.

For every shape, in one invocation: `mha bench ... --json` (a subprocess)
and torch.nn.MultiheadAttention(E, H, batch_first=True) in eval mode under
torch.no_grad(), need_weights=False, with the same warm-up and repeat
counts and the median of the timed runs.  Causal shapes use `--causal` for
mha and an explicit bool mask (True = blocked) for torch.

Run it with Debian's /usr/bin/python3 (python3-torch, 1.13):

    /usr/bin/python3 bench/compare_torch.py --mha build/mha
    /usr/bin/python3 bench/compare_torch.py --quick
    /usr/bin/python3 bench/compare_torch.py --shape 8,512,768,12 --repeat 5

Notes:
  * torch 1.13 takes its fused "fast path" (torch._native_multi_head_attention)
    for a self-attention with no mask in eval mode under no_grad; with a
    mask (the causal shapes) it takes the general path.  The `path` column
    says which.  Both are fine to time: they are what a user gets.
  * A bias=False self-attention under no_grad crashes in 1.13's fast path,
    so the modules keep their biases (as mha's do).
  * Both sides get OPENBLAS_NUM_THREADS = OMP_NUM_THREADS = --threads,
    set before torch loads: torch's GEMMs run in OpenBLAS, whose thread
    pool torch.set_num_threads() does not govern.
  * `mha bench` accepts only --threads 1 for now; for another thread count
    the mha columns read n/a and torch runs alone.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

DEFAULT_SHAPES = [(32, 10, 512, 8), (1, 1024, 512, 8), (8, 256, 768, 12)]
QUICK_SHAPES = [(32, 10, 512, 8), (4, 64, 256, 4)]


def parse_shape(s):
    try:
        b, l, e, h = (int(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected B,L,E,H, got '{s}'")
    if min(b, l, e, h) < 1 or e % h:
        raise argparse.ArgumentTypeError(
            f"need positive sizes with H dividing E, got '{s}'")
    return (b, l, e, h)


def default_mha():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for d in ("build", "build-bench"):
        p = os.path.join(root, d, "mha")
        if os.access(p, os.X_OK):
            return p
    return None


def run_mha(args, shape, causal):
    """The JSON of `mha bench`, or (None, why)."""
    b, l, e, h = shape
    cmd = [args.mha, "bench", "--batch", str(b), "--seq", str(l),
           "--embed-dim", str(e), "--heads", str(h),
           "--repeat", str(args.repeat), "--warmup", str(args.warmup),
           "--threads", str(args.threads), "--json"]
    if causal:
        cmd.append("--causal")
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(args.threads),
               OMP_NUM_THREADS=str(args.threads))
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env,
                           timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return None, f"skipped: over {args.timeout:g} s"
    if r.returncode != 0:
        return None, r.stderr.strip() or f"exit status {r.returncode}"
    return json.loads(r.stdout), None


def run_torch(args, shape, causal):
    """Median and min ms of nn.MultiheadAttention, and the path taken."""
    import torch
    b, l, e, h = shape
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(e, h, batch_first=True).eval()
    x = torch.rand(b, l, e) * 2 - 1
    mask = torch.ones(l, l, dtype=torch.bool).triu(1) if causal else None
    ms = []
    with torch.no_grad():
        for r in range(args.warmup + args.repeat):
            t0 = time.perf_counter()
            m(x, x, x, need_weights=False, attn_mask=mask)
            t1 = time.perf_counter()
            if r >= args.warmup:
                ms.append((t1 - t0) * 1e3)
    # 1.13's fast path: self-attention, eval, no grad, no mask, even H.
    path = "general" if causal or h % 2 else "fast"
    return statistics.median(ms), min(ms), path


def main():
    ap = argparse.ArgumentParser(
        description="mha bench against torch.nn.MultiheadAttention")
    ap.add_argument("--mha", default=default_mha(),
                    help="the mha executable (default: build/mha)")
    ap.add_argument("--repeat", type=int, default=10,
                    help="timed runs per shape (default 10)")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed runs first (default 2)")
    ap.add_argument("--threads", type=int, default=1,
                    help="threads for torch and mha (default 1)")
    ap.add_argument("--quick", action="store_true",
                    help="small shapes only")
    ap.add_argument("--shape", type=parse_shape, action="append",
                    help="B,L,E,H instead of the default list (repeatable)")
    ap.add_argument("--no-causal", action="store_true",
                    help="skip the causal variants")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="skip a shape whose mha run takes longer (s)")
    ap.add_argument("--markdown", action="store_true",
                    help="print the table as Markdown")
    args = ap.parse_args()
    if args.repeat < 1 or args.warmup < 0 or args.threads < 1:
        ap.error("--repeat and --threads must be >= 1, --warmup >= 0")
    if not args.mha or not os.access(args.mha, os.X_OK):
        ap.error("no mha executable: build it or give --mha PATH")

    # torch calls Debian's OpenBLAS for its GEMMs, and OpenBLAS fixes its
    # own thread pool from the environment when it loads: without this,
    # torch.set_num_threads(1) still multiplies on every core.
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import torch
    torch.set_num_threads(args.threads)
    shapes = args.shape or (QUICK_SHAPES if args.quick else DEFAULT_SHAPES)
    runs = [(s, c) for s in shapes for c in ((False,) if args.no_causal
                                               else (False, True))]

    head = ["shape", "causal", "mha ms", "torch ms", "torch/mha",
            "mha GFLOP/s", "% peak", "attn <= GFLOP/s", "torch path"]
    rows, notes, peaks = [], [], []
    for shape, causal in runs:
        b, l, e, h = shape
        name = f"B={b} L={l} E={e} H={h}"
        j, why = run_mha(args, shape, causal)
        tmed, _, path = run_torch(args, shape, causal)
        if j is None:
            notes.append((f"{name}{' causal' if causal else ''}", why))
            rows.append([name, "yes" if causal else "no", "n/a",
                         f"{tmed:.3f}", "n/a", "n/a", "n/a", "n/a", path])
            continue
        peaks.append(j["peak_gflops"])
        # Upper bound on the attention kernel's speed: the projections
        # take at least proj_gflop / peak of the measured time.
        t_attn = j["median_ms"] * 1e-3 - j["proj_gflop"] / j["peak_gflops"]
        attn_ub = j["attn_gflop"] / t_attn if t_attn > 0 else float("inf")
        rows.append([name, "yes" if causal else "no",
                     f"{j['median_ms']:.3f}", f"{tmed:.3f}",
                     f"{tmed / j['median_ms']:.2f}", f"{j['gflops']:.1f}",
                     f"{j['peak_percent']:.1f}", f"{attn_ub:.1f}", path])

    peak = ""
    if peaks:   # each mha bench run measures its own
        lo, hi = min(peaks), max(peaks)
        peak = (f", FMA peak {lo:.1f} GFLOP/s" if hi - lo < 0.05 else
                f", FMA peak {lo:.1f} to {hi:.1f} GFLOP/s")
    print(f"torch {torch.__version__}, {args.threads} thread(s), "
          f"median of {args.repeat} runs after {args.warmup} warm-up{peak}")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        w = [max(len(head[k]), *(len(r[k]) for r in rows))
             for k in range(len(head))]
        print("  ".join(x.ljust(w[k]) for k, x in enumerate(head)))
        for r in rows:
            print("  ".join(x.ljust(w[k]) for k, x in enumerate(r)))
    print("torch/mha > 1 means mha is faster. 'attn <=' bounds the attention "
          "kernel alone:\nattention GFLOP / (time - projection GFLOP / peak).")
    for why in dict.fromkeys(w for _, w in notes):
        names = [n for n, w in notes if w == why]
        where = "every shape" if len(names) == len(runs) else ", ".join(names)
        print(f"note: mha n/a for {where}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
