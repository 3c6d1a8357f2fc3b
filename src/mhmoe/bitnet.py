"""BitNet b1.58 for 1-bit MH-MoE: `BitLinear`, the ternary expert weights and export packing (see the model file)."""

from .models.mhmoe.bitnet import (
    BITNET_QUANTIZED_LAYERS,
    LINEAR_TYPES,
    BitLinear,
    BitNetExperts,
    BitNetRMSNorm,
    PackedBitLinear,
    is_quantized,
    make_linear,
    packed_model,
    quantize_activations,
    quantize_weight,
)

__all__ = [
    "BITNET_QUANTIZED_LAYERS", "LINEAR_TYPES", "BitLinear", "BitNetExperts", "BitNetRMSNorm", "PackedBitLinear",
    "is_quantized", "make_linear", "packed_model", "quantize_activations", "quantize_weight",
]  # fmt: skip
