"""Decode-step attention time of MoH with head skipping vs full multi-head attention, side by side, on CPU.

One decode step of one attention layer for one sequence (batch 1, one query token) over a KV cache of L tokens:

- `mha`      : full multi-head attention, Transformers' Llama path: sdpa over all heads, then o_proj.
- `masked`   : what the released MoH code does: every head computed, per-head gates (0 on inactive heads), o_proj.
- `skip`     : mhmoe's head skipping (`skipped_heads_attention`): attention and the o_proj contribution only for the
               active heads, on views of the cache and of o_proj's weight.

`core` times cover attention + o_proj (what head skipping can save). `layer` times add what every decode step also
pays and MoH cannot skip: the q/k/v projections and RoPE of the new token, and (MoH) the l2 router (the K/V write into
the cache is left out: its cost depends on the cache class and is the same for all variants). Active heads per step:
`shared` always + `active` routed ones drawn at random per round (a different draw each round, the same draw for
`masked` and `skip`). Variants run interleaved, round after round; medians are reported.

Each timed call runs one decode step through a stack of `--layers` such layers (default 4), each with its own weights
and KV cache, as a model does: every layer's data comes from memory (the other layers have evicted it from the 32 MB
L3), while the code paths stay warm. Times are per layer. With `--layers 1` the same layer runs again and again, and
how much of a 64 MB o_proj weight or a KV cache survives in the L3 between calls differs between the variants.

    python benchmarks/moh_attention.py                # LLaMA-7B-like layer: d=4096, 32 heads of 128, MHA
    python benchmarks/moh_attention.py --kv-heads 8   # GQA (LLaMA3-8B-like)
    python benchmarks/moh_attention.py --layers 1     # one layer, timed again and again (warm caches)

`--model` times whole decoding steps of real models instead: a MoH-LLaMA (the l2 router, straight-through gates, the
first half of the heads shared, 75% active: `models/moh/fused_decoding.py`, the step MoH models take on the CPU)
against its dense parent (Transformers' LlamaForCausalLM, the same weights), both with a static cache of --contexts
keys (filled with random keys and values), an attention-bound shape (small MLP and vocabulary), interleaved rounds.
It also times the MoH step reading its key/value heads as one span (the step before it read them by runs):

    python benchmarks/moh_attention.py --model --hidden 1024 --heads 16 --contexts 8192 --threads 1
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from mhmoe.models.moh.head_routers import l2_scores, routed_gates
from mhmoe.models.moh.head_skipping import _head_major_weight
from mhmoe.models.ops.head_sparse_attention.head_sparse_attention_naive import runs as _runs

# ---------------------------------------------------------------------------------------------- the earlier loop
# `skipped_heads_attention`: mhmoe's first CPU decoding path for MoH (per query row, runs of active heads, each with
# its block of o_proj), kept here as the `skip` variant this benchmark compares against; tests/benchmarks checks it
# against the masked reference.


def _pieces(start: int, end: int, groups: int) -> list[tuple[int, int, int, int]]:
    """Split a run of query heads [start, end) into pieces (q0, q1, kv0, kv1) that attend to one contiguous block of
    key/value heads: whole GQA groups together, a partial group on its own."""
    if groups == 1:
        return [(start, end, start, end)]
    pieces, head = [], start
    while head < end:
        group = head // groups
        if head % groups == 0 and head + groups <= end:
            whole = (end - head) // groups
            pieces.append((head, head + whole * groups, group, group + whole))
            head += whole * groups
        else:
            stop = min(end, (group + 1) * groups)
            pieces.append((head, stop, group, group + 1))
            head = stop
    return pieces


def _mask_row(attention_mask: torch.Tensor | None, b: int, t: int, length: int) -> torch.Tensor | None:
    """Row (b, t) of a 4-D eager (additive float) or sdpa (boolean) mask, shaped (1, 1, 1, length) for sdpa."""
    if attention_mask is None:
        return None
    return attention_mask[b if attention_mask.shape[0] > 1 else 0, 0, t, :length].view(1, 1, 1, length)


def skipped_heads_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    gates: torch.Tensor,
    o_proj: nn.Linear,
    scaling: float,
) -> torch.Tensor:
    """Attention + o_proj for the active heads only.

    query (B, H, T, hd) post-RoPE, key/value (B, Hkv, L, hd), gates (B, T, H) with 0 on inactive heads. Returns
    (B, T, d) = o_proj(concat_h gates_h · attention_h). Per query row, the active heads are split into runs of
    consecutive heads; each run attends on a view of the cache (one `scaled_dot_product_attention` per run and GQA
    block: a block's query heads act as query positions of its key/value head) and adds its o_proj contribution from
    a block of the head-major o_proj weight (`_head_major_weight`), so the work and the memory reads scale with the
    active heads. The cache is never copied.
    """
    batch, heads, seq, head_dim = query.shape
    groups = heads // key.shape[1]
    length = key.shape[2]
    weight_t = _head_major_weight(o_proj)  # (H·hd, d)
    gates = gates.to(query.dtype)
    gate_values = gates.tolist()  # one host read; the per-row head lists below are plain Python
    rows = []
    for b in range(batch):
        key_b, value_b = key[b : b + 1], value[b : b + 1]  # (1, Hkv, L, hd)
        for t in range(seq):
            mask = _mask_row(attention_mask, b, t, length)
            query_row = query[b, :, t]  # (H, hd)
            row_gates = gate_values[b][t]
            active = [head for head, gate in enumerate(row_gates) if gate != 0.0]
            weighted = any(row_gates[head] != 1.0 for head in active)  # straight-through gates are 1: no multiply
            acc = o_proj.bias
            for start, end in _runs(active):
                parts = []
                for q0, q1, kv0, kv1 in _pieces(start, end, groups):
                    q = query_row[q0:q1].view(1, kv1 - kv0, -1, head_dim)  # (1, m, n/m, hd)
                    attended = F.scaled_dot_product_attention(
                        q, key_b[:, kv0:kv1], value_b[:, kv0:kv1], attn_mask=mask, scale=scaling
                    )  # on views of the cache: (1, m, L, hd)
                    parts.append(attended.view(-1, head_dim))
                heads_out = parts[0] if len(parts) == 1 else torch.cat(parts)  # (end - start, hd)
                if weighted:
                    heads_out = heads_out * gates[b, t, start:end, None]
                heads_out = heads_out.view(1, -1)
                block = weight_t[start * head_dim : end * head_dim]  # contiguous view: ((end - start)·hd, d)
                acc = torch.mm(heads_out, block) if acc is None else torch.addmm(acc, heads_out, block)
            rows.append(acc.view(-1))
    return (rows[0] if len(rows) == 1 else torch.stack(rows)).view(batch, seq, -1)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads (multi-head attention)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the dev machine has 2 shared cores)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--layers", type=int, default=4, help="layers per timed decode step, each with its own data")
    parser.add_argument("--model", action="store_true", help="whole decoding steps of MoH-LLaMA vs its dense parent")
    return parser.parse_args()


def model_steps(args) -> None:
    """`--model`: decoding steps of a MoH-LLaMA against its dense parent (see the module docstring)."""
    import dataclasses

    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    from mhmoe import MoHLlamaConfig, MoHLlamaForCausalLM
    from mhmoe.models.moh import fused_decoding

    heads, kv_heads = args.heads, args.kv_heads or args.heads
    fields = dict(
        vocab_size=512, hidden_size=args.hidden, intermediate_size=256, num_hidden_layers=args.layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, torch_dtype=args.dtype,
    )  # fmt: skip
    dense = LlamaForCausalLM(LlamaConfig(**fields)).eval()
    moh_fields = dict(moh_shared_heads=heads // 2, moh_active_heads=heads // 4, moh_router="l2")
    moh = MoHLlamaForCausalLM(MoHLlamaConfig(**fields, **moh_fields)).eval()
    moh.load_state_dict(dense.state_dict())  # the l2 router adds no parameters
    policy = fused_decoding.DEFAULT_CPU_POLICY
    one_span = dataclasses.replace(policy, decode_split_min_skipped_keys=1 << 62)
    for length in args.contexts:
        caches = {}
        for name, model in (("dense", dense), ("moh", moh)):
            cache = StaticCache(config=model.config, max_cache_len=length)
            with torch.no_grad():  # lay out the cache, then random keys and values in every position
                model(torch.tensor([[1]]), past_key_values=cache, use_cache=True)
            for layer in cache.layers:
                layer.keys.normal_()
                layer.values.normal_()
            caches[name] = cache
        position = torch.tensor([length - 2])
        ids = torch.randint(1, 512, (1, 1), generator=torch.Generator().manual_seed(0))

        def step(model, cache):
            with torch.no_grad():
                model(ids, past_key_values=cache, cache_position=position, use_cache=True)

        variants = {
            "dense": lambda: step(dense, caches["dense"]),
            "moh (runs)": lambda: step(moh, caches["moh"]),
            "moh (one span)": lambda: step(moh, caches["moh"]),
        }
        times = {name: [] for name in variants}
        for round_ in range(args.rounds + 2):
            for name in list(variants)[round_ % 3 :] + list(variants)[: round_ % 3]:
                fused_decoding.DEFAULT_CPU_POLICY = one_span if name == "moh (one span)" else policy
                start = time.perf_counter()
                variants[name]()
                if round_ >= 2:  # two warm-up rounds
                    times[name].append(time.perf_counter() - start)
        fused_decoding.DEFAULT_CPU_POLICY = policy
        base = statistics.median(times["dense"])
        print(f"context {length}, {args.layers} layers, d={args.hidden}, {heads} heads / {kv_heads} kv, "
              f"{heads // 2} shared + {heads // 4} of {heads - heads // 2} routed (75%), {args.threads} thread(s):")  # fmt: skip
        for name, values in times.items():
            median = statistics.median(values)
            print(f"  {name:15s} {median * 1e3:8.3f} ms  x{median / base:.3f} dense")


def settings(heads: int) -> dict[str, tuple[int, int]]:
    """name -> (shared, active routed): 75% = the paper's MoH-LLaMA3-8B split (16 shared + 8 of 16), 50% = 8 + 8."""
    return {"75%": (heads // 2, heads // 4), "50%": (heads // 4, heads // 4)}


def draw_gates(heads: int, shared: int, active: int, dtype=torch.float32) -> torch.Tensor:
    """(1, 1, H) 0/1 gates: the `shared` first heads and `active` of the others, drawn at random."""
    gates = torch.zeros(1, 1, heads, dtype=dtype)
    gates[..., :shared] = 1
    gates[..., torch.randperm(heads - shared)[:active] + shared] = 1
    return gates


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.model:
        return model_steps(args)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    d, heads = args.hidden, args.heads
    kv_heads = args.kv_heads or heads
    head_dim = d // heads
    groups = heads // kv_heads
    scaling = head_dim**-0.5
    layers = [
        {
            "q_proj": torch.nn.Linear(d, heads * head_dim, bias=False, dtype=dtype),
            "k_proj": torch.nn.Linear(d, kv_heads * head_dim, bias=False, dtype=dtype),
            "v_proj": torch.nn.Linear(d, kv_heads * head_dim, bias=False, dtype=dtype),
            "o_proj": torch.nn.Linear(heads * head_dim, d, bias=False, dtype=dtype),
        }
        for _ in range(args.layers)
    ]
    hidden = torch.randn(1, 1, d, dtype=dtype)
    cos, sin = torch.randn(1, 1, head_dim, dtype=dtype), torch.randn(1, 1, head_dim, dtype=dtype)

    def project(layer):
        """The new token's q/k/v projections and RoPE (every variant pays them)."""
        q_proj, k_proj, v_proj = layer["q_proj"], layer["k_proj"], layer["v_proj"]
        q = q_proj(hidden).view(1, 1, heads, head_dim)
        k = k_proj(hidden).view(1, 1, kv_heads, head_dim)
        v_proj(hidden)
        half = head_dim // 2
        rotate = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        q_rot = q * cos[:, :, None] + rotate * sin[:, :, None]
        rotate = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
        k * cos[:, :, None] + rotate * sin[:, :, None]
        return q, q_rot

    def route(q_pre, shared, active):
        """The l2 router of MoH-LLaMA (parameter-free) on the pre-RoPE queries."""
        return routed_gates(l2_scores(q_pre[..., shared:, :].float().norm(dim=-1)), active)

    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {args.dtype}; d={d}, heads={heads} of {head_dim}, "
        f"kv_heads={kv_heads}; batch 1, one query token; median of {args.rounds} interleaved rounds; each step "
        f"through {args.layers} layer(s) with their own weights and KV cache, times per layer"
    )
    header = (
        "| context | MHA core ms | masked 75% ms | skip 75% ms | skip 50% ms | core ratio 75% | core ratio 50% "
        "| layer ratio 75% | layer ratio 50% |"
    )  # times: medians
    print(header)
    print("| --- " * (header.count("|") - 1) + "|")
    for length in args.contexts:
        for layer in layers:
            layer["key"] = torch.randn(1, kv_heads, length, head_dim, dtype=dtype)
            layer["value"] = torch.randn(1, kv_heads, length, head_dim, dtype=dtype)
            layer["query"] = torch.randn(1, heads, 1, head_dim, dtype=dtype)

        def attend(layer):
            return F.scaled_dot_product_attention(
                layer["query"], layer["key"], layer["value"], scale=scaling, enable_gqa=groups > 1
            )

        def mha(layer, gates=None):
            return layer["o_proj"](attend(layer).transpose(1, 2).reshape(1, 1, -1))

        def masked(layer, gates):
            return layer["o_proj"]((attend(layer).transpose(1, 2) * gates[..., None]).reshape(1, 1, -1))

        def skip(layer, gates):
            return skipped_heads_attention(
                layer["query"], layer["key"], layer["value"], None, gates, layer["o_proj"], scaling
            )

        def route_layer(layer, route_args):
            return route(*route_args)

        times: dict[str, list[float]] = {}

        def timed(name, fn, per_layer_args):
            """One decode step through all layers; the time per layer."""
            start = time.perf_counter()
            results = [fn(layer, arg) for layer, arg in zip(layers, per_layer_args)]
            times.setdefault(name, []).append((time.perf_counter() - start) / len(layers))
            return results

        with torch.no_grad():
            for round_index in range(args.rounds + 2):  # two warm-up rounds
                none = [None] * len(layers)
                q_pre = [q for q, _ in timed("project", lambda layer, _: project(layer), none)]
                timed("mha", mha, none)
                for name, (shared, active) in settings(heads).items():
                    timed(f"route {name}", route_layer, [(q, shared, active) for q in q_pre])
                    gates = [draw_gates(heads, shared, active, dtype) for _ in layers]
                    expected = timed(f"masked {name}", masked, gates)
                    got = timed(f"skip {name}", skip, gates)
                    if round_index == 0:
                        for want, have in zip(expected, got):
                            torch.testing.assert_close(have, want, rtol=1e-3, atol=1e-3)  # skipping = masking
                if round_index < 2:
                    times.clear()
        median = {name: statistics.median(values) * 1e3 for name, values in times.items()}
        best = {name: min(values) * 1e3 for name, values in times.items()}

        def ratios(stat, name):
            core = stat[f"skip {name}"] / stat["mha"]
            layer = (stat["project"] + stat[f"route {name}"] + stat[f"skip {name}"]) / (stat["project"] + stat["mha"])
            return core, layer

        cells = []
        for name in settings(heads):
            (core_med, layer_med), (core_min, layer_min) = ratios(median, name), ratios(best, name)
            cells.append((f"{core_med:.2f} / {core_min:.2f}", f"{layer_med:.2f} / {layer_min:.2f}"))
        print(
            f"| {length} | {median['mha']:.2f} | {median['masked 75%']:.2f} | {median['skip 75%']:.2f} | "
            f"{median['skip 50%']:.2f} | {cells[0][0]} | {cells[1][0]} | {cells[0][1]} | {cells[1][1]} |"
        )
    print(
        "ratios: MoH time / MHA time, from medians / from minima (lower is better; the minima are the less disturbed "
        "by other processes); target for the core at 75% active heads: <= 0.80"
    )


if __name__ == "__main__":
    main()
