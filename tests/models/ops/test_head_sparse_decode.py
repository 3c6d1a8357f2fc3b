"""The CPU decoding step's attention op (`ops/head_sparse_attention/head_sparse_decode_sdpa.py`) against attention
written out by hand (scores, softmax, weighted values) per query head: one call over every key/value head, and by
runs of key/value heads (the heads of the others 0), with GQA, without and with a padding mask, on odd sizes."""

import pytest
import torch

from mhmoe.models.ops import backends


def by_hand(query, key, value, scaling, mask):
    """(B, n, hd): each query head against its key/value head (head // g)."""
    groups = query.shape[1] // key.shape[1]
    out = torch.empty_like(query)
    for head in range(query.shape[1]):
        scores = torch.einsum("bd,bld->bl", query[:, head], key[:, head // groups]) * scaling
        if mask is not None:
            scores = scores.masked_fill(~mask[:, 0, 0], float("-inf"))
        out[:, head] = torch.einsum("bl,bld->bd", scores.softmax(-1), value[:, head // groups])
    return out


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("kv_runs", [None, ((0, 1), (2, 4)), ((1, 2), (4, 5))])
def test_decode_attention_by_runs_equals_attention_by_hand(kv_runs, groups, masked):
    generator = torch.Generator().manual_seed(0)
    batch, kv_heads, length, head_dim = 2, 5, 37, 12
    query = torch.randn(batch, kv_heads * groups, head_dim, generator=generator)
    key, value = (torch.randn(batch, kv_heads, length, head_dim, generator=generator) for _ in range(2))
    mask = None
    if masked:
        mask = torch.ones(batch, 1, 1, length, dtype=torch.bool)
        mask[1, ..., :9] = False  # left padding of row 1
    got = backends.head_sparse_decode(query, key, value, 0.3, mask, kv_runs)
    expected = by_hand(query, key, value, 0.3, mask)
    read = [h for start, end in (kv_runs or ((0, kv_heads),)) for h in range(start * groups, end * groups)]
    unread = [h for h in range(kv_heads * groups) if h not in read]
    torch.testing.assert_close(got[:, read], expected[:, read], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, unread], torch.zeros_like(got[:, unread]))


def test_unread_key_value_heads_are_not_read():
    """NaN in the key/value heads outside the runs changes nothing."""
    query, key, value = torch.randn(1, 4, 8), torch.randn(1, 4, 16, 8), torch.randn(1, 4, 16, 8)
    clean = backends.head_sparse_decode(query, key, value, 0.5, None, ((0, 1), (3, 4)))
    key[:, 1:3], value[:, 1:3] = float("nan"), float("nan")
    assert torch.equal(backends.head_sparse_decode(query, key, value, 0.5, None, ((0, 1), (3, 4))), clean)
