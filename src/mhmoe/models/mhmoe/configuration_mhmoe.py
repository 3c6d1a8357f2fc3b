"""MHMoE model configuration: one config for dense, SMoE, fine-grained SMoE and MH-MoE decoders, with or without MoH."""

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

from ..config_checks import (
    CheckedOverrides,
    check_keyword_arguments,
    decoder_problems,
    raise_problems,
    rope_problems,
    size_problems,
    token_id_problems,
)
from ..moh.moh_config import MoHConfigFields, moh_config_problems
from ..ops.backends import ROUTING_BACKENDS
from .linear_types import linear_type_problems
from .plans import MHMOE_EP_PLAN, MHMOE_TP_PLAN, ConfigPlan, mhmoe_has_module
from .router_types import router_type_problems


@strict
class MHMoEConfig(CheckedOverrides, PreTrainedConfig, MoHConfigFields):
    r"""LLaMA-style decoder whose feed-forward is, per layer, a dense SwiGLU MLP or an MH-MoE block.

    Layer `i` is MoE when `decoder_sparse_step > 0` and `(i + 1) % decoder_sparse_step == 0` (0: a dense LLaMA). The
    MoE block projects each token with a head layer, splits it into `moe_heads` sub-tokens of width
    `hidden_size // moe_heads`, routes every sub-token to its top `num_experts_per_tok` of `num_experts` experts and
    merges the sub-tokens back with a merge layer; `moe_heads=1` without head/merge layers is Mixtral's SMoE.

    The variants are chosen by name and check their own fields: `router_type` the MoE block (`router_types.py`:
    "topk", `sparse_moe.py`; "lory", `lory.py`), `linear_type` the projections and experts (`linear_types.py`:
    "linear"; "bitnet_b158", `bitnet.py`), `moh_router` the MoH head router (`models/moh/head_routers.py`; MoH is on
    when `moh_shared_heads` and `moh_active_heads` are set; the moh_* fields are `moh_config.MoHConfigFields`, shared
    with MoH-LLaMA). Configs sized to match Llama, Mixtral or an SMoE, and the
    official MH-MoE code's conventions: `matching.py`. Every field is described in docs/models.md.
    """

    model_type = "mhmoe"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # the cache, named "cache" from Transformers 5.24
    # a config instance gives only the rules for the modules its model has (plans.py); the class, every rule
    base_model_tp_plan = ConfigPlan(MHMOE_TP_PLAN, mhmoe_has_module)
    base_model_ep_plan = ConfigPlan(MHMOE_EP_PLAN, mhmoe_has_module)
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int = 2048  # the dense layers' MLP width
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int | None = None  # None: num_attention_heads
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    mlp_bias: bool = False
    sliding_window: int | None = None
    # mixture of experts (sparse_moe.py)
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 2048
    moe_heads: int = 1
    moe_head_layer: bool | None = None  # None: on when moe_heads > 1
    moe_merge_layer: bool | None = None  # None: on when moe_heads > 1
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    decoder_sparse_step: int = 1
    norm_topk_prob: bool | str = True  # True: renormalise when k > 1 | "always" (Mixtral) | False (the papers' eq. 3)
    router_aux_loss_coef: float = 0.01
    router_aux_loss_mode: str = "per_layer"  # | "mixtral" (pooled over layers) | "top1_sum" (official): moe_losses.py
    router_z_loss_coef: float = 0.0
    router_jitter_noise: float = 0.0
    capacity_factor: float | int | None = None  # None: dropless
    capacity_rounding: str = "switch"  # "switch": ceil(cf·S·k/E) | "official": k·ceil(cf·S/E) (official MH-MoE)
    moe_layer_bias: bool = False  # head/merge layers with a bias (the official code's nn.Linear(d, d, bias=True))
    output_router_logits: bool = False
    routing_backend: str | None = None  # "torch" | "triton" | None: by device (ops/backends.py)
    # the variants chosen by name: linear_types.py (BitNet b1.58: bitnet.py), router_types.py (Lory: lory.py)
    linear_type: str = "linear"
    bitnet_quantized_layers: str = "all"  # "all" | "official" | "ffn_only" | "experts"
    bitnet_ffn_norm: str = "every_projection"  # | "before_down" (the official FFN)
    bitnet_attention_norm: str = "every_projection"  # | "before_o_proj" (the official attention)
    bitnet_packed: bool = False  # weights stored as int8 ternary + one scale per matrix (export; inference only)
    router_type: str = "topk"
    lory_segment_length: int = 256
    lory_expert_pool: str = "shared"  # "shared": MH-Lory v1 (E experts) | "per_head": v2 (E per head, E·h in all)
    lory_first_segment: str = "uniform"  # | "proposal": routed on its own mean, without gradient (lory.py)

    def __post_init__(self, **kwargs):
        check_keyword_arguments(type(self), kwargs)
        if self.head_dim is None and self.num_attention_heads > 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.moe_head_layer is None:
            self.moe_head_layer = self.moe_heads > 1
        if self.moe_merge_layer is None:
            self.moe_merge_layer = self.moe_heads > 1
        super().__post_init__(**kwargs)
        self.validate_architecture()

    def validate_architecture(self):
        """Transformers' strict-dataclass hook, run at construction, by the model and by `save_pretrained`: the
        decoder's own fields, then each variant's (MoE block, projections, MoH); every problem in one ValueError."""
        super().validate_architecture()
        problems = size_problems(self)
        if not problems:  # the other checks divide by the sizes
            problems = decoder_problems(self) + rope_problems(self) + token_id_problems(self)
            problems += router_type_problems(self) + linear_type_problems(self)
            problems += moh_config_problems(self)
        if self.routing_backend is not None and self.routing_backend not in ROUTING_BACKENDS:
            problems.append(
                f"routing_backend must be one of {tuple(ROUTING_BACKENDS)} or None (by device), got "
                f"{self.routing_backend!r}"
            )
        raise_problems(self, problems)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.decoder_sparse_step > 0 and (layer_idx + 1) % self.decoder_sparse_step == 0


__all__ = ["MHMoEConfig"]
