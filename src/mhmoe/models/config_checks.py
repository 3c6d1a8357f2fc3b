"""What mhmoe's configs check beyond Transformers' own: overrides of `from_pretrained` checked together with the
file's fields (MHMoEConfig and MoHLlamaConfig), misnamed and misspelt keyword arguments, RoPE and the special token
ids (which Transformers only warns about, or refuses with a KeyError), the MHMoE decoder's own fields, and one
`ValueError` listing every problem.
"""

import dataclasses
import difflib
import math

from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig

# names other MoE configs use for our fields: refused instead of silently dropped (`top_k` also breaks save_pretrained)
MISNAMED_FIELDS = {
    "top_k": "num_experts_per_tok",
    "router_top_k": "num_experts_per_tok",
    "num_local_experts": "num_experts",
}


class CheckedOverrides:
    """`from_pretrained(d, field=value)`: Transformers builds the config from the file and then sets the overrides
    unchecked. Here overrides of config fields join the file's fields first, so the checks see the final config (and
    an override can repair a combination the file would not allow on its own)."""

    _SET_BY_TRANSFORMERS = {
        "dtype",
        "torch_dtype",
        "attn_implementation",
        "experts_implementation",
        "name_or_path",
        "output_attentions",
        "num_labels",
    }

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        fields = {field.name for field in dataclasses.fields(cls)} - cls._SET_BY_TRANSFORMERS
        config_dict = {**config_dict, **{name: kwargs.pop(name) for name in list(kwargs) if name in fields}}
        return super().from_dict(config_dict, **kwargs)


def check_keyword_arguments(config_class: type, kwargs: dict) -> None:
    """Refuse the names other MoE configs give our fields (`MISNAMED_FIELDS`) and unknown keyword arguments that look
    like a misspelt field (`num_expert` for `num_experts`): a config keeps unknown arguments as attributes, so the
    field would silently keep its default. Other unknown names stay attributes, as in Transformers."""
    fields = [field.name for field in dataclasses.fields(config_class)]
    wrong = []
    for name in kwargs:
        close = difflib.get_close_matches(name, fields, n=1, cutoff=0.85)
        if name in MISNAMED_FIELDS:
            wrong.append(f"{name} (use {MISNAMED_FIELDS[name]})")
        elif close and not hasattr(PreTrainedConfig, name):
            wrong.append(f"{name!r} (did you mean {close[0]!r}?)")
    if wrong:
        raise ValueError(
            f"Invalid {config_class.__name__}: unknown argument(s) {', '.join(wrong)}; fix the name (a config keeps an "
            "unknown argument as an attribute, and the field keeps its default)."
        )


def rope_problems(config) -> list[str]:
    """`rope_parameters` (or the legacy `rope_scaling` / `rope_theta`, merged into it by Transformers), in words: a
    rope_type the rotary embedding knows, the keys that type needs, finite values with factors, betas, rope_theta and
    original_max_position_embeddings > 0, and frequencies and an attention scaling that come out finite (at the model's
    length and, for the dynamic type, past it). Transformers only warns about most of these (a factor of 0 or -2 trains
    to NaN), and raises a KeyError for a missing key."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = getattr(config, "rope_parameters", None)
    if not parameters:
        return []
    if not isinstance(parameters, dict):
        return [f"rope_parameters must be a dict with rope_type and rope_theta, got {parameters!r}"]
    known = ("default", *ROPE_INIT_FUNCTIONS)
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type not in known:
        return [f"rope_parameters' rope_type must be one of {known}, got {rope_type!r}"]
    problems = _rope_value_problems(parameters)
    validate = getattr(config, f"_validate_{rope_type}_rope_parameters", None)
    try:  # Transformers' own check of the type's keys and values, its exceptions as problems
        if validate is not None:
            validate(dict(parameters), ignore_keys=getattr(config, "ignore_keys_at_rope_validation", None))
    except (KeyError, TypeError, ValueError, ArithmeticError) as e:
        problems.append(str(e.args[0] if e.args else e))
    return problems or _rope_frequency_problems(config, rope_type)


# rope_parameters' fields that must be > 0 (a factor or beta of 0 divides by zero or gives NaN frequencies); mscale and
# mscale_all_dim may be 0 (Transformers reads <= 0 as 1)
_POSITIVE_ROPE_FIELDS = ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings")
_MAX_ATTENTION_SCALING = (
    100.0  # yarn's own is 0.1 ln(factor) + 1 (2.4 at a factor of a million); beyond, scores overflow
)


def _rope_value_problems(parameters: dict) -> list[str]:
    problems = []
    for name, value in parameters.items():
        if name == "rope_theta":
            continue  # below, with its own words
        values = value if isinstance(value, (list, tuple)) else [value]
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if name in _POSITIVE_ROPE_FIELDS or name.endswith("_factor"):
            rule, allowed = "finite numbers > 0", lambda v: math.isfinite(v) and v > 0
        elif name.startswith("mscale"):
            rule, allowed = "finite numbers >= 0", lambda v: math.isfinite(v) and v >= 0
        else:
            rule, allowed = "finite numbers", math.isfinite
        wrong = [v for v in numbers if not allowed(v)]
        if wrong:
            shown = value if len(values) == 1 else f"a list holding {wrong[0]}"
            problems.append(f"rope_parameters' {name} must be {rule}, got {shown}")
    theta = parameters.get("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (math.isfinite(theta) and theta > 0):
        problems.append(f"rope_theta (rope_parameters' base wavelength) must be a finite number > 0, got {theta!r}")
    return problems


def _rope_frequency_problems(config, rope_type: str) -> list[str]:
    """Compute the type's frequencies and attention scaling as the rotary embedding will (the dynamic type also at
    twice the model's length, where it rescales); anything not finite, or a failure, is a problem."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type == "default":
        return []
    compute = ROPE_INIT_FUNCTIONS[rope_type]
    try:
        with torch.device("cpu"):  # real numbers also when the config is built under a meta device (empty weights)
            results = [compute(config, "cpu")]
            if rope_type == "dynamic":
                results.append(compute(config, "cpu", seq_len=2 * config.max_position_embeddings))
    except (ArithmeticError, ValueError, TypeError, KeyError) as e:
        return [f"rope_parameters {config.rope_parameters} give no rotary frequencies ({type(e).__name__}: {e})"]
    for inv_freq, scaling in results:
        angles = inv_freq.float() * config.max_position_embeddings
        if not (torch.isfinite(angles).all() and math.isfinite(scaling) and 0 < scaling <= _MAX_ATTENTION_SCALING):
            return [
                f"rope_parameters {config.rope_parameters} give non-finite rotary frequencies or an attention scaling "
                f"outside (0, {_MAX_ATTENTION_SCALING:g}] ({scaling}): the model would compute NaN"
            ]
    return []


def token_id_problems(config) -> list[str]:
    """`bos_token_id` / `eos_token_id` (an id or a list of ids) inside the vocabulary: Transformers only warns, and an
    id past the embedding fails in generation or indexes the wrong row. (`pad_token_id`: `decoder_problems`.)"""
    problems = []
    for name in ("bos_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        ids = value if isinstance(value, (list, tuple)) else [] if value is None else [value]
        outside = [i for i in ids if isinstance(i, int) and not 0 <= i < config.vocab_size]
        if outside:
            shown = value if isinstance(value, (list, tuple)) else outside[0]
            problems.append(
                f"{name} ({shown}) must lie in the vocabulary: 0 to {config.vocab_size - 1} (vocab_size "
                f"{config.vocab_size}), or be None"
            )
    return problems


def size_problems(config) -> list[str]:
    """The decoder's sizes that must be >= 1, in words (the other checks divide by them)."""
    sizes = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
    )
    # head_dim stays None when num_attention_heads < 1 (reported as such)
    values = {name: getattr(config, name) for name in sizes if getattr(config, name) is not None}
    heads, hidden = values.get("num_attention_heads", 0), values.get("hidden_size", 0)
    problems = []
    for name, value in values.items():
        if value >= 1:
            continue
        if name == "head_dim" and heads > hidden >= 1:  # head_dim = hidden_size // num_attention_heads = 0
            problems.append(
                f"num_attention_heads ({heads}) must be <= hidden_size ({hidden}) (each head gets hidden_size // "
                "num_attention_heads channels), or set head_dim explicitly"
            )
        else:
            problems.append(f"{name} must be >= 1, got {value}")
    return problems


def decoder_problems(config) -> list[str]:
    """An MHMoE decoder's own fields (attention, the dense MLP, norms), in words; its sizes are >= 1."""
    problems = []
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    if heads % kv_heads:
        problems.append(
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads}) for "
            "grouped-query attention"
        )
    if hidden % heads and config.head_dim == hidden // heads:  # an explicit other head_dim is allowed (Mistral, Qwen3)
        problems.append(
            f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}); choose "
            "num_attention_heads among the divisors of hidden_size, or set head_dim explicitly"
        )
    if config.head_dim % 2:
        problems.append(f"head_dim ({config.head_dim}) must be even for rotary embeddings")
    step, layers = config.decoder_sparse_step, config.num_hidden_layers
    if step < 0:
        problems.append(f"decoder_sparse_step must be >= 0 (0 = dense model), got {step}")
    elif step > layers:
        problems.append(
            f"decoder_sparse_step ({step}) is larger than num_hidden_layers ({layers}), so no layer would "
            "be MoE; use 0 for a dense model"
        )
    if config.intermediate_size < 1 and not all(map(config.is_moe_layer, range(layers))):
        problems.append(f"intermediate_size (the dense layers' MLP width) must be >= 1, got {config.intermediate_size}")
    if config.hidden_act not in ACT2FN:
        problems.append(f"hidden_act {config.hidden_act!r} is not one of Transformers' activations (e.g. 'silu')")
    if config.pad_token_id is not None and not -config.vocab_size <= config.pad_token_id < config.vocab_size:
        problems.append(
            f"pad_token_id ({config.pad_token_id}) must lie in the vocabulary (vocab_size {config.vocab_size})"
        )
    if not (config.rms_norm_eps > 0 and math.isfinite(config.rms_norm_eps)):
        problems.append(f"rms_norm_eps must be a finite number > 0, got {config.rms_norm_eps}")
    for name in ("initializer_range", "attention_dropout"):
        if not (getattr(config, name) >= 0 and math.isfinite(getattr(config, name))):
            problems.append(f"{name} must be a finite number >= 0, got {getattr(config, name)}")
    if config.attention_dropout > 1:
        problems.append(f"attention_dropout is a probability, got {config.attention_dropout}")
    if config.sliding_window is not None and config.sliding_window < 1:
        problems.append(f"sliding_window must be a positive number of tokens or None, got {config.sliding_window}")
    return problems


def raise_problems(config, problems: list[str]) -> None:
    """One `ValueError` naming the config class and every problem; nothing when there is none."""
    if problems:
        raise ValueError(f"Invalid {type(config).__name__}: " + "; ".join(problems) + ".")


__all__ = [
    "MISNAMED_FIELDS",
    "CheckedOverrides",
    "check_keyword_arguments",
    "decoder_problems",
    "raise_problems",
    "rope_problems",
    "size_problems",
    "token_id_problems",
]
