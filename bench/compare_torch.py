#!/usr/bin/python3
"""Times `mha bench` against PyTorch, shape by shape, in one invocation.

Two kinds of comparison, each mha then torch back to back per shape, with
the same warm-up and repeat counts, the median of the timed runs, and the
same thread count T on both sides:

  attention only   `mha bench --attention-only --json` (mha_attention on
                   random pre-projected q, k, v of shape (B, L, H*d_h);
                   d_h 64 and 128) against, on (B, H, L, d_h) tensors under
                   torch.no_grad(),
                   F.scaled_dot_product_attention(q, k, v, is_causal=...)
                   with torch >= 2.0 (its fused flash-style CPU kernel), or
                   on torch 1.13 (no SDPA) the standard formulation
                       s = q @ k.transpose(-2, -1) * scale
                       s = s.masked_fill(mask, -inf)        # causal only
                       torch.softmax(s, -1) @ v
                   with the causal bool mask (True = blocked, triu(1)) made
                   once, outside the timing.
  attention's      `mha bench --attention-only --backward --json` (a
  training step    planned mha_attention_plan_run, then
                   mha_attention_plan_backward: dq, dk, dv) against, on
                   (B, H, L, d_h) tensors with requires_grad,
                   out = F.scaled_dot_product_attention(q, k, v,
                   is_causal=...) then out.backward(g) (torch 1.13: the
                   standard formulation above under autograd); the grads
                   set to None between runs.  The table also gives mha's
                   backward alone as a share of the FMA peak.
  training step    `mha bench --backward --json` (mha_plan_forward then
                   mha_plan_backward: the gradients of the input and of
                   every parameter) against nn.MultiheadAttention in train
                   mode (dropout 0) with autograd: out = m(x, x, x,
                   need_weights=False); (out * g).sum().backward(), x with
                   requires_grad; the gradients are set to None between runs.
  whole module     `mha bench --json` (a planned mha_plan_forward) against
                   torch.nn.MultiheadAttention(E, H, batch_first=True) in
                   eval mode under torch.no_grad(), need_weights=False; the
                   causal shapes use `--causal` for mha and an explicit bool
                   mask (triu(1), True = blocked) for torch.

Run it with the Python whose torch is the peer: PyTorch 2.13 from a
virtual environment (`python3 -m venv V && V/bin/pip install
torch==2.13.0`, then `V/bin/python bench/compare_torch.py ...`), or
Debian's /usr/bin/python3 (python3-torch, 1.13):

    /usr/bin/python3 bench/compare_torch.py --threads 2       # the issue's shapes
    /usr/bin/python3 bench/compare_torch.py --threads 1 --markdown
    /usr/bin/python3 bench/compare_torch.py --quick
    /usr/bin/python3 bench/compare_torch.py --module 8,512,768,12 --no-attention

Notes:
  * Threads: torch.set_num_threads(T), and OPENBLAS_NUM_THREADS =
    OMP_NUM_THREADS = MKL_NUM_THREADS = T set before torch loads (torch's
    GEMMs run in Debian's OpenBLAS, whose thread pool set_num_threads does
    not govern).  `mha bench --threads T` gives T to the attention
    (num_threads) and to OpenBLAS (it re-executes itself with
    OPENBLAS_NUM_THREADS = T).
  * torch 1.13 takes its fused "fast path" (torch._native_multi_head_attention)
    for a self-attention with no mask in eval mode under no_grad; with a
    mask (the causal shapes) it takes the general path.  The `torch path`
    column says which.  Both are what a user gets.
  * GFLOP/s on both sides count 4*d_h per allowed (query, key) pair per
    head (causal: the exact pairs, about half), plus the projections for
    the whole module: the same useful work for both, whatever each
    computes (torch's formulation computes every score and then masks).
  * Two thread pools: OpenBLAS (pthreads) for the GEMMs and OpenMP
    (libgomp) for mha's attention and torch's elementwise work.  Both
    spin-wait after their work by default (libgomp for a while, OpenBLAS
    for 2^28 cycles, ~0.1 s), so with T = the number of cores each pool's
    idle threads can take cores from the other's busy ones.  The header
    prints OMP_WAIT_POLICY and OPENBLAS_THREAD_TIMEOUT when set; run e.g.
    `OMP_WAIT_POLICY=passive OPENBLAS_THREAD_TIMEOUT=4 bench/compare_torch.py`
    to see the difference (both sides inherit the environment).
  * Layouts differ on purpose: each side gets its natural one (mha: heads
    side by side, (B, L, H*d_h), as nn.MultiheadAttention keeps them;
    torch: (B, H, L, d_h) contiguous, the layout SDPA takes).
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

# The targets.
# B, L, H, d_h: the module shapes' attention with d_h 64 and 128
ATTN_SHAPES = [(32, 10, 8, 64), (32, 10, 4, 128), (8, 512, 12, 64),
               (8, 512, 6, 128), (1, 4096, 8, 64), (1, 4096, 4, 128)]
MODULE_SHAPES = [(32, 10, 512, 8), (1, 4096, 512, 8), (8, 512, 768, 12)]
QUICK_ATTN = [(2, 128, 4, 64)]
QUICK_MODULE = [(32, 10, 512, 8), (4, 64, 256, 4)]
TRAIN_SHAPES = [(8, 256, 512, 8)]                          # B, L, E, H
ATTN_BWD_SHAPES = [(8, 512, 12, 64), (1, 4096, 8, 64)]    # B, L, H, d_h
QUICK_ATTN_BWD = [(2, 128, 4, 64)]
QUICK_TRAIN = [(2, 64, 128, 4)]
# Variables that change how the thread pools behave, printed with the
# results (both sides inherit them).
TUNING_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND",
               "OMP_PLACES", "OPENBLAS_THREAD_TIMEOUT", "OPENBLAS_CORETYPE",
               "MHA_ISA")


def online_cpus():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def parse_ints(n, what):
    def parse(s):
        try:
            v = tuple(int(x) for x in s.split(","))
        except ValueError:
            v = ()
        if len(v) != n or min(v) < 1:
            raise argparse.ArgumentTypeError(
                f"expected {what} (positive integers), got '{s}'")
        if what == "B,L,E,H" and v[2] % v[3]:
            raise argparse.ArgumentTypeError(
                f"H must divide E, got '{s}'")
        return v
    return parse


def default_mha():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for d in ("build", "build-bench2", "build-bench"):
        p = os.path.join(root, d, "mha")
        if os.access(p, os.X_OK):
            return p
    return None


def allowed_pairs(lq, lk, causal):
    if not causal:
        return lq * lk
    return sum(min(max(i + lk - lq + 1, 0), lk) for i in range(lq))


def repeat_for(args, seq):
    return args.repeat if seq < 512 else min(args.repeat, args.repeat_big)


def run_mha(args, cmd_tail, repeat):
    """The JSON of `mha bench`, or (None, why)."""
    cmd = [args.mha, "bench", *cmd_tail, "--repeat", str(repeat),
           "--warmup", str(args.warmup), "--threads", str(args.threads),
           "--json"]
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(args.threads),
               OMP_NUM_THREADS=str(args.threads))
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env,
                           timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return None, f"skipped: over {args.timeout:g} s"
    if r.returncode != 0:
        return None, r.stderr.strip() or f"exit status {r.returncode}"
    j = json.loads(r.stdout)
    if j["threads"] != args.threads or j["blas_threads"] != args.threads:
        return None, (f"mha ran {j['threads']} attention / "
                      f"{j['blas_threads']} BLAS threads, not {args.threads}")
    return j, None


def time_calls(fn, warmup, repeat):
    ms = []
    for r in range(warmup + repeat):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        if r >= warmup:
            ms.append((t1 - t0) * 1e3)
    return statistics.median(ms), min(ms)


def torch_dtype(args):
    import torch
    return {"f32": torch.float32, "bf16": torch.bfloat16,
            "f16": torch.float16}[args.dtype]


def torch_attention(args, b, l, h, dh, causal, repeat):
    import torch
    torch.manual_seed(0)
    q, k, v = ((torch.rand(b, h, l, dh) * 2 - 1).to(torch_dtype(args))
               for _ in range(3))
    scale = 1.0 / math.sqrt(dh)
    mask = torch.ones(l, l, dtype=torch.bool).triu(1) if causal else None

    sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention",
                   None)

    def call():
        if sdpa is not None:   # torch >= 2.0: its fused CPU kernel
            return sdpa(q, k, v, is_causal=causal)
        s = q @ k.transpose(-2, -1) * scale
        if mask is not None:
            s = s.masked_fill(mask, float("-inf"))
        return torch.softmax(s, -1) @ v

    with torch.no_grad():
        return time_calls(call, args.warmup, repeat)


def torch_attention_backward(args, b, l, h, dh, causal, repeat):
    import torch
    torch.manual_seed(0)
    q, k, v = ((torch.rand(b, h, l, dh) * 2 - 1).to(torch_dtype(args))
               .requires_grad_() for _ in range(3))
    g = (torch.rand(b, h, l, dh) * 2 - 1).to(torch_dtype(args))
    scale = 1.0 / math.sqrt(dh)
    mask = torch.ones(l, l, dtype=torch.bool).triu(1) if causal else None
    sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention",
                   None)

    def step():
        q.grad = k.grad = v.grad = None
        if sdpa is not None:
            out = sdpa(q, k, v, is_causal=causal)
        else:
            s = q @ k.transpose(-2, -1) * scale
            if mask is not None:
                s = s.masked_fill(mask, float("-inf"))
            out = torch.softmax(s, -1) @ v
        out.backward(g)

    return time_calls(step, args.warmup, repeat)


def torch_module(args, b, l, e, h, causal, repeat):
    import torch
    torch.manual_seed(0)
    dt = torch_dtype(args)   # the module moved to the dtype, as users do
    m = torch.nn.MultiheadAttention(e, h, batch_first=True).eval().to(dt)
    x = (torch.rand(b, l, e) * 2 - 1).to(dt)
    mask = torch.ones(l, l, dtype=torch.bool).triu(1) if causal else None
    with torch.no_grad():
        med, mn = time_calls(
            lambda: m(x, x, x, need_weights=False, attn_mask=mask),
            args.warmup, repeat)
    # 1.13's fast path: self-attention, eval, no grad, no mask, even H.
    return med, mn, "general" if causal or h % 2 else "fast"


def torch_training(args, b, l, e, h, causal, repeat):
    import torch
    torch.manual_seed(0)
    dt = torch_dtype(args)   # the module moved to the dtype, as users do
    m = torch.nn.MultiheadAttention(e, h, batch_first=True).train().to(dt)
    x = (torch.rand(b, l, e) * 2 - 1).to(dt).requires_grad_()
    g = (torch.rand(b, l, e) * 2 - 1).to(dt)
    mask = torch.ones(l, l, dtype=torch.bool).triu(1) if causal else None

    def step():
        m.zero_grad(set_to_none=True)
        x.grad = None
        out, _ = m(x, x, x, need_weights=False, attn_mask=mask)
        (out * g).sum().backward()

    return time_calls(step, args.warmup, repeat)


def print_table(args, title, head, rows):
    print(f"\n{title}")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
        return
    w = [max(len(head[k]), *(len(r[k]) for r in rows))
         for k in range(len(head))]
    print("  ".join(x.ljust(w[k]) for k, x in enumerate(head)).rstrip())
    for r in rows:
        print("  ".join(x.ljust(w[k]) for k, x in enumerate(r)).rstrip())


def main():
    ap = argparse.ArgumentParser(
        description="mha bench against PyTorch: attention only and the "
        "whole nn.MultiheadAttention module")
    ap.add_argument("--mha", default=default_mha(),
                    help="the mha executable (default: build/mha)")
    ap.add_argument("--threads", type=int, default=online_cpus(),
                    help="threads for torch and mha (default: the online "
                    "CPUs)")
    ap.add_argument("--repeat", type=int, default=10,
                    help="timed runs per shape (default 10)")
    ap.add_argument("--repeat-big", type=int, default=5,
                    help="at most this many for shapes with L >= 512 "
                    "(default 5)")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed runs first (default 2)")
    ap.add_argument("--attention", type=parse_ints(4, "B,L,H,D"),
                    action="append", metavar="B,L,H,D",
                    help="attention-only shape, D = d_h (repeatable; "
                    "default: the issue's)")
    ap.add_argument("--module", type=parse_ints(4, "B,L,E,H"),
                    action="append", metavar="B,L,E,H",
                    help="whole-module shape (repeatable; default: the "
                    "issue's)")
    ap.add_argument("--training", type=parse_ints(4, "B,L,E,H"),
                    action="append",
                    help="training-step shape (repeatable); default: the "
                         "issue's 8,256,512,8")
    ap.add_argument("--attention-backward", type=parse_ints(4, "B,L,H,D"),
                    action="append", metavar="B,L,H,D",
                    help="shape of the attention's training step on heads "
                    "(repeatable; default 8,512,12,64 and 1,4096,8,64)")
    ap.add_argument("--no-attention-backward", action="store_true",
                    help="skip the attention's forward + backward table")
    ap.add_argument("--no-training", action="store_true",
                    help="skip the training-step (forward + backward) table")
    ap.add_argument("--no-attention", action="store_true",
                    help="skip the attention-only comparisons")
    ap.add_argument("--no-module", action="store_true",
                    help="skip the whole-module comparisons")
    ap.add_argument("--no-causal", action="store_true",
                    help="skip the causal variants")
    ap.add_argument("--dtype", choices=("f32", "bf16", "f16"), default="f32",
                    help="the data (and its gradients) in this type on "
                         "both sides (mha bench --dtype): q, k, v of the "
                         "attention, and the module's input and output, "
                         "torch's module moved to the type (.to(dtype)), "
                         "libmha's parameters float32 rounded at the call")
    ap.add_argument("--quick", action="store_true",
                    help="small shapes only")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="skip a shape whose mha run takes longer (s)")
    ap.add_argument("--markdown", action="store_true",
                    help="print the tables as Markdown")
    args = ap.parse_args()
    if args.repeat < 1 or args.repeat_big < 1 or args.warmup < 0 or \
            not 1 <= args.threads <= 4096:
        ap.error("--repeat, --repeat-big >= 1, --warmup >= 0, "
                 "--threads in [1, 4096]")
    if not args.mha or not os.access(args.mha, os.X_OK):
        ap.error("no mha executable: build it or give --mha PATH")

    # torch calls Debian's OpenBLAS for its GEMMs, and OpenBLAS fixes its
    # own thread pool from the environment when it loads: without this,
    # torch.set_num_threads(1) still multiplies on every core.
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import torch
    torch.set_num_threads(args.threads)

    attn_shapes = [] if args.no_attention else (
        args.attention or (QUICK_ATTN if args.quick else ATTN_SHAPES))
    mod_shapes = [] if args.no_module else (
        args.module or (QUICK_MODULE if args.quick else MODULE_SHAPES))
    train_shapes = [] if args.no_training else (
        args.training or (QUICK_TRAIN if args.quick else TRAIN_SHAPES))
    attn_bwd_shapes = [] if args.no_attention_backward else (
        args.attention_backward or
        (QUICK_ATTN_BWD if args.quick else ATTN_BWD_SHAPES))
    causals = (False,) if args.no_causal else (False, True)
    notes, peaks, tiers = [], [], set()

    def settle():
        # Let the other process's spinning BLAS / OpenMP threads go to sleep
        # and the kernel settle after torch's large temporaries are freed.
        time.sleep(1.0)

    def measure(shapes, flags, torch_fn):
        """{(shape..., causal): (mha JSON or None, torch median ms, the
        table's last column from torch_fn, why mha is n/a)}"""
        res = {}
        for shape in shapes:
            b, l, e, h = shape
            for causal in causals:
                rep = repeat_for(args, l)
                tail = [*flags, "--batch", str(b), "--seq", str(l),
                        "--embed-dim", str(e), "--heads", str(h)]
                if causal:
                    tail.append("--causal")
                j, why = run_mha(args, tail, rep)
                settle()
                tmed, extra = torch_fn(b, l, e, h, causal, rep)
                settle()
                res[(*shape, causal)] = (j, tmed, extra, why)
                if j:
                    peaks.append(j["peak_gflops"])
                    tiers.add(j["tier"])
        return res

    def attention(b, l, e, h, causal, rep):
        dh = e // h
        tmed, _ = torch_attention(args, b, l, h, dh, causal, rep)
        gflop = 4.0 * b * h * dh * allowed_pairs(l, l, causal) * 1e-9
        return tmed, f"{gflop / (tmed * 1e-3):.1f}"

    def attention_backward(b, l, e, h, causal, rep):
        dh = e // h
        tmed, _ = torch_attention_backward(args, b, l, h, dh, causal, rep)
        gflop = 14.0 * b * h * dh * allowed_pairs(l, l, causal) * 1e-9
        return tmed, f"{gflop / (tmed * 1e-3):.1f}"

    def module(b, l, e, h, causal, rep):
        tmed, _, path = torch_module(args, b, l, e, h, causal, rep)
        return tmed, path

    def training(b, l, e, h, causal, rep):
        return torch_training(args, b, l, e, h, causal, rep)[0], None

    dt = ["--dtype", args.dtype]
    attn_res = {(b, l, h, e // h, c): r for (b, l, e, h, c), r in measure(
        [(b, l, h * dh, h) for b, l, h, dh in attn_shapes],
        ["--attention-only", *dt], attention).items()}
    attn_bwd_res = {(b, l, h, e // h, c): r for (b, l, e, h, c), r in
                    measure([(b, l, h * dh, h)
                             for b, l, h, dh in attn_bwd_shapes],
                            ["--attention-only", "--backward", *dt],
                            attention_backward).items()}
    mod_res = measure(mod_shapes, dt, module)
    train_res = measure(train_shapes, ["--backward", *dt], training)

    peak = ""
    if peaks:   # each mha bench run measures its own
        lo, hi = min(peaks), max(peaks)
        peak = (f"; FMA peak x {args.threads} = {lo:.1f} GFLOP/s"
                if hi - lo < 0.05 else
                f"; FMA peak x {args.threads} = {lo:.1f} to {hi:.1f} GFLOP/s")
    print(f"dtype {args.dtype}; torch {torch.__version__}, mha {args.mha}, kernel tier "
          f"{'/'.join(sorted(tiers)) or '?'}, {args.threads} thread(s) each; "
          f"median of {args.repeat} runs (L >= 512: {args.repeat_big}) after "
          f"{args.warmup} warm-up{peak}")
    tuning = [f"{v}={os.environ[v]}" for v in TUNING_VARS if v in os.environ]
    print("environment: " + (" ".join(tuning) if tuning else
                             "no thread-tuning variables set (defaults)"))

    def table(title, head, res, name_of, more=None):
        """more(j): the columns mha's JSON adds after the torch column."""
        rows = []
        for key, (j, tmed, extra, why) in res.items():
            name, causal = name_of(*key[:-1]), key[-1]
            last = [] if extra is None else [extra]
            if j is None:
                notes.append((f"{name}{' causal' if causal else ''}", why))
                rows.append([name, "yes" if causal else "no", "n/a",
                             f"{tmed:.3f}", "n/a", "n/a", "n/a", *last,
                             *(["n/a"] if more else [])])
                continue
            rows.append([name, "yes" if causal else "no",
                         f"{j['median_ms']:.3f}", f"{tmed:.3f}",
                         f"{tmed / j['median_ms']:.2f}",
                         f"{j['gflops']:.1f}", f"{j['peak_percent']:.1f}",
                         *last, *(more(j) if more else [])])
        if rows:
            print_table(args, title, head, rows)

    common = ["causal", "mha ms", "torch ms", "torch/mha", "mha GFLOP/s",
              "% peak"]
    table("Attention only", ["attention only", *common,
                             "torch GFLOP/s"], attn_res,
          lambda b, l, h, dh: f"B={b} L={l} H={h} d_h={dh}")
    table("Attention's training step on heads (forward + backward: dq, "
          "dk, dv)", ["attention fwd+bwd", *common, "torch GFLOP/s",
                      "mha bwd ms", "mha bwd % peak"], attn_bwd_res,
          lambda b, l, h, dh: f"B={b} L={l} H={h} d_h={dh}",
          lambda j: [f"{j['backward_ms']:.3f}",
                     f"{j['backward_percent']:.1f}"])
    table("Whole module (eval, need_weights=False)",
          ["whole module", *common, "torch path"], mod_res,
          lambda b, l, e, h: f"B={b} L={l} E={e} H={h}")
    table("Training step (forward + backward, all gradients)",
          ["training step", *common], train_res,
          lambda b, l, e, h: f"B={b} L={l} E={e} H={h}")

    print("\ntorch/mha > 1 means mha is faster.")

    # The targets of the "Ahead of today's PyTorch" issue (against PyTorch
    # 2.13), where this run measured them: float32 ones only.
    checks = []
    if args.dtype != "f32":
        return

    def mark(ok):
        return "met" if ok else "NOT met"

    # "Ahead of today's PyTorch": attention alone >= 2x SDPA at every shape
    # (the ratio is against SDPA only when this torch has it, >= 2.0)
    import torch
    have_sdpa = hasattr(torch.nn.functional, "scaled_dot_product_attention")
    for (b, l, h, dh, c), r in attn_res.items():
        if not r or not r[0]:
            continue
        ratio = r[1] / r[0]["median_ms"]
        checks.append(f"attention only B={b} L={l} H={h} d_h={dh}"
                      f"{' causal' if c else ''}: {ratio:.2f}x "
                      f"{'SDPA' if have_sdpa else 'torch (no SDPA)'} >= 2x: "
                      f"{mark(ratio >= 2.0)}")
    for shape, want in (((32, 10, 512, 8), 1.5), ((1, 4096, 512, 8), 2.0),
                        ((8, 512, 768, 12), 1.5)):
        for causal in causals:
            r = mod_res.get((*shape, causal))
            if not r or not r[0]:
                continue
            ratio = r[1] / r[0]["median_ms"]
            b, l, e, h = shape
            checks.append(f"whole module B={b} L={l} E={e} H={h}"
                          f"{' causal' if causal else ''}: {ratio:.2f}x "
                          f"PyTorch >= {want:g}x: {mark(ratio >= want)}")
    # ... and the backward's attention part >= 60% of the FMA peak.
    for (b, l, h, dh, c), r in attn_bwd_res.items():
        if r and r[0]:
            pct = r[0]["backward_percent"]
            checks.append(f"attention backward B={b} L={l} H={h} d_h={dh}"
                          f"{' causal' if c else ''}: {pct:.1f}% of the "
                          f"FMA peak >= 60%: {mark(pct >= 60.0)}")
    r = train_res.get((8, 256, 512, 8, False))
    if r and r[0]:
        ratio = r[1] / r[0]["median_ms"]
        checks.append(f"training step B=8 L=256 E=512 H=8: {ratio:.2f}x "
                      f"PyTorch >= 1.5x: {mark(ratio >= 1.5)}")
    if checks:
        print("targets:")
        for c in checks:
            print(f"  {c}")
    for why in dict.fromkeys(w for _, w in notes):
        names = [n for n, w in notes if w == why]
        print(f"note: mha n/a for {', '.join(names)}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
