"""`apply_moh`: turn an in-memory Llama, Mistral or Qwen2 model into Mixture-of-Head attention, in place.

The attention modules keep their q/k/v/o projections (and hooks) and gain a head router; the model classes are
swapped for MoH subclasses so that the forward returns `moh_aux_loss` and the head-router logits. A Llama model becomes
a `MoHLlamaForCausalLM` / `MoHLlamaModel` with a `MoHLlamaConfig` (saves and reloads as model_type "moh_llama"). A
Mistral or Qwen2 model keeps its model_type: its config gains the moh_* fields (saved in config.json), and after
reloading it `apply_moh(model)` with no fields restores MoH from them.
"""

import json
import os
from types import SimpleNamespace

from safetensors import safe_open
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from transformers.models.mistral.modeling_mistral import MistralAttention, MistralForCausalLM, MistralModel
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2ForCausalLM, Qwen2Model
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
from transformers.utils.output_capturing import (
    _CAN_RECORD_REGISTRY,
    OutputRecorder,
    install_output_capuring_hook,
)

from ..causal_lm import causal_lm_forward
from ..moh.head_routers import MoHRouter
from ..moh.moh_attention import MoHAttentionMixin, add_head_router
from ..moh.moh_config import MOH_FIELDS, moh_config_problems
from .configuration_moh_llama import MoHLlamaConfig
from .modeling_moh_llama import MoHLlamaAttention, MoHLlamaForCausalLM, MoHLlamaModel

_MOH_KEY = "moh_router_logits"
_RECORDER = OutputRecorder(MoHRouter, index=1)
# base model class -> (attention class, MoH classes for attention / base model / causal LM); Mistral and Qwen2 classes
# are made on first use
_FAMILIES = {
    LlamaModel: (LlamaAttention, LlamaForCausalLM),
    MistralModel: (MistralAttention, MistralForCausalLM),
    Qwen2Model: (Qwen2Attention, Qwen2ForCausalLM),
}
_MOH_CLASSES = {LlamaModel: (MoHLlamaAttention, MoHLlamaModel, MoHLlamaForCausalLM)}


def _moh_classes(base_cls):
    if base_cls not in _MOH_CLASSES:
        attention_cls, causal_lm_cls = _FAMILIES[base_cls]
        name = base_cls.__name__.removesuffix("Model")
        attention = type(f"MoH{attention_cls.__name__}", (MoHAttentionMixin, attention_cls), {})
        records = {**base_cls._can_record_outputs, _MOH_KEY: _RECORDER}
        model = type(f"MoH{base_cls.__name__}", (base_cls,), {"_can_record_outputs": records})
        causal_lm = type(f"MoH{name}ForCausalLM", (causal_lm_cls,), {"forward": causal_lm_forward})
        _MOH_CLASSES[base_cls] = (attention, model, causal_lm)
    return _MOH_CLASSES[base_cls]


def _check_types(fields: dict) -> None:
    """The types the checks compare (a config's strict fields check them; here the fields are plain arguments)."""
    wanted = {"moh_shared_heads": "a whole number of heads", "moh_active_heads": "a whole number of heads"}
    for name, words in wanted.items():
        value = fields[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"apply_moh: {name} must be {words}, not {type(value).__name__} ({value!r})")
    value = fields["moh_aux_loss_coef"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"apply_moh: moh_aux_loss_coef must be a number, not {type(value).__name__} ({value!r})")


def apply_moh(model, **moh_fields):
    """Make `model` (a Llama/Mistral/Qwen2 `...ForCausalLM` or base `...Model`) Mixture-of-Head attention in place and
    return it.

    `moh_fields`: `moh_shared_heads`, `moh_active_heads` (required unless already in the model's config),
    `moh_active_heads_per_layer` (optional per-layer routed budgets; None: `moh_active_heads` in every layer),
    `moh_head_thresholds` (optional per-layer score thresholds instead of the top-K: `head_routers.py`),
    `moh_router` ("l2" by default: parameter-free, so the state dict is unchanged; "learned": zero-initialised
    two-stage router), `moh_straight_through` (True by default), `moh_aux_loss_coef` (0.01). The defaults are the
    paper's continue-tuning recipe. The first `moh_shared_heads` heads of every layer are shared.
    """
    unknown = set(moh_fields) - set(MOH_FIELDS)
    if unknown:
        raise TypeError(f"apply_moh got unknown fields {sorted(unknown)}; expected some of {sorted(MOH_FIELDS)}")
    base = getattr(model, "model", model)
    family = next((cls for cls in _FAMILIES if type(base) is cls), None)
    if family is None:
        kind = type(base).__name__
        if any(isinstance(base, cls) for cls in _FAMILIES):
            raise ValueError(f"{kind} is already a Mixture-of-Head attention model")
        raise ValueError(f"apply_moh supports Llama, Mistral and Qwen2 models, got {kind}")
    if model is not base and type(model) is not _FAMILIES[family][1]:
        expected = _FAMILIES[family][1].__name__
        raise ValueError(f"apply_moh supports {expected} around {family.__name__}, got {type(model).__name__}")

    if any(type(layer.self_attn.q_proj.weight).__name__ == "DTensor" for layer in base.layers):
        raise ValueError(
            "apply_moh cannot patch a tensor-parallel (sharded) model: its head router would see only this rank's "
            "heads. For tensor parallelism use a MoH-LLaMA (model_type moh_llama) or MHMoE checkpoint, whose plans "
            "shard the head router; MoH Mistral / Qwen2 models run unsharded"
        )
    config = base.config
    fields = {name: moh_fields.get(name, getattr(config, name, default)) for name, default in MOH_FIELDS.items()}
    if fields["moh_shared_heads"] is None and fields["moh_active_heads"] is None:
        raise ValueError("apply_moh needs moh_shared_heads and moh_active_heads")
    _check_types(fields)
    sizes = {"num_attention_heads": config.num_attention_heads, "num_hidden_layers": config.num_hidden_layers}
    problems = moh_config_problems(SimpleNamespace(**sizes, **fields))
    if problems:
        raise ValueError("Invalid MoH fields: " + "; ".join(problems) + ".")

    for cfg in {id(c): c for c in (config, model.config)}.values():
        if family is LlamaModel:
            cfg.__class__ = MoHLlamaConfig  # the same object: every module keeps seeing it
        for name, value in fields.items():
            setattr(cfg, name, value)
        if not hasattr(cfg, "output_router_logits"):
            cfg.output_router_logits = False

    attention_cls, model_cls, causal_lm_cls = _moh_classes(family)
    hooks_installed = getattr(base, "_output_capturing_hooks_installed", False)
    for layer in base.layers:
        attention = layer.self_attn
        attention.__class__ = attention_cls
        add_head_router(attention, config)
        if hooks_installed and attention.head_router is not None:  # hooks were installed before the router existed
            install_output_capuring_hook(attention.head_router, _MOH_KEY, _RECORDER.index)
    base.__class__ = model_cls
    _CAN_RECORD_REGISTRY[base] = model_cls._can_record_outputs
    if model is not base:
        model.__class__ = causal_lm_cls
        _CAN_RECORD_REGISTRY[model] = causal_lm_cls._can_record_outputs
    if not moh_fields and fields["moh_router"] == "learned":
        _restore_saved_routers(model)
    return model


def _restore_saved_routers(model) -> None:
    """`apply_moh(model)` on a Mistral/Qwen2 model reloaded from a folder saved after `apply_moh` with the learned
    router: Transformers dropped the router weights as unexpected keys when loading; read them back from the folder
    (`config._name_or_path`). Nothing happens when the folder is not a local safetensors checkpoint."""
    folder = getattr(model.config, "_name_or_path", "")
    if not folder or not os.path.isdir(folder):
        return
    wanted = {key for key in model.state_dict() if ".head_router." in key}
    routers = {}
    for path in _safetensors_files(folder):
        with safe_open(path, framework="pt") as weights:
            for key in weights.keys():
                name = key if key in wanted else key.removeprefix("model.")  # a base model loaded from a causal LM
                if ".head_router." in key and name in wanted:
                    routers[name] = weights.get_tensor(key)
    if routers:
        model.load_state_dict(routers, strict=False)


def _safetensors_files(folder: str) -> list[str]:
    """The safetensors files of a checkpoint folder: the shards its index names (plain file names only), else
    model.safetensors; [] when it has none or the index is unreadable."""
    index = os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME)
    try:
        with open(index) as f:
            names = set(json.load(f)["weight_map"].values())
    except FileNotFoundError:
        names = {SAFE_WEIGHTS_NAME}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    names = [name for name in sorted(names) if isinstance(name, str) and os.path.basename(name) == name]
    return [os.path.join(folder, name) for name in names if os.path.isfile(os.path.join(folder, name))]


__all__ = ["apply_moh"]
