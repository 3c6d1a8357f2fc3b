"""MHMoE model configuration: one config for dense, SMoE, fine-grained SMoE and MH-MoE decoders."""

import dataclasses
import math

from huggingface_hub.dataclasses import strict
from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

from .parity import matched_moe_settings
from .plans import ConfigPlan, mhmoe_has_module

AUX_LOSS_MODES = ("per_layer", "mixtral", "top1_sum")
NORM_TOPK_PROB = (True, False, "always")
MOH_ROUTERS = ("learned", "l2", "l2_standardized", "l2_relative")
# routers that read per-head query-norm statistics measured on calibration text (moh_head_norm_mean / _std)
CALIBRATED_MOH_ROUTERS = ("l2_standardized", "l2_relative")
MOH_STRAIGHT_THROUGH = (False, True, "scores")
CAPACITY_ROUNDINGS = ("switch", "official")
ROUTING_BACKENDS = ("torch", "triton")
# names other MoE configs use for our fields: refused instead of silently dropped (`top_k` also breaks save_pretrained)
MISNAMED_FIELDS = {
    "top_k": "num_experts_per_tok", "router_top_k": "num_experts_per_tok", "num_local_experts": "num_experts",
}  # fmt: skip


class OverridesBeforeChecks:
    """`from_pretrained(d, field=value)`: Transformers builds the config from the file and then sets the overrides
    unchecked. Here overrides of config fields join the file's fields first, so the checks see the final config."""

    _SET_BY_TRANSFORMERS = {"dtype", "torch_dtype", "attn_implementation", "experts_implementation", "name_or_path",
                            "output_attentions", "num_labels"}  # fmt: skip

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        fields = {field.name for field in dataclasses.fields(cls)} - cls._SET_BY_TRANSFORMERS
        config_dict = {**config_dict, **{name: kwargs.pop(name) for name in list(kwargs) if name in fields}}
        return super().from_dict(config_dict, **kwargs)


@strict
class MHMoEConfig(OverridesBeforeChecks, PreTrainedConfig):
    r"""LLaMA-style decoder whose feed-forward is, per layer, a dense SwiGLU MLP or an MH-MoE block.

    The MoE block projects each token with a head layer (`moe_head_layer`), splits it into `moe_heads` sub-tokens of
    width `hidden_size // moe_heads`, routes every sub-token to its top `num_experts_per_tok` of `num_experts` SwiGLU
    experts (inner width `moe_intermediate_size`), concatenates the sub-tokens and projects them with a merge layer
    (`moe_merge_layer`). `moe_heads=1` without head/merge layers is a Mixtral-style sparse MoE; `decoder_sparse_step=0`
    is a dense LLaMA. Layer `i` is MoE when `decoder_sparse_step > 0` and `(i + 1) % decoder_sparse_step == 0`.

    `norm_topk_prob=True` (this library's default) renormalises the top-k router weights to sum to 1 when k > 1 and
    keeps the raw top-1 probability when k = 1 (renormalised, every top-1 gate would be exactly 1 and the router would
    learn nothing from the LM loss); `"always"` renormalises at every k (Transformers' Mixtral); `False` keeps the raw
    top-k softmax probabilities at every k: the MH-MoE papers' eq. (3) and the official MH-MoE code (its `TopkGate` is
    built without `normalize_gate_prob_before_dropping`, so top-k gates are never renormalised).

    `router_aux_loss_mode="per_layer"` averages over MoE layers the Switch load-balancing loss of each layer, counting
    all top-k assignments of its sub-tokens; `"mixtral"` pools router statistics over all layers exactly like
    Transformers' Mixtral; `"top1_sum"` is the official MH-MoE (fairseq/Tutel GShard) convention: counts top-1
    assignments only and sums the layers' losses (the same coefficient pulls about L/k times harder than
    `"per_layer"` with L MoE layers at top-k). `capacity_factor=None` is dropless (this library's default); a number
    caps the assignments each expert takes from one forward call (S routed sub-tokens, padding rows included; priority:
    every row's top-1 before any top-2, then row order, as both GShard and the official code) and the overflow
    contributes nothing (the token keeps its residual); cached decoding steps and padded batches therefore route with
    their own capacity. `capacity_rounding="switch"` (default) caps at `ceil(capacity_factor * S * k / E)` (Switch
    Transformer's formula, this library's); `"official"` at `k * ceil(capacity_factor * S / E)`, the official MH-MoE
    `TopkGate`'s training capacity `k * ceil(S / E)` at `capacity_factor=1.0` (the official code has no factor). The
    two differ when k >= 2 and E does not divide S. (The official code's evaluation capacity, `ceil(0.25 * S)`, is not
    modelled.) `moe_layer_bias=True` gives the head and merge layers a bias, as the official code's
    `nn.Linear(d, d, bias=True)`; the papers' equations (2) and (4) have none (default False).

    `routing_backend` forces the implementation of the routing ops (expert routing and the MoH l2 head router;
    "torch": the PyTorch reference, "triton": the kernels, CUDA only); None picks by device. The environment variable MHMOE_ROUTING_BACKEND overrides it (see `routing.py`).

    Mixture-of-Head attention (MoH) is on when `moh_shared_heads` and `moh_active_heads` are set: the first
    `moh_shared_heads` heads are always on and the router picks `moh_active_heads` of the remaining heads per token
    (`moh_router` "learned": the paper's two-stage router; "l2": parameter-free, from the pre-RoPE query norms).
    `moh_straight_through` makes the gates 0/1 in the forward pass (straight-through estimator): True backpropagates
    the soft gates' gradient (top-K weights renormalised ×K, this library's); "scores" (the parameter-free l2-family
    routers) backpropagates into the raw softmax scores of all routed heads, the MoH paper's eq. 9-10 (the released
    MoH-LLaMA3 code is inference-only and has no backward);
    `moh_aux_loss_coef` weights the head load-balancing loss. See `moh.py`.

    `linear_type="bitnet_b158"` is 1-bit MH-MoE: BitNet b1.58 projections (ternary weights, 8-bit activations).
    `bitnet_quantized_layers`: "all" every decoder projection, head/merge layers included (this library's reading of
    the paper's "all the models are quantized"); "official" attention and every FFN (dense MLPs, shared and routed
    experts), never the head/merge layers or routers (the official MH-MoE code's BitNet run); "ffn_only" the FFNs only,
    attention in full precision (the official `--quant-ffn-only`); "experts" the routed experts only (this library's;
    no official configuration). `bitnet_ffn_norm`: "every_projection" puts a sub-layer RMSNorm before gate/up and
    before down (this library's); "before_down" only before down (the official FFN's sub-layer norm before fc2).
    `bitnet_packed` marks exported int8 ternary weights. See `bitnet.py`.
    `router_type="lory"` replaces top-k routing by Lory's merged expert per `lory_segment_length`-token segment,
    routed on the previous segment, per MoE head for `moe_heads > 1` (MH-Lory; `lory_expert_pool` "shared" = v1,
    "per_head" = v2); `num_experts_per_tok` is then unused. See `lory.py`.
    """

    model_type = "mhmoe"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # the cache, named "cache" from Transformers 5.24
    # Parallel plans (Transformers' `DistributedConfig(tp_size=..., ep_size=...)`), Mixtral's plus MH-MoE's own layers.
    # The expert router (`mlp.gate`) is replicated, as in Mixtral; so are the norms. See docs/training.md.
    # A config instance gives only the rules for the modules its model has (plans.py); the class, every rule.
    base_model_tp_plan = ConfigPlan({
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.self_attn.head_router": "moh_head_router",  # MoH: gathers the (B, T, H) head scores (moh_parallel.py)
        "layers.*.mlp.gate_proj": "colwise",  # dense layers
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        "layers.*.mlp.shared_expert.gate_proj": "colwise",
        "layers.*.mlp.shared_expert.up_proj": "colwise",
        "layers.*.mlp.shared_expert.down_proj": "rowwise",
        "layers.*.mlp.head_proj": "colwise_gather_output",  # the router needs whole sub-tokens on every rank
        "layers.*.mlp.merge_proj": "rowwise_split_input",
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",  # each rank: a slice of every expert's inner width
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
    }, mhmoe_has_module)  # fmt: skip
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }
    # Whole experts per rank; sub-tokens (B·T·h rows of width d/h) are what is dispatched to them.
    base_model_ep_plan = ConfigPlan({
        "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "layers.*.mlp.experts.down_proj": "grouped_gemm",
        "layers.*.mlp.experts": "ep_dispatch_experts",
    }, mhmoe_has_module)  # fmt: skip

    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int = 2048
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int | None = None
    head_dim: int | None = None
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
    # mixture of experts
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 2048
    moe_heads: int = 1
    moe_head_layer: bool | None = None  # None: on when moe_heads > 1
    moe_merge_layer: bool | None = None  # None: on when moe_heads > 1
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    norm_topk_prob: bool | str = True  # True: renormalise when k > 1; "always": also at k = 1 (Mixtral); False
    router_aux_loss_coef: float = 0.01
    router_aux_loss_mode: str = "per_layer"
    router_z_loss_coef: float = 0.0
    router_jitter_noise: float = 0.0
    capacity_factor: float | int | None = None
    capacity_rounding: str = "switch"  # "switch": ceil(cf·S·k/E) | "official": k·ceil(cf·S/E) (official MH-MoE)
    moe_layer_bias: bool = False  # head/merge layers with a bias (the official code's nn.Linear(d, d, bias=True))
    output_router_logits: bool = False
    routing_backend: str | None = None  # None: by device (triton on CUDA when installed, else torch); see routing.py
    # mixture-of-head attention (MoH); both None = plain multi-head attention
    moh_shared_heads: int | None = None
    moh_active_heads: int | None = None
    moh_router: str = "learned"
    moh_straight_through: bool | str = False  # True: soft top-K gates' gradient | "scores": eq. 9-10 (l2 router)
    moh_aux_loss_coef: float | int = 0.01
    # 1-bit MH-MoE (BitNet b1.58, bitnet.py) and Lory / MH-Lory routing (lory.py); see check_variant_problems
    linear_type: str = "linear"  # "linear" | "bitnet_b158"
    bitnet_quantized_layers: str = "all"  # "all" | "official" | "ffn_only" | "experts" (see the docstring)
    bitnet_ffn_norm: str = "every_projection"  # "every_projection" | "before_down" (the official FFN)
    bitnet_packed: bool = False  # weights stored as int8 ternary + one scale per matrix (export; inference only)
    router_type: str = "topk"  # "topk" | "lory"
    lory_segment_length: int = 256
    lory_expert_pool: str = "shared"  # "shared": MH-Lory v1 (E experts) | "per_head": v2 (E per head, E·h in all)

    def __post_init__(self, **kwargs):
        misnamed = [f"{name} (use {MISNAMED_FIELDS[name]})" for name in kwargs if name in MISNAMED_FIELDS]
        if misnamed:
            raise ValueError(f"Invalid MHMoEConfig: unknown argument(s) {', '.join(misnamed)}.")
        warn_misspelt_fields(type(self), kwargs)
        if self.head_dim is None and self.num_attention_heads > 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.moe_head_layer is None:
            self.moe_head_layer = self.moe_heads > 1
        if self.moe_merge_layer is None:
            self.moe_merge_layer = self.moe_heads > 1
        super().__post_init__(**kwargs)
        self.check_combinations()

    def check_combinations(self):
        """Refuse every invalid combination with a `ValueError` that says what is wrong (run at construction)."""
        sizes = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "max_position_embeddings")  # fmt: skip
        # head_dim stays None when num_attention_heads < 1 (reported as such)
        values = {name: getattr(self, name) for name in sizes if getattr(self, name) is not None}
        problems = [f"{name} must be >= 1, got {value}" for name, value in values.items() if not value >= 1]
        if problems:  # the checks below divide by these
            raise ValueError("Invalid MHMoEConfig: " + "; ".join(problems) + ".")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            problems.append(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.decoder_sparse_step < 0:
            problems.append(f"decoder_sparse_step must be >= 0 (0 = dense model), got {self.decoder_sparse_step}")
        elif self.decoder_sparse_step > self.num_hidden_layers:
            problems.append(
                f"decoder_sparse_step ({self.decoder_sparse_step}) is larger than num_hidden_layers "
                f"({self.num_hidden_layers}), so no layer would be MoE; use 0 for a dense model"
            )
        if self.intermediate_size < 1 and not all(map(self.is_moe_layer, range(self.num_hidden_layers))):
            problems.append(f"intermediate_size (the dense layers' MLP width) must be >= 1, got "
                            f"{self.intermediate_size}")  # fmt: skip
        if self.hidden_act not in ACT2FN:
            problems.append(f"hidden_act {self.hidden_act!r} is not one of Transformers' activations (e.g. 'silu')")
        if self.pad_token_id is not None and not -self.vocab_size <= self.pad_token_id < self.vocab_size:
            problems.append(f"pad_token_id ({self.pad_token_id}) must lie in the vocabulary (vocab_size "
                            f"{self.vocab_size})")  # fmt: skip
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            problems.append(f"rms_norm_eps must be a finite number > 0, got {self.rms_norm_eps}")
        if not (self.initializer_range >= 0 and math.isfinite(self.initializer_range)):
            problems.append(f"initializer_range must be a finite number >= 0, got {self.initializer_range}")
        if self.sliding_window is not None and self.sliding_window < 1:
            problems.append(f"sliding_window must be a positive number of tokens or None, got {self.sliding_window}")
        if self.decoder_sparse_step > 0:
            if self.moe_heads < 1 or self.hidden_size % self.moe_heads:
                problems.append(
                    f"hidden_size ({self.hidden_size}) must be divisible by moe_heads ({self.moe_heads}); choose "
                    "moe_heads among the divisors of hidden_size"
                )
            if self.num_experts < 1:
                problems.append(f"num_experts must be >= 1, got {self.num_experts}")
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                problems.append(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and num_experts "
                    f"({self.num_experts})"
                )
            if self.moe_intermediate_size < 1:
                problems.append(f"moe_intermediate_size must be >= 1, got {self.moe_intermediate_size}")
        if self.shared_expert_intermediate_size < 0:
            problems.append(
                f"shared_expert_intermediate_size must be >= 0 (0 = no shared expert), got "
                f"{self.shared_expert_intermediate_size}"
            )
        if self.norm_topk_prob not in NORM_TOPK_PROB:
            problems.append(f"norm_topk_prob must be True, False or 'always', got {self.norm_topk_prob!r}")
        if self.router_aux_loss_mode not in AUX_LOSS_MODES:
            problems.append(f"router_aux_loss_mode must be one of {AUX_LOSS_MODES}, got {self.router_aux_loss_mode!r}")
        if self.router_aux_loss_mode == "mixtral" and self.moe_heads != 1:
            problems.append("router_aux_loss_mode='mixtral' pools token-level statistics and needs moe_heads=1")
        for name in ("router_aux_loss_coef", "router_z_loss_coef", "router_jitter_noise", "attention_dropout"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                problems.append(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        if self.router_jitter_noise >= 1:
            problems.append(f"router_jitter_noise must be < 1 (inputs are scaled by U(1 - noise, 1 + noise)), got "
                            f"{self.router_jitter_noise}")  # fmt: skip
        if self.attention_dropout > 1:
            problems.append(f"attention_dropout is a probability, got {self.attention_dropout}")
        if self.capacity_factor is not None and not (self.capacity_factor > 0 and math.isfinite(self.capacity_factor)):
            problems.append(f"capacity_factor must be a finite number > 0 or None (dropless), got "
                            f"{self.capacity_factor}")  # fmt: skip
        if self.capacity_rounding not in CAPACITY_ROUNDINGS:
            problems.append(f"capacity_rounding must be one of {CAPACITY_ROUNDINGS}, got {self.capacity_rounding!r}")
        elif self.capacity_rounding == "official" and self.capacity_factor is None:
            problems.append("capacity_rounding='official' rounds a capacity, but capacity_factor is None "
                            "(dropless); set capacity_factor=1.0 (the official code's) or use "
                            "capacity_rounding='switch'")  # fmt: skip
        if self.moe_layer_bias and not (self.moe_head_layer or self.moe_merge_layer):
            problems.append("moe_layer_bias=True needs a head or merge layer (moe_head_layer / moe_merge_layer)")
        if self.routing_backend is not None and self.routing_backend not in ROUTING_BACKENDS:
            problems.append(f"routing_backend must be one of {ROUTING_BACKENDS} or None (by device), got "
                            f"{self.routing_backend!r}")  # fmt: skip
        problems += moh_config_problems(self)
        problems += check_variant_problems(self)
        problems += head_problems(self)
        if problems:
            raise ValueError("Invalid MHMoEConfig: " + "; ".join(problems) + ".")

    def validate_architecture(self):
        """Transformers' strict-dataclass hook (`config.validate()`, run again by `save_pretrained`)."""
        super().validate_architecture()
        self.check_combinations()

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.decoder_sparse_step > 0 and (layer_idx + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_llama_config(cls, llama_config, **kwargs) -> "MHMoEConfig":
        """The dense MHMoE config whose model has exactly `LlamaForCausalLM`'s parameters."""
        _expect_model_type(llama_config, "llama", "from_llama_config")
        fields = _shared_fields(llama_config)
        fields.update(mlp_bias=llama_config.mlp_bias, attention_bias=llama_config.attention_bias, decoder_sparse_step=0)
        fields.update(kwargs)
        return cls(**fields)

    @classmethod
    def from_mixtral_config(cls, mixtral_config, **kwargs) -> "MHMoEConfig":
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
        return cls(**fields)

    @classmethod
    def matched_to_smoe(
        cls, smoe_config: "MHMoEConfig", moe_heads: int, num_experts_per_tok: int, round_experts_to: int = 8,
        conventions: str = "library", **kwargs,
    ) -> "MHMoEConfig":  # fmt: skip
        """The MH-MoE config whose MoE layers match `smoe_config`'s activated FLOPs and total parameters.

        Head and merge layers are counted, on both sides (`moe_head_layer=False` / `moe_merge_layer=False` in `kwargs`
        solve for the ablations without them); see `mhmoe.parity.matched_moe_settings` for the equations. A Mixtral
        config: convert it with `from_mixtral_config` first.

        `conventions="library"` keeps `smoe_config`'s routing fields; `"official"` is the paper as its official code
        ran it (`conventions_fields`): raw top-k gates (`norm_topk_prob=False`), capacity `k * ceil(S / E)`
        (`capacity_factor=1.0`, `capacity_rounding="official"`), head/merge layers with bias (`moe_layer_bias=True`,
        2·d parameters per MoE layer that the parity solve does not count), the GShard top-1 loss summed over layers
        (`router_aux_loss_mode="top1_sum"`, 0.01) and, for BitNet models, `bitnet_quantized_layers="official"` and
        `bitnet_ffn_norm="before_down"`. Give the SMoE baseline the same fields (`conventions_fields("official",
        smoe_config)`) to compare like with like. `kwargs` override both.
        """
        if not isinstance(smoe_config, MHMoEConfig):
            raise ValueError(
                f"matched_to_smoe takes an MHMoEConfig, got {type(smoe_config).__name__}; for a Mixtral config use "
                "MHMoEConfig.matched_to_smoe(MHMoEConfig.from_mixtral_config(config), ...)"
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
        return cls(**fields)


CONVENTIONS = ("library", "official")
# The official MH-MoE code (torchscale xmoe + Tutel, yushuiwx/MH-MoE) where this library's defaults differ.
OFFICIAL_ROUTING = dict(norm_topk_prob=False, capacity_factor=1.0, capacity_rounding="official",
                        router_aux_loss_mode="top1_sum", router_aux_loss_coef=0.01)  # fmt: skip
OFFICIAL_BITNET = dict(bitnet_quantized_layers="official", bitnet_ffn_norm="before_down")


def conventions_fields(conventions: str, config) -> dict:
    """The fields that give `config` (an MHMoEConfig or its dict) the `conventions`: {} for "library" (the config as
    is), for "official" `OFFICIAL_ROUTING`, `moe_layer_bias=True` when it has a head or merge layer, and
    `OFFICIAL_BITNET` when it is a BitNet model (see `MHMoEConfig.matched_to_smoe`)."""
    if conventions not in CONVENTIONS:
        raise ValueError(f"conventions must be one of {CONVENTIONS}, got {conventions!r}")
    if conventions == "library":
        return {}
    get = config.get if isinstance(config, dict) else lambda name, default=None: getattr(config, name, default)
    fields = dict(OFFICIAL_ROUTING)
    heads = get("moe_heads", 1) or 1
    if any(get(name) or (get(name) is None and heads > 1) for name in ("moe_head_layer", "moe_merge_layer")):
        fields["moe_layer_bias"] = True
    if get("linear_type", "linear") == "bitnet_b158":
        fields.update(OFFICIAL_BITNET)
    return fields


def moh_config_problems(config) -> list[str]:
    """What is wrong with a config's moh_* fields, in words (empty list: valid). Shared by every MoH config."""
    problems = []
    heads, shared, active = config.num_attention_heads, config.moh_shared_heads, config.moh_active_heads
    if config.moh_router not in MOH_ROUTERS:
        problems.append(f"moh_router must be one of {MOH_ROUTERS}, got {config.moh_router!r}")
    if not (config.moh_aux_loss_coef >= 0 and math.isfinite(config.moh_aux_loss_coef)):
        problems.append(f"moh_aux_loss_coef must be a finite number >= 0, got {config.moh_aux_loss_coef}")
    straight = config.moh_straight_through
    if not any(straight is value or (isinstance(value, str) and straight == value) for value in MOH_STRAIGHT_THROUGH):
        problems.append(f"moh_straight_through must be False, True or 'scores' (the paper's eq. 9-10), got "
                        f"{straight!r}")  # fmt: skip
    elif straight == "scores" and config.moh_router not in ("l2", *CALIBRATED_MOH_ROUTERS):
        problems.append("moh_straight_through='scores' (eq. 9-10 on a parameter-free router's softmax scores) needs "
                        "moh_router 'l2', 'l2_standardized' or 'l2_relative'; use True with the learned "
                        "router")  # fmt: skip
    if (shared is None) != (active is None):
        problems.append(
            f"moh_shared_heads and moh_active_heads must be set together (both None = plain multi-head attention), "
            f"got moh_shared_heads={shared} and moh_active_heads={active}"
        )
    elif shared is not None:
        if shared < 0:
            problems.append(f"moh_shared_heads must be >= 0, got {shared}")
        elif shared >= heads:
            problems.append(
                f"moh_shared_heads ({shared}) must be smaller than num_attention_heads ({heads}) so that at least one "
                "head is routed"
            )
        if active < 1:
            problems.append(f"moh_active_heads (routed heads active per token) must be >= 1, got {active}")
        elif 0 <= shared < heads and shared + active > heads:
            problems.append(
                f"moh_shared_heads + moh_active_heads ({shared} + {active}) must be <= num_attention_heads ({heads}): "
                f"the router picks moh_active_heads of the {heads - shared} routed heads"
            )
    problems += _head_norm_problems(config)
    return problems


def _head_norm_problems(config) -> list[str]:
    """The calibrated routers' per-layer, per-head query-norm statistics: present, (layers × heads), std > 0."""
    mean, std = getattr(config, "moh_head_norm_mean", None), getattr(config, "moh_head_norm_std", None)
    if config.moh_router not in CALIBRATED_MOH_ROUTERS:
        return []
    if mean is None or std is None:
        return [f"moh_router {config.moh_router!r} needs moh_head_norm_mean and moh_head_norm_std (per layer, per head "
                "query-norm statistics, measured by mhmoe-convert --calibration_file)"]
    shape = (getattr(config, "num_hidden_layers", None), config.num_attention_heads)
    for name, rows in (("moh_head_norm_mean", mean), ("moh_head_norm_std", std)):
        if len(rows) != shape[0] or any(len(row) != shape[1] for row in rows):
            return [f"{name} must be a list of {shape[0]} layers × {shape[1]} heads"]
    if any(not (value > 0 and math.isfinite(value)) for row in (*mean, *std) for value in row):
        return ["moh_head_norm_mean and moh_head_norm_std must be finite and > 0"]
    return []


LINEAR_TYPES = ("linear", "bitnet_b158")  # bitnet.py
BITNET_QUANTIZED_LAYERS = ("all", "official", "ffn_only", "experts")
BITNET_FFN_NORMS = ("every_projection", "before_down")
ROUTER_TYPES = ("topk", "lory")  # lory.py
LORY_EXPERT_POOLS = ("shared", "per_head")


def check_variant_problems(config) -> list[str]:
    """What is wrong with the BitNet (linear_type, bitnet_*) and Lory (router_type, lory_*) fields, in words."""
    problems, bitnet, lory = [], config.linear_type == "bitnet_b158", config.router_type == "lory"
    if config.linear_type not in LINEAR_TYPES:
        problems.append(f"linear_type must be one of {LINEAR_TYPES}, got {config.linear_type!r}")
    if config.bitnet_quantized_layers not in BITNET_QUANTIZED_LAYERS:
        problems.append(f"bitnet_quantized_layers must be one of {BITNET_QUANTIZED_LAYERS} ('all': every decoder "
                        f"projection; 'official': attention and FFNs, not head/merge layers or routers; 'ffn_only': "
                        f"the FFNs; 'experts': the routed experts), got "
                        f"{config.bitnet_quantized_layers!r}")  # fmt: skip
    if config.bitnet_ffn_norm not in BITNET_FFN_NORMS:
        problems.append(f"bitnet_ffn_norm must be one of {BITNET_FFN_NORMS}, got {config.bitnet_ffn_norm!r}")
    if bitnet and config.bitnet_quantized_layers == "experts" and config.decoder_sparse_step == 0:
        problems.append("bitnet_quantized_layers='experts' quantises nothing in a dense model (decoder_sparse_step=0); "
                        "use 'all'")  # fmt: skip
    if config.bitnet_packed and not bitnet:
        problems.append("bitnet_packed=True needs linear_type='bitnet_b158' (it marks exported ternary weights)")
    if config.router_type not in ROUTER_TYPES:
        problems.append(f"router_type must be one of {ROUTER_TYPES} ('topk': sparse top-k routing; 'lory': one "
                        f"merged expert per segment), got {config.router_type!r}")  # fmt: skip
    if config.lory_expert_pool not in LORY_EXPERT_POOLS:
        problems.append(f"lory_expert_pool must be one of {LORY_EXPERT_POOLS} ('shared': MH-Lory v1; 'per_head': "
                        f"v2), got {config.lory_expert_pool!r}")  # fmt: skip
    if not config.lory_segment_length >= 1:
        problems.append(f"lory_segment_length must be >= 1 tokens, got {config.lory_segment_length}")
    if lory and config.capacity_factor is not None:
        problems.append("capacity_factor applies to top-k routing; router_type='lory' merges all experts (use None)")
    if lory and config.router_jitter_noise:
        problems.append("router_jitter_noise applies to top-k routing; use 0 with router_type='lory'")
    if lory and bitnet:
        problems.append("router_type='lory' with linear_type='bitnet_b158' is not supported (quantising merged "
                        "experts is not defined by either paper); choose one")  # fmt: skip
    return problems


def _expect_model_type(config, model_type: str, method: str) -> None:
    if getattr(config, "model_type", None) != model_type:
        raise ValueError(
            f"MHMoEConfig.{method} takes a Transformers {model_type} config (model_type {model_type!r}), got "
            f"{type(config).__name__} (model_type {getattr(config, 'model_type', None)!r})"
        )


def _shared_fields(config) -> dict:
    """The LLaMA-family fields that carry over unchanged."""
    names = (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
        "rms_norm_eps", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings",
        "rope_parameters", "attention_dropout",
    )  # fmt: skip
    return {name: getattr(config, name) for name in names if getattr(config, name, None) is not None}


def refuse_auto_class_registration(cls: type) -> None:
    """moh_llama's files import the shared MoH code from this folder (`from ..mhmoe...`), which Transformers'
    `save_pretrained` cannot copy after `register_for_auto_class`; the exported copies (flattened imports, loaded as
    `transformers_modules...`) register normally."""
    if cls.__module__.startswith("mhmoe."):
        raise ValueError(
            f"{cls.__name__}.register_for_auto_class: Transformers cannot copy moh_llama's modeling code, which shares "
            "files with mhmoe's MHMoE folder. Export with `mhmoe.hub.export_pretrained(model, save_directory)` or "
            "`mhmoe-export SRC_DIR OUT_DIR` instead: it writes the code and the auto_map for AutoConfig, AutoModel and "
            "AutoModelForCausalLM (and `push_to_hub=` uploads the folder)"
        )


# --------------------------------------------------------------------------------------------------------------------
# Checks added for issue 22 (kept together here; the field checks above are unchanged)


def head_problems(config) -> list[str]:
    """LlamaConfig's check: with the derived head_dim (hidden_size // num_attention_heads) the heads must cover
    hidden_size exactly. An explicit head_dim of another width is allowed (as in Mistral and Qwen3)."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    if heads >= 1 and hidden % heads and config.head_dim == hidden // heads:
        return [f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}); choose "
                "num_attention_heads among the divisors of hidden_size, or set head_dim explicitly"]  # fmt: skip
    return []


def warn_misspelt_fields(config_class: type, kwargs: dict) -> None:
    """A config takes unknown keyword arguments silently (Transformers keeps them as attributes): warn by name about
    those that look like a misspelt field (`num_expert` for `num_experts`), which would otherwise train with the
    field's default."""
    import difflib

    from transformers.utils import logging

    fields = [field.name for field in dataclasses.fields(config_class)]
    for name in kwargs:
        close = difflib.get_close_matches(name, fields, n=1, cutoff=0.85)
        if close and not hasattr(PreTrainedConfig, name):
            logging.get_logger(__name__).warning(
                f"{config_class.__name__}: unknown argument {name!r} is not a config field (did you mean "
                f"{close[0]!r}?); it is kept as an attribute and {close[0]} keeps its value"
            )


__all__ = ["CALIBRATED_MOH_ROUTERS", "MHMoEConfig", "conventions_fields", "moh_config_problems",
           "refuse_auto_class_registration"]  # fmt: skip
