"""The moh_* fields that every MoH config shares (MHMoEConfig, MoHLlamaConfig, a model patched by `apply_moh`),
declared once (`MoHConfigFields`: names, types, one set of defaults): when MoH is on, and what is wrong with them, in
words. The chosen router checks its own fields (`head_routers.py`)."""

import dataclasses
import math

from ..ops.head_router.head_router_naive import STRAIGHT_THROUGH as MOH_STRAIGHT_THROUGH  # head_routers.py: each's grad
from ..ops.head_router.head_router_naive import is_one_of
from .head_routers import HEAD_ROUTERS, layer_active_heads

HEAD_SKIPPING_CHOICES = (True, False, "naive", "cpu", "flex", "triton")  # moh_head_skipping (attention_plan.py)


@dataclasses.dataclass(kw_only=True, repr=False)
class MoHConfigFields:
    """The Mixture-of-Head attention fields, a base of both configs (their strict checks type them); `apply_moh` adds
    them to a Llama / Mistral / Qwen2 config (`MOH_FIELDS`). MoH is on when `moh_shared_heads` and `moh_active_heads`
    are set: the first `moh_shared_heads` heads of every layer always on, `moh_active_heads` of the others routed per
    token. The defaults are the paper's continue-tuning recipe (§4.4), which adds no parameters: the "l2" router
    (pre-RoPE query norms) with straight-through 0/1 gates; `moh_router="learned"` is the two-stage router of eq. 5-6
    (the paper's from-scratch models; zero-initialised, soft gates unless `moh_straight_through`)."""

    moh_shared_heads: int | None = None
    moh_active_heads: int | None = None
    moh_active_heads_per_layer: list | None = None  # per-layer routed budgets (None: moh_active_heads in every layer)
    moh_head_thresholds: list | None = None  # per-layer score thresholds instead of the top-K (head_routers.py)
    moh_router: str = "l2"  # head_routers.HEAD_ROUTERS
    moh_straight_through: bool | str = True  # True: the soft top-K gates' gradient | False | "scores" /
    # "selected_scores": eq. 9-10
    moh_aux_loss_coef: float | int = 0.01  # the head load-balancing loss (eq. 7), with output_router_logits
    moh_head_norm_mean: list | None = None  # the calibrated routers' statistics, per layer and head (mhmoe-convert
    moh_head_norm_sigma: list | None = None  # --calibration_file); not *_std: Transformers takes those for init stds
    moh_head_skipping: bool | str = True  # True: where it pays | False | a backend: "naive" "cpu" "flex" "triton"
    moh_fused_decoding: bool = True  # the CPU decoding step (fused_decoding.py)


MOH_FIELDS = {field.name: field.default for field in dataclasses.fields(MoHConfigFields)}  # name -> default


def moh_enabled(config) -> bool:
    """Whether `config` asks for Mixture-of-Head attention (`moh_active_heads` set)."""
    return getattr(config, "moh_active_heads", None) is not None


def per_layer_problems(config) -> list[str]:
    """`moh_active_heads_per_layer`: None, or one whole number in [1, routed heads] per hidden layer."""
    per_layer = getattr(config, "moh_active_heads_per_layer", None)
    if per_layer is None:
        return []
    if config.moh_active_heads is None or config.moh_shared_heads is None:
        return ["moh_active_heads_per_layer needs MoH on (moh_shared_heads and moh_active_heads set)"]
    layers, routed = getattr(config, "num_hidden_layers", None), config.num_attention_heads - config.moh_shared_heads
    listed = isinstance(per_layer, (list, tuple))
    whole = listed and all(isinstance(k, int) and not isinstance(k, bool) for k in per_layer)
    if not whole or len(per_layer) != layers or not all(1 <= k <= routed for k in per_layer):
        return [
            f"moh_active_heads_per_layer must be None (every layer: moh_active_heads) or a list of {layers} whole "
            f"numbers (one per layer), each from 1 to the {routed} routed heads, got {per_layer!r}"
        ]
    return []


def threshold_problems(config) -> list[str]:
    """`moh_head_thresholds`: None, or one finite number (or None: that layer's top-K) per hidden layer, with MoH on
    and straight-through (0/1) gates."""
    thresholds = getattr(config, "moh_head_thresholds", None)
    if thresholds is None:
        return []
    layers = getattr(config, "num_hidden_layers", None)
    listed = isinstance(thresholds, (list, tuple)) and len(thresholds) == layers
    if not listed or not all(
        t is None or (isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)) for t in thresholds
    ):
        return [
            f"moh_head_thresholds must be None (top-K routing) or a list of {layers} finite numbers or None (one per "
            f"layer), got {thresholds!r}"
        ]
    if config.moh_active_heads is None:
        return ["moh_head_thresholds needs MoH on (moh_shared_heads and moh_active_heads set)"]
    if not config.moh_straight_through:
        return [
            "moh_head_thresholds needs straight-through 0/1 gates (moh_straight_through True, 'scores' or "
            "'selected_scores'): soft gates weigh exactly K heads"
        ]
    return []


def head_skipping_problems(config) -> list[str]:
    """What is wrong with `moh_head_skipping` / `moh_fused_decoding`, in words."""
    problems = []
    skipping = getattr(config, "moh_head_skipping", True)
    if not is_one_of(skipping, HEAD_SKIPPING_CHOICES):
        problems.append(
            f"moh_head_skipping must be True (the head-sparse op where it pays), False (every head computed and masked) "
            f"or a backend name, 'naive', 'cpu', 'flex' or 'triton', got {skipping!r}"
        )
    fused = getattr(config, "moh_fused_decoding", True)
    if not isinstance(fused, bool):
        problems.append(f"moh_fused_decoding must be True or False, got {fused!r}")
    return problems


def moh_config_problems(config) -> list[str]:
    """What is wrong with a config's moh_* fields, in words (empty list: valid)."""
    problems = []
    heads, shared, active = config.num_attention_heads, config.moh_shared_heads, config.moh_active_heads
    router = HEAD_ROUTERS.get(config.moh_router)
    if router is None:
        problems.append(f"moh_router must be one of {tuple(HEAD_ROUTERS)}, got {config.moh_router!r}")
    if not (config.moh_aux_loss_coef >= 0 and math.isfinite(config.moh_aux_loss_coef)):
        problems.append(f"moh_aux_loss_coef must be a finite number >= 0, got {config.moh_aux_loss_coef}")
    straight = config.moh_straight_through
    if not is_one_of(straight, MOH_STRAIGHT_THROUGH):
        problems.append(
            f"moh_straight_through must be False, True, 'scores' or 'selected_scores' (the paper's eq. 9-10, two "
            f"readings), got {straight!r}"
        )
    elif straight in ("scores", "selected_scores") and router is not None and not router.score_straight_through:
        able = [name for name, cls in HEAD_ROUTERS.items() if cls.score_straight_through]
        names = ", ".join(repr(name) for name in able[:-1]) + f" or {able[-1]!r}"
        problems.append(
            f"moh_straight_through={straight!r} (eq. 9-10 on a parameter-free router's softmax scores) needs "
            f"moh_router {names}; use True with the {config.moh_router} router"
        )
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
    if shared is None or 0 <= shared < heads:
        problems += per_layer_problems(config)
    problems += threshold_problems(config) + head_skipping_problems(config)
    if router is not None:
        problems += router.config_problems(config)
    return problems


__all__ = [
    "MOH_FIELDS",
    "MOH_STRAIGHT_THROUGH",
    "MoHConfigFields",
    "layer_active_heads",
    "moh_config_problems",
    "moh_enabled",
]
