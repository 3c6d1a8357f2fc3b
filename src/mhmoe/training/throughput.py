"""Training throughput: the model's FLOPs per token from its config, and MFU against the device's peak.

Counted as multiply-adds (MACs) of one token's forward at sequence length S, then ×2 (a MAC is two FLOPs) ×3
(backward ≈ 2× forward), per layer:
- attention projections: q (d × H·hd), k and v (d × KV·hd each), o (H·hd × d);
- attention core: QK^T and PV over the (S + 1)/2 keys a token sees on average in a causal block of S,
  2·H·hd·(S + 1)/2;
- MoH (`moh_active_heads` set): the core and o_proj count the active heads only (shared + that layer's routed budget;
  the inactive heads' outputs are zero, their work is not useful work); the head router (at most d × H, a few
  percent of q_proj) is left out;
- feed-forward: a dense SwiGLU 3·d·I, or an MoE layer's activated cost (`models/mhmoe/parity.py`: head and merge
  layers, router, k experts per sub-token, shared expert);
plus the LM head d × V. Norms, rotary embeddings, softmax and the embedding lookup are left out, as in PaLM's and
torchtitan's counts. A packed row of several examples attends less than a full block: the count is the block's.

MFU = tokens/s × FLOPs per token / (peak FLOP/s × processes), with the peak from `--peak_tflops` or `PEAK_TFLOPS`
(dense tensor-core figures from the vendors' data sheets); on CPU there is none, so no MFU unless given.
"""

from __future__ import annotations

# device-name fragment (lower case, most specific first) -> (bf16/fp16 dense, fp32 dense) peak TFLOP/s per device
PEAK_TFLOPS = (
    ("gh200", 989.0, 67.0),
    ("h200", 989.0, 67.0),
    ("h100 pcie", 756.0, 51.0),
    ("h100 nvl", 835.0, 60.0),
    ("h100", 989.0, 67.0),
    ("b200", 2250.0, 80.0),
    ("a100", 312.0, 19.5),
    ("l40s", 362.0, 91.6),
    ("a10g", 70.0, 31.2),
    ("a10", 125.0, 31.2),
    ("l4", 121.0, 30.3),
    ("v100", 125.0, 15.7),
    ("t4", 65.0, 8.1),
    ("mi300x", 1307.0, 163.4),
    ("mi250x", 383.0, 47.9),
)


def _moh_active_heads(config, layer: int) -> int | None:
    """Heads a token computes in `layer` under MoH (None: plain attention)."""
    if getattr(config, "moh_active_heads", None) is None:
        return None
    per_layer = getattr(config, "moh_active_heads_per_layer", None)
    routed = per_layer[layer] if per_layer else config.moh_active_heads
    return config.moh_shared_heads + routed


def attention_macs(config, layer: int, seq_len: int) -> float:
    """MACs of one token in attention layer `layer`: projections and the core over a causal block of `seq_len`."""
    d, heads = config.hidden_size, config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    active = _moh_active_heads(config, layer)
    computed = heads if active is None else active
    projections = d * heads * head_dim + 2 * d * kv * head_dim + computed * head_dim * d
    core = 2 * computed * head_dim * (seq_len + 1) / 2
    return projections + core


def feed_forward_macs(config, layer: int) -> float:
    """MACs of one token in feed-forward layer `layer`: an MoE layer's activated cost, or a dense SwiGLU."""
    is_moe = getattr(config, "is_moe_layer", None)
    if is_moe is not None and is_moe(layer):
        from ..models.mhmoe.parity import moe_layer_cost

        return moe_layer_cost(config).macs_per_token
    return 3 * config.hidden_size * config.intermediate_size


def flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs (forward + backward) of one token at sequence length `seq_len` (module docstring)."""
    macs = config.hidden_size * config.vocab_size  # the LM head
    for layer in range(config.num_hidden_layers):
        macs += attention_macs(config, layer, seq_len) + feed_forward_macs(config, layer)
    return 6.0 * macs


def peak_flops(device, mixed_precision: str, peak_tflops: float | None = None) -> float | None:
    """The device's peak FLOP/s for the run's precision: `peak_tflops` when given, else the table's entry for the
    CUDA device's name; None when unknown (CPU, an unlisted GPU)."""
    if peak_tflops is not None:
        return peak_tflops * 1e12
    if getattr(device, "type", str(device)) != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device).lower()
    for fragment, half, single in PEAK_TFLOPS:
        if fragment in name:
            return (half if mixed_precision in ("bf16", "fp16") else single) * 1e12
    return None


class Throughput:
    """Real tokens per second over each logging interval, and the MFU they give."""

    def __init__(self, flops_per_token: float, peak: float | None, processes: int):
        self.flops_per_token, self.peak, self.processes = flops_per_token, peak, processes

    def fields(self, tokens: int, seconds: float) -> dict:
        """{"tokens_per_second", "mfu"} for `tokens` (all processes) trained in `seconds`; no MFU without a peak."""
        rate = tokens / seconds if seconds > 0 else 0.0
        out = {"tokens_per_second": round(rate, 2)}
        if self.peak:
            out["mfu"] = round(rate * self.flops_per_token / (self.peak * self.processes), 6)
        return out


__all__ = ["PEAK_TFLOPS", "Throughput", "attention_macs", "feed_forward_macs", "flops_per_token", "peak_flops"]
