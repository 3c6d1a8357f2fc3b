"""BitNet b1.58 (Ma et al. 2024, "The Era of 1-bit LLMs"): ternary weights, 8-bit activations, for 1-bit MH-MoE.

Every quantised projection computes y = W_q · Q_8(RMSNorm(x)):
- weights: one absmean scale per matrix, s = mean(|W|); W_q = s · clamp(round(W / s), -1, 1), values {-s, 0, +s};
- activations: per token absmax to 8 bits, Q_8(x) = clamp(round(x · 127 / max|x|), -128, 127) · max|x| / 127;
- the sub-layer norm: an RMSNorm with its own gain on the input of every quantised projection, before the activation
  quantisation (b1.58's training-tips BitLinear normalises every input; `bitnet_ffn_norm="every_projection"`). The
  official MH-MoE FFN instead has one sub-layer norm, before fc2 (down): `bitnet_ffn_norm="before_down"` drops the
  norm before the FFNs' gate/up projections (dense MLPs, shared and routed experts); likewise the official (torchscale)
  attention has one, `inner_attn_ln` before out_proj: `bitnet_attention_norm="before_o_proj"` drops the norms before
  q/k/v;
- which projections are quantised: `bitnet_quantized_layers` ("all", "official", "ffn_only", "experts"; `is_quantized`);
- straight-through estimator: the forward uses W_q and Q_8(x), the backward treats both roundings as identity, so the
  gradients reach the full-precision latent weights, which the optimiser updates.
For the 3-D expert weights (E, out, in) each expert matrix has its own scale and its own norm gain, and the fused
gate/up matrix (E, 2I, W) one scale per half, (E, 2): gate and up are quantised as the separate projections they are
(the official FFN's fc3/fc1, our dense MLP's gate_proj/up_proj). The experts run as two grouped GEMMs over the tokens
sorted by expert (`torch.nn.functional.grouped_mm`; where the kernel refuses the operands, a tiled batched matmul
without host sync on CUDA, one matmul per expert on CPU), like the unquantised grouped path.

Inference uses the same quantised weights (cached per weight version when no gradient is taken). `bitnet_packed=True`
models hold the weights as int8 ternary values plus one fp32 scale per matrix (`weight` / `weight_scale`,
`gate_up_proj` / `gate_up_proj_scale`, ...): what `mhmoe.hub.export_pretrained` writes (`packed_model`). They are for
inference; train the latent checkpoint.

Shape legend: N routed rows, K experts per row, S kept (row, expert) assignments, E experts, W row width,
I = moe_intermediate_size. This file runs on torch + transformers alone: exported checkpoints ship it.
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from ..ops.backends import sort_by_expert
from ..ops.experts.grouped_gemm import (
    GROUPED_MM_TILE,
    TORCH_GROUPED_MM,
    autocast_dtype,
    kernel_accepts,
    tiled_grouped_mm,
)
from .experts import sub_token_width

_SCALE_MIN = 1e-5  # clamp of the absmean / absmax scales (an all-zero matrix or token)


class BitNetRMSNorm(LlamaRMSNorm):
    """The sub-layer norm in front of a quantised projection (Transformers initialises *RMSNorm gains to 1)."""


def quantize_weight(weight: torch.Tensor, parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(ternary values in {-1, 0, 1} as `weight`'s dtype, fp32 scale): one absmean scale per matrix; a 3-D
    (E, out, in) weight gets one per expert, shape (E,). `parts` > 1 splits the output rows into that many equal
    matrices, each with its own scale: (E, parts) (the fused gate/up weight: parts=2)."""
    lead, (rows, cols) = weight.shape[:-2], weight.shape[-2:]
    split = weight.detach().float().reshape(*lead, parts, rows // parts, cols)
    scale = split.abs().mean(dim=(-2, -1)).clamp(min=_SCALE_MIN)  # (..., parts)
    ternary = (split / scale[..., None, None]).round().clamp(-1, 1).reshape(weight.shape)
    return ternary.to(weight.dtype), (scale if parts > 1 else scale[..., 0])


def dequantize(ternary: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ternary × scale (one per matrix, or per part when `scale` has a trailing parts dimension, see
    `quantize_weight`), computed in fp32 and cast once: latent and packed models agree exactly."""
    if scale.dim() == ternary.dim() - 2:  # one scale per matrix
        return (ternary.float() * scale.float()[..., None, None]).to(dtype)
    parts = scale.shape[-1]
    split = ternary.float().reshape(*ternary.shape[:-2], parts, ternary.shape[-2] // parts, ternary.shape[-1])
    return (split * scale.float()[..., None, None]).reshape(ternary.shape).to(dtype)


class _StraightThrough(torch.autograd.Function):
    """Forward: the quantised tensor exactly; backward: the gradient goes to the full-precision tensor unchanged."""

    @staticmethod
    def forward(ctx, full_precision, quantized):
        return quantized

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _ste(full_precision: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and full_precision.requires_grad:
        return _StraightThrough.apply(full_precision, quantized)
    return quantized


def _ste_weight(weight: torch.Tensor, parts: int = 1) -> torch.Tensor:
    """Forward: ternary × scale(s); backward: identity to the latent weight."""
    return _ste(weight, dequantize(*quantize_weight(weight, parts), weight.dtype))


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """Per-token (last dim) absmax 8-bit fake quantisation with the straight-through estimator."""
    scale = 127.0 / x.detach().abs().float().amax(dim=-1, keepdim=True).clamp(min=_SCALE_MIN)
    return _ste(x, ((x.detach().float() * scale).round().clamp(-128, 127) / scale).to(x.dtype))


class _CachedQuantization:
    """The quantised weight for no-grad forwards, recomputed only when the latent weight changes."""

    def _quantized_for_forward(self, name: str, weight: torch.Tensor, parts: int = 1) -> torch.Tensor:
        # only a stored parameter is cached: under PEFT's parametrisation `weight` is recomputed on every access
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or not isinstance(weight, nn.Parameter):
            return _ste_weight(weight, parts)
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        cache = self.__dict__.setdefault("_bitnet_cache", {})
        if name not in cache or cache[name][0] != key:
            cache[name] = (key, _ste_weight(weight, parts))
        return cache[name][1]


class BitLinear(nn.Linear, _CachedQuantization):
    """`nn.Linear` with BitNet b1.58 quantisation (latent full-precision `weight`; PEFT's LoRA wraps it as a Linear)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, eps: float = 1e-6, input_norm: bool = True
    ):
        super().__init__(in_features, out_features, bias=bias)
        self.input_norm = BitNetRMSNorm(in_features, eps=eps) if input_norm else None  # None: 8-bit input as is

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = quantize_activations(self.input_norm(x) if self.input_norm is not None else x)
        return F.linear(x, self._quantized_for_forward("weight", self.weight), self.bias)

    def quantized_weight(self) -> torch.Tensor:
        """The weight the forward uses: ternary × its one scale."""
        return dequantize(*quantize_weight(self.weight), self.weight.dtype)


class PackedBitLinear(nn.Module):
    """Inference-only BitLinear holding int8 ternary `weight` and its fp32 `weight_scale` (an exported checkpoint)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, eps: float = 1e-6, input_norm: bool = True
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones((), dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.input_norm = BitNetRMSNorm(in_features, eps=eps) if input_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = quantize_activations(self.input_norm(x) if self.input_norm is not None else x)
        return F.linear(x, dequantize(self.weight, self.weight_scale, x.dtype), self.bias)

    def quantized_weight(self) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, torch.float32)


# Which projections each `bitnet_quantized_layers` setting quantises, by role: "attention" (q/k/v/o), "ffn" (dense
# MLPs and the shared expert), "experts" (the routed experts), "head_merge" (MH-MoE's head and merge layers). Routers
# are never quantised. "official": the official MH-MoE code (head/merge are plain nn.Linear there); "ffn_only": its
# `--quant-ffn-only` (attention in full precision).
QUANTIZED_ROLES = {
    "all": {"attention", "ffn", "experts", "head_merge"},
    "official": {"attention", "ffn", "experts"},
    "ffn_only": {"ffn", "experts"},
    "experts": {"experts"},
}
ROLES = ("attention", "ffn", "experts", "head_merge")
BITNET_QUANTIZED_LAYERS = tuple(QUANTIZED_ROLES)
BITNET_FFN_NORMS = ("every_projection", "before_down")
BITNET_ATTENTION_NORMS = ("every_projection", "before_o_proj")


def is_quantized(config, role: str = "attention") -> bool:
    """Whether a projection of this `role` (see QUANTIZED_ROLES) is quantised."""
    if getattr(config, "linear_type", "linear") != "bitnet_b158":
        return False
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return role in QUANTIZED_ROLES[config.bitnet_quantized_layers]


def ffn_input_norm(config) -> bool:
    """Whether an FFN's gate/up projections get a sub-layer norm (`bitnet_ffn_norm`)."""
    return getattr(config, "bitnet_ffn_norm", "every_projection") == "every_projection"


def attention_input_norm(config) -> bool:
    """Whether the attention's q/k/v projections get a sub-layer norm (`bitnet_attention_norm`)."""
    return getattr(config, "bitnet_attention_norm", "every_projection") == "every_projection"


def _grouped_linear(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """rows (S, in) sorted by expert, weight (E, out, in), offsets (E,) int32 group ends -> (S, out); differentiable.

    Under autocast both operands are cast once to the autocast dtype (else to their common dtype), then torch's grouped
    GEMM runs where it takes them; otherwise on CUDA the tiled batched matmul (`grouped_gemm.tiled_grouped_mm`, no host sync),
    on CPU one matmul per non-empty expert."""
    compute = autocast_dtype(rows.device) or torch.promote_types(rows.dtype, weight.dtype)
    rows, rhs = rows.to(compute), weight.transpose(1, 2).to(compute)  # rhs (E, in, out), a view when no cast
    with torch.autocast(rows.device.type, enabled=False):
        # the output and the gradients the backward makes need 16-byte rows too
        rows_aligned = all(n * rows.element_size() % 16 == 0 for n in weight.shape[1:])
        if kernel_accepts(rows, rhs) and rows_aligned and rows.shape[0] > 0:
            return TORCH_GROUPED_MM(rows, rhs, offs=offsets)
        if rows.is_cuda:
            return tiled_grouped_mm(rows, rhs, offsets, GROUPED_MM_TILE)
        ends = offsets.tolist()  # CPU operands torch's kernel refuses: one matmul per non-empty expert
        starts = [0] + ends[:-1]
        pieces = [rows[a:b] @ rhs[e] for e, (a, b) in enumerate(zip(starts, ends)) if b > a]
        return torch.cat(pieces) if pieces else rows.new_zeros(0, weight.shape[1])


def _norm_quantize(rows: torch.Tensor, gain: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm of each row (in fp32, like LlamaRMSNorm) times its gain row, then 8-bit activations: an expert's
    sub-layer norm. `gain` (S, width) or (1, width); None: no norm, the 8-bit activations only."""
    if gain is None:
        return quantize_activations(rows)
    variance = rows.float().pow(2).mean(-1, keepdim=True)
    normed = (rows.float() * torch.rsqrt(variance + eps)).to(rows.dtype)
    return quantize_activations(gain.to(rows.dtype) * normed)


class BitNetExperts(nn.Module, _CachedQuantization):
    """`num_experts` SwiGLU experts as 3-D weights like `MHMoEExperts`, every expert matrix a BitLinear: its own scale
    (the fused gate/up: one for gate, one for up), its own sub-layer norm gain (`gate_up_norm` (E, W), absent with
    `bitnet_ffn_norm="before_down"`; `down_norm` (E, I)). Same call as the other experts implementations:
    (hidden_states (N, W), top_k_index (N, K), top_k_weights (N, K)) -> (N, W)."""

    _PARTS = {"gate_up_proj": 2, "down_proj": 1}  # scales per expert matrix: gate and up quantised separately

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = sub_token_width(config)
        self.intermediate_dim = config.moe_intermediate_size
        self.eps = config.rms_norm_eps
        self.packed = bool(config.bitnet_packed)
        shapes = {
            "gate_up_proj": (self.num_experts, 2 * self.intermediate_dim, self.hidden_dim),
            "down_proj": (self.num_experts, self.hidden_dim, self.intermediate_dim),
        }
        for name, shape in shapes.items():
            if self.packed:
                scale_shape = (self.num_experts, self._PARTS[name]) if self._PARTS[name] > 1 else (self.num_experts,)
                self.register_buffer(name, torch.zeros(shape, dtype=torch.int8))
                self.register_buffer(f"{name}_scale", torch.ones(scale_shape, dtype=torch.float32))
            else:
                setattr(self, name, nn.Parameter(torch.empty(shape)))
        norm = ffn_input_norm(config)
        self.gate_up_norm = nn.Parameter(torch.ones(self.num_experts, self.hidden_dim)) if norm else None
        self.down_norm = nn.Parameter(torch.ones(self.num_experts, self.intermediate_dim))
        self.act_fn = ACT2FN[config.hidden_act]

    @torch.no_grad()
    def init_parameters(self, std: float) -> None:
        if not self.packed:
            self.gate_up_proj.normal_(mean=0.0, std=std)
            self.down_proj.normal_(mean=0.0, std=std)
        if self.gate_up_norm is not None:
            self.gate_up_norm.fill_(1.0)
        self.down_norm.fill_(1.0)

    def quantized_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up (E, 2I, W), down (E, W, I)) as the forward uses them: ternary × one scale per expert matrix (per
        half of gate_up)."""
        if self.packed:
            return self._unpacked(torch.float32)
        return tuple(
            dequantize(*quantize_weight(w, self._PARTS[n]), w.dtype)
            for n, w in zip(("gate_up_proj", "down_proj"), self._latent())
        )

    def _unpacked(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed ternary weights times their scales, in `dtype`."""
        return tuple(
            dequantize(getattr(self, n), getattr(self, f"{n}_scale"), dtype) for n in ("gate_up_proj", "down_proj")
        )

    def _latent(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up_proj.detach(), self.down_proj.detach()

    def _weights_for_forward(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.packed:
            return self._unpacked(dtype)
        return self._quantized_for_forward("gate_up_proj", self.gate_up_proj, 2), self._quantized_for_forward(
            "down_proj", self.down_proj
        )

    def _gate_up_gain(self, experts: torch.Tensor) -> torch.Tensor | None:
        return None if self.gate_up_norm is None else self.gate_up_norm.index_select(0, experts)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        num_rows, top_k = top_k_index.shape
        order, offsets = sort_by_expert(top_k_index, self.num_experts)  # (S,), (E,) int32
        num_kept = int(offsets[-1])  # dropped assignments (capacity) sort last and are not computed
        order = order[:num_kept]
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
        expert_of_row = torch.repeat_interleave(torch.arange(self.num_experts, device=order.device), counts)  # (S,)
        source_rows = order // top_k  # (S,) the routed row of each sorted assignment
        gate_up_w, down_w = self._weights_for_forward(hidden_states.dtype)
        rows = hidden_states.index_select(0, source_rows)  # (S, W)
        rows = _norm_quantize(rows, self._gate_up_gain(expert_of_row), self.eps)
        gate, up = _grouped_linear(rows, gate_up_w, offsets).chunk(2, dim=-1)  # (S, I) each
        hidden = _norm_quantize(self.act_fn(gate) * up, self.down_norm.index_select(0, expert_of_row), self.eps)
        expert_out = _grouped_linear(hidden, down_w, offsets)  # (S, W)
        weights = top_k_weights.reshape(-1).index_select(0, order)[:, None].to(expert_out.dtype)
        out = hidden_states.new_zeros(num_rows, self.hidden_dim, dtype=expert_out.dtype)
        return out.index_add(0, source_rows, expert_out * weights).to(hidden_states.dtype)

    def eager_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """Reference: a loop over rows and their experts with each expert's quantised matrices (tests)."""
        gate_up_w, down_w = self.quantized_weights()
        out = torch.zeros_like(hidden_states, dtype=torch.float32)
        for row in range(hidden_states.shape[0]):
            for slot in range(top_k_index.shape[1]):
                e = int(top_k_index[row, slot])
                if e >= self.num_experts:
                    continue
                gain = None if self.gate_up_norm is None else self.gate_up_norm[e : e + 1]
                x = _norm_quantize(hidden_states[row : row + 1], gain, self.eps)
                gate, up = (x @ gate_up_w[e].t()).chunk(2, dim=-1)
                x = _norm_quantize(self.act_fn(gate) * up, self.down_norm[e : e + 1], self.eps)
                out[row] += top_k_weights[row, slot] * (x @ down_w[e].t())[0].float()
        return out.to(hidden_states.dtype)


def packed_model(model):
    """A copy of a latent BitNet model whose quantised projections hold int8 ternary weights + fp32 scales
    (`config.bitnet_packed=True`): same logits, about a quarter of the fp32 weight bytes. A model that is not a
    latent BitNet model is returned as is."""
    config = model.config
    if getattr(config, "linear_type", "linear") != "bitnet_b158" or config.bitnet_packed:
        return model
    state = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, BitLinear):
            ternary, scale = quantize_weight(module.weight.detach())
            state[f"{prefix}weight"], state[f"{prefix}weight_scale"] = ternary.to(torch.int8), scale
        elif isinstance(module, BitNetExperts):
            for param, latent in zip(("gate_up_proj", "down_proj"), module._latent()):
                ternary, scale = quantize_weight(latent, module._PARTS[param])
                state[f"{prefix}{param}"], state[f"{prefix}{param}_scale"] = ternary.to(torch.int8), scale
    packed_config = copy.deepcopy(config)
    packed_config.bitnet_packed = True
    packed = type(model)(packed_config).to(device=model.device, dtype=model.dtype)  # int8 buffers stay int8
    full = {**model.state_dict(), **state}
    packed.load_state_dict({k: v for k, v in full.items() if k in packed.state_dict()}, strict=True)
    return packed.eval()


class BitNetB158:
    """`linear_type="bitnet_b158"`: the decoder projections of the roles `bitnet_quantized_layers` names are
    BitLinear (PackedBitLinear with `bitnet_packed`), the others `nn.Linear`; the routed experts are `BitNetExperts`."""

    @staticmethod
    def linear(
        config, in_features: int, out_features: int, bias: bool = False, role: str = "attention", sublayer_in=False
    ) -> nn.Module:
        """A projection of `role`; `sublayer_in`: an input projection of its sub-layer (an FFN's gate/up, attention's
        q/k/v), without its sub-layer norm under `bitnet_ffn_norm="before_down"` / `bitnet_attention_norm=
        "before_o_proj"`."""
        if not is_quantized(config, role):
            return nn.Linear(in_features, out_features, bias=bias)
        cls = PackedBitLinear if config.bitnet_packed else BitLinear
        input_norm = not sublayer_in or (ffn_input_norm if role == "ffn" else attention_input_norm)(config)
        return cls(in_features, out_features, bias=bias, eps=config.rms_norm_eps, input_norm=input_norm)

    @staticmethod
    def experts(config) -> nn.Module:
        return BitNetExperts(config)

    @staticmethod
    def config_problems(config) -> list[str]:
        """The bitnet_* fields, in words (checked whatever the linear_type: a BitNet field set on another model is
        refused)."""
        problems, bitnet = [], config.linear_type == "bitnet_b158"
        if config.bitnet_quantized_layers not in BITNET_QUANTIZED_LAYERS:
            problems.append(
                f"bitnet_quantized_layers must be one of {BITNET_QUANTIZED_LAYERS} ('all': every decoder "
                f"projection; 'official': attention and FFNs, not head/merge layers or routers; 'ffn_only': "
                f"the FFNs; 'experts': the routed experts), got "
                f"{config.bitnet_quantized_layers!r}"
            )
        if config.bitnet_ffn_norm not in BITNET_FFN_NORMS:
            problems.append(f"bitnet_ffn_norm must be one of {BITNET_FFN_NORMS}, got {config.bitnet_ffn_norm!r}")
        attention_norm = getattr(config, "bitnet_attention_norm", "every_projection")
        if attention_norm not in BITNET_ATTENTION_NORMS:
            problems.append(
                f"bitnet_attention_norm must be one of {BITNET_ATTENTION_NORMS} ('before_o_proj': the official "
                f"attention's one sub-layer norm), got {attention_norm!r}"
            )
        elif bitnet and attention_norm != "every_projection" and not is_quantized(config, "attention"):
            problems.append(
                f"bitnet_attention_norm={attention_norm!r} applies to quantised attention, which "
                f"bitnet_quantized_layers={config.bitnet_quantized_layers!r} leaves in full precision; use "
                "'every_projection' or bitnet_quantized_layers 'all' / 'official'"
            )
        if bitnet and config.bitnet_quantized_layers == "experts" and config.decoder_sparse_step == 0:
            problems.append(
                "bitnet_quantized_layers='experts' quantises nothing in a dense model "
                "(decoder_sparse_step=0); use 'all'"
            )
        if config.bitnet_packed and not bitnet:
            problems.append("bitnet_packed=True needs linear_type='bitnet_b158' (it marks exported ternary weights)")
        return problems

    # What the rest of mhmoe asks the kind (`linear_types.linear_class(config)`), so that no caller names it.
    # The official BitNet MH-MoE code's conventions (`matching.conventions_fields("official", ...)`).
    official_fields = dict(
        bitnet_quantized_layers="official", bitnet_ffn_norm="before_down", bitnet_attention_norm="before_o_proj"
    )

    @staticmethod
    def card_rows(config) -> list[tuple[str, str]]:
        """The model card's "BitNet b1.58" row: what is ternary and how the weights are stored."""
        layers = {
            "all": "every decoder projection",
            "official": "attention and FFN projections (not head/merge layers)",
            "ffn_only": "the FFN projections",
            "experts": "the routed experts",
        }.get(config.bitnet_quantized_layers, config.bitnet_quantized_layers)
        stored = "int8 ternary weights + one scale per matrix" if config.bitnet_packed else "latent fp weights"
        return [("BitNet b1.58", f"{layers} ternary, 8-bit activations; stored as {stored}")]

    @staticmethod
    def export_transform(config):
        """`packed_model` for latent weights (an export writes int8 ternary weights + scales: the same logits, about
        a quarter of the bytes); None when they are packed already."""
        return None if config.bitnet_packed else packed_model

    @staticmethod
    def training_refusal(config):
        """Why LoRA cannot train a packed export (None for latent weights)."""
        if not config.bitnet_packed:
            return None
        return (
            "this BitNet model is a packed export (bitnet_packed=True: int8 ternary weights, inference only); train "
            "LoRA on the latent checkpoint (the one mhmoe-train saved) instead"
        )


__all__ = [
    "BITNET_ATTENTION_NORMS",
    "BITNET_FFN_NORMS",
    "BITNET_QUANTIZED_LAYERS",
    "QUANTIZED_ROLES",
    "BitLinear",
    "BitNetB158",
    "BitNetExperts",
    "BitNetRMSNorm",
    "PackedBitLinear",
    "is_quantized",
    "packed_model",
    "quantize_activations",
    "quantize_weight",
]
