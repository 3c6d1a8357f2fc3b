"""The FlexAttention backend of head-sparse attention (ops/head_sparse_attention/head_sparse_attention_flex.py) against
the reference on the odd shapes of the other backends' tests: outputs through torch's FlexAttention itself (on CPU it
runs eagerly, forward only), and outputs and gradients of query, key, value and gates through a dense evaluation of the
same block mask (FlexAttention has no CPU backward: the GPU benchmark's check section compares its gradients there)."""

import pytest
import torch

from mhmoe.models.ops.backends import head_sparse_attention
from mhmoe.models.ops.head_sparse_attention.head_sparse_attention_flex import head_sparse_attention_flex
from mhmoe.models.ops.head_sparse_attention.head_sparse_attention_naive import head_sparse_attention_naive
from tests.models.ops.test_head_sparse_attention import (
    SCALING,
    TORCH_CASES,
    TRITON_CASES,
    compare,
    make_inputs,
    seen_rows,
)

# (B, H, Hkv, T, L, hd, offset, window, mask, full groups): the Triton cases and the CPU op's decode and prefill cases
CASES = {f"triton-{name}": case for name, case in TRITON_CASES.items()} | {
    name: (*case[:9], case[10]) for name, case in TORCH_CASES.items() if "default-chunk" not in name
}


def dense_attend(query, key, value, block_mask, score_mod, scaling):
    """What FlexAttention computes, evaluated densely: the block mask's `mask_mod` and the `score_mod` over every
    (batch, head, query row, key), softmax over the visible keys, 0 for a row that sees none."""
    batch, heads, tokens, _ = query.shape
    num_keys = key.shape[2]
    b = torch.arange(batch)[:, None, None, None]
    h = torch.arange(heads)[None, :, None, None]
    q_idx = torch.arange(tokens)[None, None, :, None]
    kv_idx = torch.arange(num_keys)[None, None, None, :]
    visible = block_mask.mask_mod(b, h, q_idx, kv_idx).expand(batch, heads, tokens, num_keys)
    groups = heads // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, T, L)
    if score_mod is not None:
        scores = score_mod(scores, b, h, q_idx, kv_idx)
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1) * visible.any(-1, keepdim=True)
    return torch.matmul(probs, value)


def _unpack(case):
    batch, heads, kv_heads, tokens, keys, head_dim, offset, window, mask_kind, full = case
    inputs = make_inputs(batch, heads, kv_heads, tokens, keys, head_dim, offset, mask_kind, full_groups=full)
    return inputs, offset, window


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_flex_attention_forward_matches_reference(case):
    """torch's FlexAttention itself (eager on CPU), fp64: each active pair's output times its gate, 0 elsewhere."""
    (query, key, value, gates, mask), offset, window = _unpack(case)
    with torch.no_grad():
        got = head_sparse_attention_flex(query, key, value, gates, SCALING, mask, offset, window)
        want = head_sparse_attention_naive(query, key, value, gates, SCALING, mask, offset, window)
    seen = seen_rows(query.shape[0], query.shape[2], key.shape[2], offset, window, mask)
    assert got.shape == want.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got[seen], want[seen], rtol=1e-10, atol=1e-10)
    assert (got[~(gates != 0)] == 0).all()  # inactive pairs: exactly 0


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_gradients_through_the_packed_rows_match_reference(case):
    """The gather of each head's active rows, the block mask and the scatter back, with the dense evaluation of
    FlexAttention: outputs and the gradients of query, key, value and gates equal the reference's."""
    inputs, offset, window = _unpack(case)
    compare(head_sparse_attention_flex, inputs, offset, window, attend=dense_attend)


@pytest.mark.parametrize("name", ["gqa-hd12", "static-cache-mha", "float-window"])
def test_binary_gates_leave_inactive_pairs_at_zero(name):
    """0/1 gates without gradient (straight-through gates at inference) are not multiplied in: the inactive pairs
    are 0 because the block mask closes each head's rows past its active count, not because a gate zeroes them."""
    (query, key, value, gates, mask), offset, window = _unpack(TRITON_CASES[name])
    gates = (gates != 0).to(gates.dtype)
    with torch.no_grad():
        got = head_sparse_attention_flex(query, key, value, gates, SCALING, mask, offset, window)
        want = head_sparse_attention_naive(query, key, value, gates, SCALING, mask, offset, window)
    seen = seen_rows(query.shape[0], query.shape[2], key.shape[2], offset, window, mask)
    assert (got[gates == 0] == 0).all() and (gates == 0).any()
    torch.testing.assert_close(got[seen], want[seen], rtol=1e-10, atol=1e-10)


def test_shared_heads_and_a_head_never_active():
    """A head active on every token (shared) and one active on none, in the same batch: the first is plain causal
    attention, the second all zeros."""
    (query, key, value, gates, _), _, _ = _unpack((2, 4, 2, 23, 23, 8, None, None, None, (0,)))
    gates[..., 3] = 0
    with torch.no_grad():
        got = head_sparse_attention_flex(query, key, value, gates, SCALING)
        causal = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), is_causal=True, scale=SCALING
        ).transpose(1, 2)
    torch.testing.assert_close(got[..., :2, :], causal[..., :2, :] * gates[..., :2, None], rtol=1e-10, atol=1e-10)
    assert (got[..., 3, :] == 0).all()


def test_backward_on_cpu_is_refused_in_words():
    (query, key, value, gates, _), _, _ = _unpack(TRITON_CASES["gqa-hd12"])
    query.requires_grad_()
    with pytest.raises(NotImplementedError, match="no backward off CUDA.*moh_head_skipping to True or 'cpu'"):
        head_sparse_attention_flex(query, key, value, gates, SCALING)


def test_the_backends_table_reaches_it():
    (query, key, value, gates, mask), _, _ = _unpack(TRITON_CASES["bool-padding"])
    with torch.no_grad():
        got = head_sparse_attention(query, key, value, gates, SCALING, mask, backend="flex")
        want = head_sparse_attention_flex(query, key, value, gates, SCALING, mask)
    assert torch.equal(got, want)
