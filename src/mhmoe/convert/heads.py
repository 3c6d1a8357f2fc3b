"""Head permutation: put the chosen shared heads first in every layer without leaving Llama's weight layout.

MoH shares the first S heads of a layer. To share other heads, the converter permutes the heads of each layer: the
query projection's rows, the key/value projections' rows (by key/value head) and the output projection's columns, all
by the same permutation, so the permuted model computes exactly the function of the source (attention heads are summed
by o_proj in any order; RoPE is the same for every head). With grouped-query attention a query head must keep its
key/value head: the permutation moves whole groups and reorders heads only inside their group (`head_order`).

`head_order(importance, shared, kv_heads)` chooses the order; `permute_state_dict` / `permute_checkpoint` apply it.
"""

from __future__ import annotations

import os
import re

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.([qkvo])_proj\.(weight|bias)$")


def head_order(importance: list[float], shared: int, kv_heads: int) -> list[int]:
    """A permutation `order` of the H heads (new position p holds source head order[p]) whose first `shared` positions
    hold the most important heads that grouped-query attention allows, with every query head still in its key/value
    group: whole groups move, heads move only within their group.

    With g = H / kv_heads heads per group and shared = a·g + b: a whole groups and the b best heads of one more group.
    Among all such choices the one with the largest total importance wins (exact: every partial group is tried)."""
    heads = len(importance)
    if heads % kv_heads:
        raise ValueError(f"{heads} heads do not split into {kv_heads} key/value groups")
    g = heads // kv_heads
    groups = [sorted(range(j * g, (j + 1) * g), key=lambda h: (-importance[h], h)) for j in range(kv_heads)]
    total = [sum(importance[h] for h in group) for group in groups]
    full, partial = divmod(shared, g)
    best = None
    for p in range(kv_heads) if partial else [None]:
        others = sorted((j for j in range(kv_heads) if j != p), key=lambda j: (-total[j], j))[:full]
        score = sum(total[j] for j in others) + (sum(importance[h] for h in groups[p][:partial]) if partial else 0)
        if best is None or score > best[0] + 1e-12:
            best = (score, sorted(others), p)
    _, chosen, p = best
    order = [h for j in chosen for h in range(j * g, (j + 1) * g)]
    if p is not None:
        order += groups[p]  # its best `partial` heads first (shared), then the group's others (routed)
    order += [h for j in range(kv_heads) if j not in chosen and j != p for h in range(j * g, (j + 1) * g)]
    return order


def kv_order(order: list[int], kv_heads: int) -> list[int]:
    """The key/value heads' permutation that goes with a query-head `order` from `head_order`."""
    g = len(order) // kv_heads
    result = [order[j * g] // g for j in range(kv_heads)]
    for p, h in enumerate(order):
        if h // g != result[p // g]:
            raise ValueError(f"head order {order} splits a key/value group of {g} query heads")
    return result


def permute_tensor(name: str, tensor, orders: list[list[int]], kv_heads: int, head_dim: int):
    """`tensor` (named as in a Llama state dict) with its heads permuted by `orders[layer]`; others unchanged."""
    import torch

    match = _LAYER.search(name)
    if match is None:
        return tensor
    layer, proj, kind = int(match[1]), match[2], match[3]
    order = orders[layer]
    if proj in "kv":
        order = kv_order(order, kv_heads)
    index = torch.tensor(order)
    if proj == "o":
        if kind == "bias":  # o_proj's bias is added once, after the heads are summed
            return tensor
        out = tensor.shape[0]
        return tensor.view(out, len(order), head_dim).index_select(1, index).reshape(out, -1).contiguous()
    rest = tensor.shape[1:]
    return tensor.view(len(order), head_dim, *rest).index_select(0, index).reshape(tensor.shape).contiguous()


def permute_state_dict(state_dict: dict, orders: list[list[int]], kv_heads: int, head_dim: int) -> dict:
    return {k: permute_tensor(k, v, orders, kv_heads, head_dim) for k, v in state_dict.items()}


def permute_checkpoint(
    directory: str,
    shard_names: list[str],
    orders: list[list[int]] | None,
    kv_heads: int,
    head_dim: int,
    replace: dict | None = None,
) -> None:
    """Permute the attention weights of a written checkpoint in place, one shard at a time (same names, dtypes,
    shapes, metadata); the folder is the converter's temporary one. `replace`: tensors (name -> tensor of the
    written one's dtype and shape) written instead, after the permutation; `orders` None: no permutation, only the
    shards holding them are rewritten."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    replace = replace or {}
    for name in shard_names:
        path = os.path.join(directory, name)
        with safe_open(path, framework="pt") as f:
            if orders is None and not replace.keys() & set(f.keys()):
                continue
            metadata = f.metadata()

            def rewritten(k):
                tensor = f.get_tensor(k)
                if k in replace:
                    if replace[k].shape != tensor.shape or replace[k].dtype != tensor.dtype:
                        raise ValueError(f"{k}: the replacement is not {tensor.dtype} {list(tensor.shape)}")
                    return replace[k].contiguous()
                return tensor if orders is None else permute_tensor(k, tensor, orders, kv_heads, head_dim)

            tensors = {k: rewritten(k) for k in f.keys()}
        save_file(tensors, path + ".permuted", metadata=metadata)
        del tensors
        os.replace(path + ".permuted", path)


def permute_rows(rows: list[list[float]], orders: list[list[int]]) -> list[list[float]]:
    """Per-layer, per-head statistics in the permuted head order."""
    return [[row[h] for h in order] for row, order in zip(rows, orders)]


__all__ = ["head_order", "kv_order", "permute_checkpoint", "permute_rows", "permute_state_dict", "permute_tensor"]
