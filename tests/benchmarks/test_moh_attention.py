"""benchmarks/moh_attention.py's `skip` variant, the earlier CPU decoding loop for MoH (`skipped_heads_attention`,
per query row, runs of active heads): equal to the masked reference, GQA and masks included."""

import sys
from pathlib import Path

import pytest
import torch

from mhmoe.models.moh.head_routers import HEAD_ROUTERS
from tests.causal_lm_tester import randomise_moh_routers as randomise_routers
from tests.models.moh_reference import masked_heads_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from moh_attention import skipped_heads_attention  # noqa: E402

HIDDEN, HEADS = 32, 8

SKIP_CASES = [(kv, mask, seq) for kv in (8, 4, 2, 1) for mask in ("none", "bool", "float") for seq in (1, 3)]


@pytest.mark.parametrize("kv_heads,mask_kind,seq", [case for case in SKIP_CASES if case[1] != "none" or case[2] == 1])
def test_head_skipping_equals_masked_computation(kv_heads, mask_kind, seq):
    """The earlier decoding loop `skipped_heads_attention` (kept for the benchmarks); without a mask only single-token
    queries."""
    torch.manual_seed(kv_heads * 7 + seq)
    batch, head_dim, length = 2, 4, 11
    query = torch.randn(batch, HEADS, seq, head_dim)
    key, value = torch.randn(batch, kv_heads, length, head_dim), torch.randn(batch, kv_heads, length, head_dim)
    router = HEAD_ROUTERS["learned"](HIDDEN, HEADS, 2, 3)
    randomise_routers(router)
    gates, _, _ = router(torch.randn(batch, seq, HIDDEN), None)  # soft gates: weighted heads, zeros elsewhere
    assert (gates != 0).sum(-1).eq(5).all()
    o_proj = torch.nn.Linear(HEADS * head_dim, HIDDEN, bias=True)
    mask = None
    if mask_kind != "none":
        visible = torch.ones(batch, 1, seq, length, dtype=torch.bool)
        visible[1, ..., :4] = False  # left padding of row 1
        visible[..., -seq:] &= torch.tril(torch.ones(seq, seq, dtype=torch.bool))  # causal among the new tokens
        mask = visible
        if mask_kind == "float":
            mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    with torch.no_grad():
        expected = masked_heads_attention(query, key, value, mask, gates, o_proj, head_dim**-0.5)
        got = skipped_heads_attention(query, key, value, mask, gates, o_proj, head_dim**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # and the masked reference is what the model computes: gates on the per-head outputs of a standard attention
    dense = torch.nn.functional.scaled_dot_product_attention(
        query,
        key.repeat_interleave(HEADS // kv_heads, 1),
        value.repeat_interleave(HEADS // kv_heads, 1),
        attn_mask=mask if mask is not None else None,
    ).transpose(1, 2)
    torch.testing.assert_close(o_proj((dense * gates[..., None]).flatten(2)), expected, rtol=1e-5, atol=1e-6)
