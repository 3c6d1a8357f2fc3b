"""What a conversion is asked for: `ConvertOptions`, the keyword arguments of `convert` as one frozen, checked value,
and `SpeedSettings` (`--measure_speed`). Checked before anything is read: numbers of the wrong type raise `TypeError`,
values out of range `ConversionError` (a `ValueError`). Importing this module imports neither torch nor Transformers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .calibrate import CALIBRATION_TOKENS, DEFAULT_RECIPE, HEAD_BUDGETS, HeadRecipe, head_recipe
from .errors import ConversionError
from .recipe import ACTIVE_HEADS_RATIO, AUX_LOSS_COEF, SHARED_HEADS_RATIO, check_aux_loss_coef, check_number

SPEED_TOKENS = 512
SPEED_NEW_TOKENS = 32
SPEED_ROUNDS = 5


@dataclass(frozen=True)
class SpeedSettings:
    """What `--measure_speed` times (`mhmoe.evaluation.conversion_speed`): a prompt of `tokens` tokens, `new_tokens`
    greedy tokens after it, `rounds` rounds (at least; more for short prefills)."""

    tokens: int = SPEED_TOKENS
    new_tokens: int = SPEED_NEW_TOKENS
    rounds: int = SPEED_ROUNDS

    def __post_init__(self):
        for flag, value in (
            ("--speed_tokens", self.tokens),
            ("--speed_new_tokens", self.new_tokens),
            ("--speed_rounds", self.rounds),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConversionError(f"{flag} must be a whole number >= 1, got {value!r}")


@dataclass(frozen=True)
class ConvertOptions:
    """Every keyword argument of `convert` (besides the two folders), checked on construction.

    `shared_heads_ratio` / `active_heads_ratio`: the fractions of each layer's heads shared and active (shared +
    routed); `shared_heads` / `active_heads`: the same as counts per layer instead of the ratios. `moh_aux_loss_coef`:
    β of the balance loss. `overwrite`: replace a non-empty output folder. `verify_logits=False` skips loading the
    models (names, dtypes and shapes are still checked; no held-out perplexity); `probe_text`: the logit check's text.
    `progress`: progress bars and lines. `gguf_file`: convert this GGUF file inside the input folder (dequantised
    first: source.py). `recipe`: how shared heads and the routed-head score are chosen (calibrate.py; "paper": the
    first heads shared, l2 router, weights copied byte for byte; a calibrated recipe measures the source on the first
    `calibration_tokens` tokens of `calibration_file` and permutes heads; the logit check also measures the converted
    model's perplexity over its parent's on the text's held-out tokens: heldout.py). `source_names`: the source's
    public names, already found (`hub.conversion_cards.parent_names`); `source_notes`: how the source was read, first
    among the report's notes. `trust_remote_code`: let Transformers run the code the source's tokenizer names
    (calibration, the logit check); the model's code is always Transformers' own and no code is copied.
    `head_budget`: "uniform" (every layer `active_heads`), "calibrated" (per-layer routed budgets at the same total,
    from each layer's measured effect on the model's predictions: head_budget.py) or "threshold" (those budgets as
    averages; per token the heads scoring above a per-layer threshold). `speed`: time the converted model against its
    parent on this machine before the folder is renamed into place (`mhmoe.evaluation.conversion_speed`; recorded in
    moh_conversion.json and the card). `base_model`: the source's Hugging Face Hub id, which the card and
    moh_conversion.json name it by (default: a Hub cache snapshot's repo id, a Hub id in the source's config.json
    `_name_or_path`, else the GGUF file's name; never a local path or folder name).
    """

    shared_heads_ratio: float = SHARED_HEADS_RATIO
    active_heads_ratio: float = ACTIVE_HEADS_RATIO
    overwrite: bool = False
    verify_logits: bool = True
    probe_text: str | None = None
    moh_aux_loss_coef: float = AUX_LOSS_COEF
    progress: bool = True
    gguf_file: str | None = None
    recipe: HeadRecipe | str = DEFAULT_RECIPE
    calibration_file: str | None = None
    calibration_tokens: int = CALIBRATION_TOKENS
    source_names: dict | None = None
    source_notes: list[str] | None = None
    trust_remote_code: bool = False
    shared_heads: int | None = None
    active_heads: int | None = None
    head_budget: str = "uniform"
    speed: SpeedSettings | None = None
    base_model: str | None = None

    def __post_init__(self):
        """The numbers given (a ratio replaced by its count is not checked as a ratio), then the other options."""
        check_number("--shared_heads_ratio", self.shared_heads_ratio if self.shared_heads is None else 0.0)
        check_number("--active_heads_ratio", self.active_heads_ratio if self.active_heads is None else 0.0)
        check_aux_loss_coef(self.moh_aux_loss_coef)
        from ..hub.conversion_cards import hub_id

        if self.base_model is not None and not hub_id(self.base_model, single=True):
            raise ConversionError(
                "--base_model must be a Hugging Face Hub model id (NAME or ORG/NAME), not a local path: "
                f"{self.base_model!r}"
            )
        if self.head_budget not in HEAD_BUDGETS:
            raise ConversionError(f"--head_budget must be one of {', '.join(HEAD_BUDGETS)}, got {self.head_budget!r}")
        if self.speed is not None and not isinstance(self.speed, SpeedSettings):
            raise TypeError(f"speed must be a SpeedSettings or None, not {type(self.speed).__name__}")

    def with_recipe(self) -> ConvertOptions:
        """These options with `recipe` a `HeadRecipe` (a name looked up: `head_recipe`, which refuses unknown ones)."""
        if isinstance(self.recipe, HeadRecipe):
            return self
        return dataclasses.replace(self, recipe=head_recipe(self.recipe))


__all__ = ["SPEED_NEW_TOKENS", "SPEED_ROUNDS", "SPEED_TOKENS", "ConvertOptions", "SpeedSettings"]
