"""Head-sparse attention on torch's FlexAttention: each head's active query rows gathered to the front, attended with a
block mask that skips the padding and keeps causal block skipping (issue #52's torch-native design, measured against
the Triton kernel by benchmarks/gpu_head_sparse.py).

Per (batch row, head), the tokens where the head is active come first, in order, then the others (`rows`): a
permutation of the T query rows. FlexAttention attends the permuted queries with a mask that opens query row i only
when i is below the head's count of active tokens, at the key positions that row's original token sees (causal from
its own position, the sliding window, the attention mask). The inactive tail of every head is masked whole, so its
blocks are skipped; the active rows keep increasing positions, so a query block sees the keys up to its last row's
position and causal block skipping holds. Key/value heads stay as they are (FlexAttention's GQA). No host sync: the
shapes do not depend on the gates. The output rows are put back in token order and multiplied by the gates.

Cost: every head runs through one FlexAttention call, shared heads (active everywhere) as dense causal attention.
Compiled on CUDA (`torch.compile(flex_attention)`, once per shape); on CPU torch runs FlexAttention eagerly, with the
whole score matrix materialised and no backward: a CPU model asks for the "cpu" backend instead.

Shape legend as in head_sparse_attention_naive.py (the contract): B batch, H query heads, Hkv key/value heads, T
query tokens, L keys, hd head_dim.
"""

import functools

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from .head_sparse_attention_naive import apply_gates, check_inputs


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def _flex(query, key, value, block_mask, score_mod, scaling):
    """FlexAttention: compiled on CUDA (the fused kernel), eager elsewhere (a dense reference, forward only)."""
    if not torch.is_grad_enabled():  # (torch refuses inputs that require grad off CUDA even without a backward)
        query, key, value = query.detach(), key.detach(), value.detach()
    elif not query.is_cuda and (query.requires_grad or key.requires_grad or value.requires_grad):
        raise NotImplementedError(
            "the flex head-sparse backend has no backward off CUDA (torch's FlexAttention runs its backward on "
            "GPUs only): on CPU set the config's moh_head_skipping to True or 'cpu'"
        )
    attend = _compiled_flex() if query.is_cuda else flex_attention
    return attend(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scaling, enable_gqa=True)


def head_sparse_attention_flex(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    gates: torch.Tensor,
    scaling: float,
    attention_mask: torch.Tensor | None = None,
    query_offset: int | None = None,
    sliding_window: int | None = None,
    attend=None,
) -> torch.Tensor:
    """(B, T, H, hd): each active pair's attention output times its gate, 0 elsewhere (the contract:
    head_sparse_attention_naive.py). `attend(query, key, value, block_mask, score_mod, scaling)`: FlexAttention by
    default; tests pass a dense evaluation of the same masks to check this function's gradients on CPU."""
    check_inputs(query, key, value, gates, attention_mask, query_offset)
    batch, heads, tokens, head_dim = query.shape
    num_keys = key.shape[2]
    offset = num_keys - tokens if query_offset is None else query_offset
    active = (gates != 0).transpose(1, 2)  # (B, H, T)
    # rows[b, h, i]: the token of head h's i-th query row, its active tokens first (in order), then the others
    rows = torch.sort((~active).to(torch.uint8), dim=-1, stable=True).indices  # (B, H, T)
    counts = active.sum(dim=-1)  # (B, H)
    gather = rows[..., None].expand(-1, -1, -1, head_dim)  # (B, H, T, hd)
    packed = query.gather(2, gather)  # (B, H, T, hd): each head's active rows first

    mask = None if attention_mask is None else attention_mask[:, 0, :, :num_keys]  # (B or 1, T, L)
    mask_batch = (lambda b: b) if mask is not None and mask.shape[0] == batch else (lambda b: 0)

    def mask_mod(b, h, q_idx, kv_idx):
        token = rows[b, h, q_idx]
        position = token + offset
        visible = (q_idx < counts[b, h]) & (kv_idx <= position)
        if sliding_window is not None:
            visible = visible & (kv_idx > position - sliding_window)
        if mask is not None:
            allowed = mask[mask_batch(b), token, kv_idx]
            visible = visible & (allowed if mask.dtype == torch.bool else allowed > torch.finfo(mask.dtype).min)
        return visible

    score_mod = None
    if mask is not None and mask.dtype != torch.bool:  # an additive mask's own values count where visible

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + mask[mask_batch(b), rows[b, h, q_idx], kv_idx].to(score.dtype)

    block_mask = create_block_mask(
        mask_mod, batch, heads, tokens, num_keys, device=query.device, _compile=query.is_cuda
    )
    out = (attend or _flex)(packed, key, value, block_mask, score_mod, scaling)  # (B, H, T, hd), packed rows
    out = torch.zeros_like(out).scatter(2, gather, out)  # (B, H, T, hd) in token order; inactive rows 0
    return apply_gates(out.transpose(1, 2), gates, active.transpose(1, 2))  # (B, T, H, hd)
