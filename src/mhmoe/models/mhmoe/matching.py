"""MHMoE configs built to match another model, beside the arithmetic that sizes them (`parity.py`):

- `from_llama_config`: the dense MHMoE config with exactly `LlamaForCausalLM`'s parameters;
- `from_mixtral_config`: the SMoE config with exactly `MixtralForCausalLM`'s parameters, logits and aux loss;
- `matched_to_smoe`: the MH-MoE config whose MoE layers match an SMoE's activated FLOPs and total parameters;
- `conventions_fields`: the official MH-MoE code's conventions where this library's defaults differ ("official").
"""

from .bitnet import BitNetB158
from .configuration_mhmoe import MHMoEConfig
from .linear_types import linear_class
from .parity import matched_moe_settings

CONVENTIONS = ("library", "official")
# The official MH-MoE code (torchscale xmoe + Tutel, yushuiwx/MH-MoE) where this library's defaults differ.
OFFICIAL_ROUTING = dict(
    norm_topk_prob=False,
    capacity_factor=1.0,
    capacity_rounding="official",
    router_aux_loss_mode="top1_sum",
    router_aux_loss_coef=0.01,
)
OFFICIAL_BITNET = BitNetB158.official_fields  # each linear_type's own: `official_fields` of its class


def conventions_fields(conventions: str, config) -> dict:
    """The fields that give `config` (an MHMoEConfig or its dict) the `conventions`: {} for "library" (the config as
    is), for "official" `OFFICIAL_ROUTING`, `moe_layer_bias=True` when it has a head or merge layer, and its
    linear_type's `official_fields` (`OFFICIAL_BITNET` for a BitNet model; see `matched_to_smoe`)."""
    if conventions not in CONVENTIONS:
        raise ValueError(f"conventions must be one of {CONVENTIONS}, got {conventions!r}")
    if conventions == "library":
        return {}
    get = config.get if isinstance(config, dict) else lambda name, default=None: getattr(config, name, default)
    fields = dict(OFFICIAL_ROUTING)
    heads = get("moe_heads", 1) or 1
    if any(get(name) or (get(name) is None and heads > 1) for name in ("moe_head_layer", "moe_merge_layer")):
        fields["moe_layer_bias"] = True
    fields.update(linear_class(config).official_fields)
    return fields


def from_llama_config(llama_config, **kwargs) -> MHMoEConfig:
    """The dense MHMoE config whose model has exactly `LlamaForCausalLM`'s parameters."""
    _expect_model_type(llama_config, "llama", "from_llama_config")
    fields = _shared_fields(llama_config)
    fields.update(mlp_bias=llama_config.mlp_bias, attention_bias=llama_config.attention_bias, decoder_sparse_step=0)
    fields.update(kwargs)
    return MHMoEConfig(**fields)


def from_mixtral_config(mixtral_config, **kwargs) -> MHMoEConfig:
    """The SMoE MHMoE config whose model has exactly `MixtralForCausalLM`'s parameters, logits and aux loss."""
    _expect_model_type(mixtral_config, "mixtral", "from_mixtral_config")
    fields = _shared_fields(mixtral_config)
    fields.update(
        sliding_window=mixtral_config.sliding_window,
        num_experts=mixtral_config.num_local_experts,
        num_experts_per_tok=mixtral_config.num_experts_per_tok,
        moe_intermediate_size=mixtral_config.intermediate_size,
        moe_heads=1,
        moe_head_layer=False,
        moe_merge_layer=False,
        decoder_sparse_step=1,
        norm_topk_prob="always" if mixtral_config.num_experts_per_tok == 1 else True,  # Mixtral renormalises at k=1
        router_aux_loss_coef=mixtral_config.router_aux_loss_coef,
        router_aux_loss_mode="mixtral",
        router_jitter_noise=mixtral_config.router_jitter_noise,
        output_router_logits=mixtral_config.output_router_logits,
    )
    fields.update(kwargs)
    return MHMoEConfig(**fields)


def matched_to_smoe(
    smoe_config: MHMoEConfig,
    moe_heads: int,
    num_experts_per_tok: int,
    round_experts_to: int = 8,
    conventions: str = "library",
    **kwargs,
) -> MHMoEConfig:
    """The MH-MoE config whose MoE layers match `smoe_config`'s activated FLOPs and total parameters.

    Head and merge layers are counted, on both sides (`moe_head_layer=False` / `moe_merge_layer=False` in `kwargs`
    solve for the ablations without them); see `parity.matched_moe_settings` for the equations. A Mixtral
    config: convert it with `from_mixtral_config` first.

    `conventions="library"` keeps `smoe_config`'s routing fields; `"official"` is the paper as its official code
    ran it (`conventions_fields`): raw top-k gates (`norm_topk_prob=False`), capacity `k * ceil(S / E)`
    (`capacity_factor=1.0`, `capacity_rounding="official"`), head/merge layers with bias (`moe_layer_bias=True`,
    2·d parameters per MoE layer that the parity solve does not count), the GShard top-1 loss summed over layers
    (`router_aux_loss_mode="top1_sum"`, 0.01) and, for BitNet models, `bitnet_quantized_layers="official"`,
    `bitnet_ffn_norm="before_down"` and `bitnet_attention_norm="before_o_proj"`. Give the SMoE baseline the same fields (`conventions_fields("official",
    smoe_config)`) to compare like with like. `kwargs` override both.
    """
    if not isinstance(smoe_config, MHMoEConfig):
        raise ValueError(
            f"matched_to_smoe takes an MHMoEConfig, got {type(smoe_config).__name__}; for a Mixtral config use "
            "matched_to_smoe(from_mixtral_config(config), ...)"
        )
    if smoe_config.decoder_sparse_step == 0:
        raise ValueError(
            "matched_to_smoe: the given config is dense (decoder_sparse_step=0); give the MoE config to match"
        )
    head_layer, merge_layer = kwargs.pop("moe_head_layer", True), kwargs.pop("moe_merge_layer", True)
    intermediate, experts = matched_moe_settings(
        hidden_size=smoe_config.hidden_size,
        smoe_intermediate_size=smoe_config.moe_intermediate_size,
        smoe_num_experts=smoe_config.num_experts,
        smoe_top_k=smoe_config.num_experts_per_tok,
        smoe_head_and_merge=bool(smoe_config.moe_head_layer) + bool(smoe_config.moe_merge_layer),
        smoe_moe_heads=smoe_config.moe_heads,
        moe_heads=moe_heads,
        top_k=num_experts_per_tok,
        round_experts_to=round_experts_to,
        head_and_merge=bool(head_layer) + bool(merge_layer),
    )
    fields = smoe_config.to_dict()
    for key in ("model_type", "transformers_version", "architectures", "auto_map"):
        fields.pop(key, None)
    if moe_heads != 1 and fields.get("router_aux_loss_mode") == "mixtral":  # token-level pooling needs h=1
        fields["router_aux_loss_mode"] = "per_layer"
    fields.update(
        moe_heads=moe_heads,
        num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_size=intermediate,
        num_experts=experts,
        moe_head_layer=head_layer,
        moe_merge_layer=merge_layer,
    )
    fields.update(conventions_fields(conventions, fields))
    fields.update(kwargs)
    return MHMoEConfig(**fields)


def _expect_model_type(config, model_type: str, method: str) -> None:
    if getattr(config, "model_type", None) != model_type:
        raise ValueError(
            f"{method} takes a Transformers {model_type} config (model_type {model_type!r}), got "
            f"{type(config).__name__} (model_type {getattr(config, 'model_type', None)!r})"
        )


def _shared_fields(config) -> dict:
    """The LLaMA-family fields that carry over unchanged."""
    names = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "max_position_embeddings",
        "initializer_range",
        "rms_norm_eps",
        "use_cache",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "tie_word_embeddings",
        "rope_parameters",
        "attention_dropout",
    )
    return {name: getattr(config, name) for name in names if getattr(config, name, None) is not None}


__all__ = [
    "CONVENTIONS",
    "OFFICIAL_BITNET",
    "OFFICIAL_ROUTING",
    "conventions_fields",
    "from_llama_config",
    "from_mixtral_config",
    "matched_to_smoe",
]
