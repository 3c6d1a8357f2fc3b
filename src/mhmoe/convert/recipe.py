"""The MoH paper's recipe for turning a dense LLaMA into MoH-LLaMA (§4.4, App. B.2, Table D): every default, once.

Change the converter's recipe here; plan.py, options.py, conversion.py, continue_tune.py and cli.py read it from this
file. The head
choices measured on calibration text (which heads are shared, the routed-head score: the default for a source with a
tokenizer is "fitted", the learned router with W_r fitted, `moh_straight_through=True`) are calibrate.py's; the
fields below are what the paper's recipe (`--recipe paper`) writes.

* Head split: the first `SHARED_HEADS_RATIO × H` heads of every layer are shared (always on); `ACTIVE_HEADS_RATIO` is
  the fraction of *all* heads active per token (shared + routed), as in the paper: LLaMA3-8B, 32 heads, 16 shared,
  8 of the other 16 routed = 75%.
* Router: the parameter-free "l2" router (pre-RoPE query norms) with straight-through 0/1 gates. It adds no
  parameters, so the dense weights are copied unchanged, and with every head on the model is the dense parent.
  `STRAIGHT_THROUGH = "scores"`: the paper's eq. 9-10 read with g_i the raw softmax score of every routed head (the
  estimator passes "through the sparsity function"); `"selected_scores"` is the other reading (the selected heads'
  scores only). "scores" recovered at least as well as the soft top-K gates' gradient (`True`) on a tiny model
  (benchmarks/studies/convert_straight_through.py, docs/conversion.md, which also compares the other reading).
* MoH load-balance loss β = `AUX_LOSS_COEF` (eq. 7).
* Continue-tuning (the paper's second stage): AdamW, warmup 50 iterations, cosine 2e-5 -> 1e-6, weight decay 0.1,
  gradient clipping 1.0; the dense parent's perplexity is measured at step 0.
"""

from __future__ import annotations

from .errors import ConversionError

SHARED_HEADS_RATIO = 0.5
ACTIVE_HEADS_RATIO = 0.75
ROUTER = "l2"
STRAIGHT_THROUGH = "scores"  # eq. 9-10; True: the soft top-K gates' gradient (measured in docs/conversion.md)
GATES = "straight-through" if STRAIGHT_THROUGH else "soft"  # in words, for reports and --help
AUX_LOSS_COEF = 0.01

# mhmoe-train's defaults replaced for continue-tuning (every other mhmoe-train default stays)
CONTINUE_TUNING_DEFAULTS = {
    "learning_rate": 2e-5,
    "min_learning_rate": 1e-6,
    "warmup_steps": 50,
    "lr_scheduler_type": "cosine",
    "weight_decay": 0.1,
    "max_grad_norm": 1.0,
    "eval_at_start": True,
}


def check_number(name: str, value, error: type[Exception] = ConversionError) -> float:
    """`value` as a finite real number; a string, None or a bool raise `TypeError`, NaN or infinity `error`, each in
    one line naming the argument."""
    import math
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, not {type(value).__name__} ({value!r})")
    if not math.isfinite(value):
        raise error(f"{name} must be a finite number, got {value}")
    return float(value)


def _count(name: str, value, num_heads: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a whole number of heads, not {type(value).__name__} ({value!r})")
    if not 0 <= value <= num_heads:
        raise ConversionError(f"{name} {value} must be between 0 and the model's {num_heads} heads")
    return value


def head_split(
    num_heads: int,
    shared_heads_ratio: float = SHARED_HEADS_RATIO,
    active_heads_ratio: float = ACTIVE_HEADS_RATIO,
    shared_heads: int | None = None,
    active_heads: int | None = None,
) -> tuple[int, int]:
    """(shared heads, routed heads active per token) for `num_heads` query heads.

    `active_heads_ratio` counts all active heads (shared + routed): 32 heads, 0.5, 0.75 -> (16, 8). `shared_heads` /
    `active_heads` give the counts instead of the ratios (9 heads: 3 and 7 -> (3, 4)). A ratio within 0.001 of a
    whole number of heads is that number (0.3333 of 9 heads is 3). Refuses ratios that do not give whole heads, no
    routed head, or no active routed head.
    """
    words = []
    if shared_heads is None:
        ratio = check_number("--shared_heads_ratio", shared_heads_ratio)
        if not 0 <= ratio < 1:
            raise ConversionError(f"--shared_heads_ratio must be in [0, 1), got {shared_heads_ratio}")
        shared_float, words = num_heads * ratio, [f"shared ratio {shared_heads_ratio}"]
    else:
        shared_float = _count("--shared_heads", shared_heads, num_heads)
    if active_heads is None:
        ratio = check_number("--active_heads_ratio", active_heads_ratio)
        if not 0 < ratio <= 1:
            raise ConversionError(f"--active_heads_ratio must be in (0, 1], got {active_heads_ratio}")
        active_float = num_heads * ratio
        words.append(f"active ratio {active_heads_ratio}")
    else:
        active_float = _count("--active_heads", active_heads, num_heads)
    shared, active = round(shared_float), round(active_float)
    tolerance = min(1e-3 * num_heads, 0.25)  # ratios written to 3-4 decimals (0.3333 of 9 heads)
    if abs(shared_float - shared) > tolerance or abs(active_float - active) > tolerance:
        raise ConversionError(
            f"{' and '.join(words)} give no whole number of heads of {num_heads}: {shared_float:.4g} shared, "
            f"{active_float:.4g} active (use multiples of 1/{num_heads}, or counts: --shared_heads N --active_heads M)"
        )
    if shared >= num_heads:
        raise ConversionError(f"{shared} shared heads of {num_heads} leave no head to route")
    if active <= shared:
        raise ConversionError(
            f"{active} active heads must be more than the {shared} shared heads: the active heads count shared + "
            "routed heads, and at least one routed head must be active"
        )
    return shared, active - shared


def check_aux_loss_coef(value) -> float:
    """β of the MoH balance loss: a finite number >= 0."""
    value = check_number("--moh_aux_loss_coef", value)
    if value < 0:
        raise ConversionError(f"--moh_aux_loss_coef must be >= 0 (0: no balance loss), got {value:g}")
    return value


def moh_fields(shared: int, routed_active: int, aux_loss_coef: float) -> dict:
    """The MoHLlamaConfig fields the recipe sets on top of the source's Llama fields."""
    return dict(
        moh_shared_heads=shared,
        moh_active_heads=routed_active,
        moh_router=ROUTER,
        moh_straight_through=STRAIGHT_THROUGH,
        moh_aux_loss_coef=aux_loss_coef,
    )


def _number(value: float) -> str:
    return f"{value:g}".replace("e-0", "e-")  # 2e-5, not 2e-05


def continue_tuning_words() -> str:
    """The continue-tuning defaults in words, for --help."""
    d = CONTINUE_TUNING_DEFAULTS
    return (
        f"lr {_number(d['learning_rate'])} -> {_number(d['min_learning_rate'])} {d['lr_scheduler_type']}, warmup "
        f"{d['warmup_steps']}, weight decay {_number(d['weight_decay'])}, clip {d['max_grad_norm']:.1f}, "
        f"β {_number(AUX_LOSS_COEF)}"
    )
