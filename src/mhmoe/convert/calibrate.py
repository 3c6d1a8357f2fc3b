"""Calibrated conversion: measure each head on calibration text, choose the shared heads and the routed-head score.

`HeadRecipe` says how heads are chosen (the default, "auto", is "calibrated" when the source has a tokenizer, else
"paper"): `shared_heads` "first" (the paper: the first S heads of every layer) or
"importance" (the S heads that contribute most on calibration text, moved first by a GQA-respecting permutation:
heads.py), and the router's score: "l2" (the paper's), "l2_standardized" (each head's query norm minus its calibration
mean, over its calibration std) or "l2_relative" (query norm over its calibration mean). `RECIPES` names the presets;
"paper" is exactly the paper's and needs no calibration.

`measure_heads(source_dir, text)` runs the dense source over the calibration text once and returns, per layer and
head, the mean norm of the head's contribution to the attention output (its o_proj columns times its attention output:
the importance) and the mean and std of its pre-RoPE query norm (the calibrated routers' statistics).
`choose_heads(plan, recipe, ...)` turns them into per-layer head orders and the config fields, and the record
written to moh_conversion.json. With `head_budget="calibrated"` it also gives each layer its own number of routed
heads active per token (head_budget.py: the same total as the uniform budget, more where restricting the layer's heads
changes the model's predictions more).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field

from .errors import ConversionError
from .head_budget import SENSITIVITY_TOKENS, calibrated_budgets

SHARED_CHOICES = ("first", "importance")
HEAD_BUDGETS = ("uniform", "calibrated")
ROUTER_CHOICES = ("l2", "l2_standardized", "l2_relative")
CALIBRATION_TOKENS = 4096
CALIBRATION_BLOCK = 256


@dataclass(frozen=True)
class HeadRecipe:
    name: str
    shared_heads: str = "first"  # SHARED_CHOICES
    router: str = "l2"  # ROUTER_CHOICES

    @property
    def needs_calibration(self) -> bool:
        return self.shared_heads != "first" or self.router != "l2"


RECIPES = {
    "paper": HeadRecipe("paper", "first", "l2"),
    # measured best on SmolLM2-135M (benchmarks/results/moh_convert_real.md): ×1.38 the parent's perplexity zero-shot
    # at 7/9 heads, against ×4.69 for "paper"; l2_standardized was ×1.40
    "calibrated": HeadRecipe("calibrated", "importance", "l2_relative"),
}
# "auto": "calibrated" when the source has a tokenizer (calibration needs one), else "paper"
DEFAULT_RECIPE = "auto"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def head_recipe(name: str = DEFAULT_RECIPE, shared_heads: str | None = None, router: str | None = None) -> HeadRecipe:
    """A preset (`RECIPES`), with its shared-head choice or router replaced when given; refuses unknown names."""
    if name not in RECIPES and name != "auto":
        raise ConversionError(f"--recipe must be one of auto, {', '.join(RECIPES)}, got {name!r}")
    if name == "auto":
        if shared_heads is not None or router is not None:
            raise ConversionError(
                "--shared_heads_by and --moh_router change a named recipe: give --recipe paper or "
                "--recipe calibrated with them"
            )
        return HeadRecipe("auto", "auto", "auto")
    if shared_heads is not None and shared_heads not in SHARED_CHOICES:
        raise ConversionError(f"--shared_heads_by must be one of {', '.join(SHARED_CHOICES)}, got {shared_heads!r}")
    if router is not None and router not in ROUTER_CHOICES:
        raise ConversionError(f"--moh_router must be one of {', '.join(ROUTER_CHOICES)}, got {router!r}")
    base = RECIPES[name]
    recipe = HeadRecipe(name, shared_heads or base.shared_heads, router or base.router)
    if recipe != base:
        recipe = HeadRecipe(
            f"{name} (shared heads {recipe.shared_heads}, router {recipe.router})", recipe.shared_heads, recipe.router
        )
    return recipe


def default_calibration_text(max_chars: int = 40_000) -> str:
    """Python's own documentation (`pydoc_data.topics`, always installed), the first topics in sorted order."""
    from pydoc_data.topics import topics

    parts, size = [], 0
    for key in sorted(topics):
        parts.append(topics[key])
        size += len(topics[key])
        if size >= max_chars:
            break
    return "\n\n".join(parts)[:max_chars]


def read_calibration(path: str | None) -> tuple[str, str]:
    """(text, label) of --calibration_file: plain text, or JSONL whose lines are strings or objects with a "text"
    field. None: the default text."""
    if path is None:
        return default_calibration_text(), "pydoc_data.topics (default)"
    try:
        with open(path, encoding="utf-8") as f:
            raw = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConversionError(f"--calibration_file {path}: {getattr(e, 'strerror', None) or e}") from None
    if path.endswith((".jsonl", ".json")):
        texts = []
        for number, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ConversionError(f"--calibration_file {path} line {number} is not JSON") from None
            text = row if isinstance(row, str) else row.get("text") if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise ConversionError(f'--calibration_file {path} line {number}: no "text" string')
            texts.append(text)
        raw = "\n\n".join(texts)
    if not raw.strip():
        raise ConversionError(f"--calibration_file {path} holds no text")
    return raw, os.path.basename(path)


def calibration_blocks(tokenizer, text: str, tokens: int, block: int):
    """(N, block) token ids: the first `tokens` tokens of `text` cut into blocks (at least one, shorter if short)."""
    import torch

    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"][:tokens]
    if len(ids) < 2:
        raise ConversionError("the calibration text has fewer than 2 tokens")
    block = min(block, len(ids))
    rows = max(1, len(ids) // block)
    return torch.tensor(ids[: rows * block]).view(rows, block)


@dataclass
class HeadStats:
    importance: list[list[float]]  # (layers, heads): mean ‖W_o[:, h] · attn_h‖ over calibration tokens
    norm_mean: list[list[float]]  # (layers, heads): mean pre-RoPE query norm
    norm_std: list[list[float]]  # (layers, heads): its std
    tokens: int


def measure_heads(model, blocks, progress: bool = False) -> HeadStats:
    """One pass of the dense `model` (Llama-style attention) over `blocks` (N, T), hooks on q_proj and o_proj."""
    import torch
    from tqdm.auto import tqdm

    config = model.config
    heads, head_dim = config.num_attention_heads, getattr(config, "head_dim", None)
    head_dim = head_dim or config.hidden_size // heads
    layers = model.model.layers
    sums = {i: torch.zeros(3, heads, dtype=torch.float64) for i in range(len(layers))}  # Σ contribution, Σn, Σn²
    hooks = []

    def on_query(i):
        def hook(module, args, output):
            norms = output.detach().float().view(*output.shape[:-1], heads, head_dim).norm(dim=-1)  # (B, T, H)
            sums[i][1] += norms.sum(dim=(0, 1)).double()
            sums[i][2] += norms.pow(2).sum(dim=(0, 1)).double()

        return hook

    grams = {}

    def on_output(i):
        def hook(module, args):
            x = args[0].detach().float().view(-1, heads, head_dim).transpose(0, 1)  # (H, B·T, hd)
            if i not in grams:  # ‖W_h a‖² = aᵀ (W_hᵀ W_h) a: an (H, hd, hd) Gram matrix instead of (B·T, H, d) outputs
                w = module.weight.detach().float().view(-1, heads, head_dim).transpose(0, 1)  # (H, d, hd)
                grams[i] = w.transpose(1, 2) @ w
            squared = (torch.bmm(x, grams[i]) * x).sum(-1).clamp_min(0)  # (H, B·T)
            sums[i][0] += squared.sqrt().sum(dim=1).double()

        return hook

    for i, layer in enumerate(layers):
        hooks.append(layer.self_attn.q_proj.register_forward_hook(on_query(i)))
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(on_output(i)))
    try:
        with torch.no_grad():
            for start in tqdm(
                range(0, len(blocks), 4),
                desc="calibrating heads",
                unit="batch",
                disable=not progress,
                dynamic_ncols=True,
            ):
                model(blocks[start : start + 4].to(model.device))
    finally:
        for hook in hooks:
            hook.remove()
    n = blocks.numel()
    importance, mean, std = [], [], []
    for i in range(len(layers)):
        s = sums[i] / n
        importance.append(s[0].tolist())
        mean.append(s[1].tolist())
        std.append((s[2] - s[1] ** 2).clamp_min(1e-12).sqrt().tolist())
    return HeadStats(importance, mean, std, n)


@dataclass
class HeadChoices:
    """What the calibration chose: per-layer head orders (None: unchanged) and the record for moh_conversion.json."""

    orders: list[list[int]] | None
    record: dict = field(default_factory=dict)


def resolve_auto(plan) -> HeadRecipe:
    """--recipe auto: "calibrated" when the source folder has a tokenizer, else "paper" (with a note on the plan)."""
    if any(os.path.isfile(os.path.join(plan.input_dir, name)) for name in TOKENIZER_FILES):
        return RECIPES["calibrated"]
    plan.notes.append(
        "recipe paper: the source has no tokenizer, which calibration needs (--recipe calibrated with a "
        "tokenizer in --input_dir measures the heads)"
    )
    return RECIPES["paper"]


def _load_source(source_dir: str, trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    from .._plumbing.trust import load_tokenizer

    try:
        tokenizer = load_tokenizer(
            source_dir,
            ConversionError,
            trust_remote_code,
            what="tokenizer (calibration needs it; --recipe paper does not)",
        )
    except (OSError, ValueError, TypeError, KeyError) as e:
        if isinstance(e, ConversionError):
            raise
        raise ConversionError(f"calibration needs the source's tokenizer in {source_dir}: {type(e).__name__}") from None
    # the checkpoint dtype; a LLaMA-family model: Transformers' own classes, never the folder's code
    model = AutoModelForCausalLM.from_pretrained(source_dir, dtype="auto", trust_remote_code=False).eval()
    return model, tokenizer


def choose_heads(
    plan,
    recipe: HeadRecipe,
    calibration_file: str | None = None,
    calibration_tokens: int = CALIBRATION_TOKENS,
    trust_remote_code: bool = False,
    progress: bool = False,
    head_budget: str = "uniform",
) -> HeadChoices:
    """Measure the source of `plan` on calibration text (unless the recipe and the head budget need none), choose
    every layer's shared heads and set the recipe's router (and its statistics, in the permuted head order) on
    `plan.config`; `head_budget="calibrated"` sets `moh_active_heads_per_layer` (head_budget.py: measured on the
    first `SENSITIVITY_TOKENS` calibration tokens)."""
    from .heads import head_order, permute_rows

    if head_budget not in HEAD_BUDGETS:
        raise ConversionError(f"--head_budget must be one of {', '.join(HEAD_BUDGETS)}, got {head_budget!r}")
    config = plan.config
    if recipe.name == "auto":
        recipe = resolve_auto(plan)
    record = {"recipe": asdict(recipe), "head_budget": {"kind": head_budget}}
    if not recipe.needs_calibration and head_budget == "uniform":
        return HeadChoices(None, record)
    if calibration_tokens < 2:
        raise ConversionError(f"--calibration_tokens must be >= 2, got {calibration_tokens}")
    text, label = read_calibration(calibration_file)
    model, tokenizer = _load_source(plan.input_dir, trust_remote_code)
    blocks = calibration_blocks(tokenizer, text, calibration_tokens, CALIBRATION_BLOCK)
    if int(blocks.max()) >= config.vocab_size:
        raise ConversionError("the source's tokenizer gives token ids beyond the model's vocabulary")
    stats = measure_heads(model, blocks, progress)
    shared, kv = config.moh_shared_heads, config.num_key_value_heads
    heads = config.num_attention_heads
    if recipe.shared_heads == "importance":
        orders = [head_order(row, shared, kv) for row in stats.importance]
    else:
        orders = [list(range(heads)) for _ in stats.importance]
    config.moh_router = recipe.router
    if recipe.router != "l2":
        config.moh_head_norm_mean = [[round(v, 6) for v in row] for row in permute_rows(stats.norm_mean, orders)]
        config.moh_head_norm_std = [
            [round(max(v, 1e-6), 6) for v in row] for row in permute_rows(stats.norm_std, orders)
        ]
    if head_budget == "calibrated":
        sensitivity = blocks[: max(1, SENSITIVITY_TOKENS // blocks.shape[1])]  # (N, T): the first blocks
        budgets, delta = calibrated_budgets(model, config, orders, sensitivity, progress)
        config.moh_active_heads_per_layer = budgets
        record["head_budget"].update(
            routed_active_heads_per_layer=budgets,
            sensitivity="mean KL(source || model) of the next-token distributions with only layer l at K routed "
            "heads active, K = 1..R; the budgets minimise its sum over the layers at the uniform total",
            sensitivity_tokens=sensitivity.numel(),
            kl=[[round(v, 6) for v in row] for row in delta],
        )
    del model
    record["calibration"] = {
        "source": label,
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
        "tokens": stats.tokens,
        "block_size": int(blocks.shape[1]),
        "importance": "mean norm of each head's o_proj contribution",
    }
    record["layers"] = [
        {
            "head_order": order,
            "shared_source_heads": sorted(order[:shared]),
            "importance": [round(v, 5) for v in stats.importance[i]],
        }
        for i, order in enumerate(orders)
    ]
    identity = all(order == list(range(heads)) for order in orders)
    return HeadChoices(None if identity else orders, record)


__all__ = [
    "CALIBRATION_TOKENS",
    "DEFAULT_RECIPE",
    "HEAD_BUDGETS",
    "RECIPES",
    "ROUTER_CHOICES",
    "SHARED_CHOICES",
    "HeadChoices",
    "HeadRecipe",
    "HeadStats",
    "calibration_blocks",
    "choose_heads",
    "default_calibration_text",
    "head_recipe",
    "measure_heads",
    "read_calibration",
]
