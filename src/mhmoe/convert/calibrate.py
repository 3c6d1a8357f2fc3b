"""Calibrated conversion: measure each head on calibration text, choose the shared heads and the routed-head score.

`HeadRecipe` says how heads are chosen (the default, "auto", is "fitted" when the source has a tokenizer, else
"paper"): `shared_heads` "first" (the paper: the first S heads of every layer) or
"importance" (the S heads that contribute most on calibration text, moved first by a GQA-respecting permutation:
heads.py), and the router's score: "l2" (the paper's), "l2_standardized" (each head's query norm minus its calibration
mean, over its calibration std), "l2_relative" (query norm over its calibration mean) or "fitted" (the paper's learned
router, `moh_router="learned"` with straight-through 0/1 gates, its W_r fitted instead of trained: per layer a ridge
regression of the log of each head's o_proj contribution norm on the attention's input, λ = `FIT_RIDGE` × the mean of
diag(XᵀX), a fixed choice, not tuned). `RECIPES` names the presets; "paper" is exactly the paper's and needs no
calibration; "fitted" (importance + fitted) was best on SmolLM2-135M (benchmarks/results/moh_head_budgets.md).

`measure_heads(source_dir, text)` runs the dense source over the calibration text once and returns, per layer and
head, the mean norm of the head's contribution to the attention output (its o_proj columns times its attention output:
the importance) and the mean and std of its pre-RoPE query norm (the calibrated routers' statistics); with
`fit_router` the same pass accumulates XᵀX and XᵀY in float64 and fits the "fitted" router (`RouterFit`).
`choose_heads(plan, recipe, ...)` turns them into per-layer head orders and the config fields, and the record
written to moh_conversion.json. It reads only the text's first tokens: `split_tokens` holds the tokens after them out
for the conversion's held-out perplexity (heldout.py). With `head_budget="calibrated"` it also gives each layer its own number of routed
heads active per token (head_budget.py: the same total as the uniform budget, more where restricting the layer's heads
changes the model's predictions more); with `head_budget="threshold"` those budgets become each layer's average and a
per-layer score threshold decides, per token, how many heads it takes.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field

from .errors import ConversionError
from .head_budget import SENSITIVITY_TOKENS, calibrated_budgets, calibrated_thresholds
from .routers import FIT_LOG_FLOOR, FIT_RIDGE, ROUTER_PREFIX, ROUTERS, SHARED_HEADS

SHARED_CHOICES = tuple(SHARED_HEADS)  # routers.py: "first", "importance"
ROUTER_CHOICES = tuple(ROUTERS)  # routers.py: "l2", "l2_standardized", "l2_relative", "fitted"
CALIBRATION_TOKENS = 4096
CALIBRATION_BLOCK = 256
HELDOUT_TOKENS = 4096  # the most tokens of the calibration text held out for the card's perplexity ratio


@dataclass(frozen=True)
class HeadRecipe:
    name: str
    shared_heads: str = "first"  # SHARED_CHOICES
    router: str = "l2"  # ROUTER_CHOICES

    @property
    def needs_calibration(self) -> bool:
        """Whether its shared-head choice or its router reads calibration measurements (an unknown one: yes)."""
        shared, router = SHARED_HEADS.get(self.shared_heads), ROUTERS.get(self.router)
        return shared is None or shared.calibrated or router is None or router.calibrated


RECIPES = {
    "paper": HeadRecipe("paper", "first", "l2"),
    # on SmolLM2-135M (benchmarks/results/moh_convert_real.md): ×1.38 the parent's perplexity zero-shot at 7/9
    # heads, against ×4.69 for "paper"; l2_standardized was ×1.40
    "calibrated": HeadRecipe("calibrated", "importance", "l2_relative"),
    # the paper's learned router with W_r fitted on the calibration text instead of trained; measured best on
    # SmolLM2-135M through mhmoe-convert (benchmarks/results/moh_head_budgets.md): ×1.171 / ×2.002 the parent at 7/9 /
    # 5/9 heads (uniform budgets), ×1.062 / ×1.835 with --head_budget calibrated, 18% / 55% below static pruning
    "fitted": HeadRecipe("fitted", "importance", "fitted"),
}
# "auto": "fitted" when the source has a tokenizer (calibration needs one), else "paper"
DEFAULT_RECIPE = "auto"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def head_recipe(name: str = DEFAULT_RECIPE, shared_heads: str | None = None, router: str | None = None) -> HeadRecipe:
    """A preset (`RECIPES`), with its shared-head choice or router replaced when given; refuses unknown names."""
    if name not in RECIPES and name != "auto":
        raise ConversionError(f"--recipe must be one of auto, {', '.join(RECIPES)}, got {name!r}")
    if name == "auto":
        if shared_heads is not None or router is not None:
            raise ConversionError(
                "--shared_heads_by and --moh_router change a named recipe: give --recipe paper, "
                "--recipe calibrated or --recipe fitted with them"
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


def text_ids(tokenizer, text: str) -> list[int]:
    """The token ids of `text`, without special tokens: what calibration and the held-out perplexity read."""
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def split_tokens(total: int, calibration_tokens: int) -> tuple[int, int]:
    """(C, H): of a calibration text of `total` tokens, calibration reads the first C, and the next H are held out
    (never calibrated on; the card's held-out perplexity reads them). H is up to `HELDOUT_TOKENS`: what the text has
    after the `calibration_tokens`, and at least a quarter of a short text (C is then reduced)."""
    reserved = min(HELDOUT_TOKENS, total // 4)
    calibration = min(calibration_tokens, total - reserved)
    return calibration, min(HELDOUT_TOKENS, total - calibration)


def token_blocks(ids: list[int], block: int):
    """(N, block) token ids: `ids` cut into blocks (at least one, shorter if short; a partial last block dropped)."""
    import torch

    if len(ids) < 2:
        raise ConversionError("the calibration text has fewer than 2 tokens")
    block = min(block, len(ids))
    rows = max(1, len(ids) // block)
    return torch.tensor(ids[: rows * block]).view(rows, block)


def calibration_blocks(tokenizer, text: str, tokens: int, block: int):
    """(N, block) token ids: the first `tokens` tokens of `text` cut into blocks (at least one, shorter if short).
    The converter itself holds part of its text out first (`split_tokens`)."""
    return token_blocks(text_ids(tokenizer, text)[:tokens], block)


@dataclass
class RouterFit:
    """The "fitted" router: per layer W (H, d), the ridge regression of y_h = log ‖W_o[:, h] · attn_h‖ (clamped at
    `FIT_LOG_FLOOR`) on the attention's input x (the hidden states after the input layer norm), over the calibration
    tokens: W = solve(XᵀX + λI, XᵀY)ᵀ, λ = `FIT_RIDGE` × mean(diag XᵀX)."""

    weights: list  # (layers,) float32 tensors (H, d), in the source's head order
    ridge: list[float]  # (layers,) λ
    r2: list[float]  # (layers,) the fit's R² on the calibration tokens, averaged over the heads


def fit_routers(gram, cross, y_sum, y_squares, tokens: int, ridge: float = FIT_RIDGE) -> RouterFit:
    """`RouterFit` from the float64 sums per layer: XᵀX (d, d), XᵀY (d, H), Σy (H), Σy² (H) over `tokens` rows."""
    import torch

    weights, lambdas, r2 = [], [], []
    for g, c, s, s2 in zip(gram, cross, y_sum, y_squares, strict=True):
        lam = ridge * g.diagonal().mean()
        w = torch.linalg.solve(g + lam * torch.eye(g.shape[0], dtype=g.dtype), c)  # (d, H)
        residual = s2 - 2 * (w * c).sum(0) + (w * (g @ w)).sum(0)  # Σ (y - xᵀw)² per head
        total = (s2 - s**2 / tokens).clamp_min(1e-12)
        weights.append(w.T.float().contiguous())
        lambdas.append(float(lam))
        r2.append(float((1 - residual / total).mean()))
    return RouterFit(weights, lambdas, r2)


@dataclass
class HeadStats:
    importance: list[list[float]]  # (layers, heads): mean ‖W_o[:, h] · attn_h‖ over calibration tokens
    norm_mean: list[list[float]]  # (layers, heads): mean pre-RoPE query norm
    norm_std: list[list[float]]  # (layers, heads): its std
    tokens: int
    router_fit: RouterFit | None = None  # measure_heads(..., fit_router=True)


def measure_heads(model, blocks, progress: bool = False, fit_router: bool = False) -> HeadStats:
    """One pass of the dense `model` (Llama-style attention) over `blocks` (N, T), hooks on q_proj and o_proj.
    `fit_router`: the same pass also fits the "fitted" router (`RouterFit`; its input x is q_proj's input)."""
    import torch
    from tqdm.auto import tqdm

    config = model.config
    heads, head_dim = config.num_attention_heads, getattr(config, "head_dim", None)
    head_dim = head_dim or config.hidden_size // heads
    layers = model.model.layers
    sums = {i: torch.zeros(3, heads, dtype=torch.float64) for i in range(len(layers))}  # Σ contribution, Σn, Σn²
    d = config.hidden_size
    inputs = {}  # layer -> (B·T, d) float64 attention input of the current batch
    gram = [torch.zeros(d, d, dtype=torch.float64) for _ in layers] if fit_router else None  # XᵀX
    cross = [torch.zeros(d, heads, dtype=torch.float64) for _ in layers] if fit_router else None  # XᵀY
    y_sums = [torch.zeros(2, heads, dtype=torch.float64) for _ in layers] if fit_router else None  # Σy, Σy²
    hooks = []

    def on_query(i):
        def hook(module, args, output):
            norms = output.detach().float().view(*output.shape[:-1], heads, head_dim).norm(dim=-1)  # (B, T, H)
            sums[i][1] += norms.sum(dim=(0, 1)).double()
            sums[i][2] += norms.pow(2).sum(dim=(0, 1)).double()
            if fit_router:
                x = args[0].detach().double().reshape(-1, d)  # (B·T, d)
                inputs[i] = x
                gram[i].addmm_(x.T, x)

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
            if fit_router:
                y = squared.double().sqrt().clamp_min(FIT_LOG_FLOOR).log().T  # (B·T, H)
                cross[i].addmm_(inputs.pop(i).T, y)
                y_sums[i] += torch.stack([y.sum(0), y.pow(2).sum(0)])

        return hook

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
    fit = None
    if fit_router:
        fit = fit_routers(gram, cross, [y[0] for y in y_sums], [y[1] for y in y_sums], n)
    return HeadStats(importance, mean, std, n, fit)


@dataclass
class HeadChoices:
    """What `choose_heads` chose, for the converter to apply: per-layer head orders (None: unchanged), the config
    fields to set (in order: the router's, then the head budget's), the record for moh_conversion.json and the
    tensors the checkpoint gets (name -> tensor: the "fitted" router's weights, planned as zeros by `plan_recipe`)."""

    orders: list[list[int]] | None
    record: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)
    fields: dict = field(default_factory=dict)

    def configured(self, config):
        """A copy of `config` with the chosen fields set."""
        config = copy.deepcopy(config)
        for name, value in self.fields.items():
            setattr(config, name, value)
        return config


def resolve_recipe(recipe: HeadRecipe, input_dir: str) -> tuple[HeadRecipe, str | None]:
    """(the recipe, a note or None): --recipe auto is "fitted" when the source folder has a tokenizer, else "paper"
    (with a note); a named recipe is itself."""
    if recipe.name != "auto":
        return recipe, None
    if any(os.path.isfile(os.path.join(input_dir, name)) for name in TOKENIZER_FILES):
        return RECIPES["fitted"], None
    return RECIPES["paper"], (
        "recipe paper: the source has no tokenizer, which calibration needs (--recipe fitted with a "
        "tokenizer in --input_dir measures the heads and fits the router)"
    )


def plan_recipe(plan, recipe: HeadRecipe) -> None:
    """The tensors the recipe's router adds (the "fitted" router's weights) planned on `plan` as zeros, in the shard
    and dtype of each layer's o_proj weight, before calibration: the disk check counts them."""
    from .plan import plan_added_tensors

    plan_added_tensors(plan, ROUTER_PREFIX, ROUTERS[recipe.router].added_shapes(plan.config))


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


@dataclass
class _Calibration:
    """The calibration text read and cut (`_calibrate`): the source model, its blocks, what was measured."""

    model: object
    blocks: object  # (N, T) token ids: the text's first tokens
    stats: HeadStats
    record: dict  # moh_conversion.json's "calibration"


def _calibrate(plan, recipe, calibration_file, calibration_tokens, trust_remote_code, progress) -> _Calibration:
    """The source of `plan` loaded and measured on the first tokens of the calibration text (the rest held out:
    `split_tokens`)."""
    if calibration_tokens < 2:
        raise ConversionError(f"--calibration_tokens must be >= 2, got {calibration_tokens}")
    text, label = read_calibration(calibration_file)
    model, tokenizer = _load_source(plan.input_dir, trust_remote_code)
    ids = text_ids(tokenizer, text)
    used, held_out = split_tokens(len(ids), calibration_tokens)
    blocks = token_blocks(ids[:used], CALIBRATION_BLOCK)  # never the held-out tokens after them
    if int(blocks.max()) >= plan.config.vocab_size:
        raise ConversionError("the source's tokenizer gives token ids beyond the model's vocabulary")
    stats = measure_heads(model, blocks, progress, fit_router=ROUTERS[recipe.router].fits)
    record = {
        "source": label,
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
        "tokens": stats.tokens,
        "block_size": int(blocks.shape[1]),
        "text_tokens": len(ids),
        "heldout_tokens": held_out,
        "split": "calibration reads the text's first tokens; the next heldout_tokens are held out (never calibrated "
        "on: the held-out perplexity's)",
        "importance": "mean norm of each head's o_proj contribution",
    }
    return _Calibration(model, blocks, stats, record)


def choose_heads(
    plan,
    recipe: HeadRecipe,
    calibration_file: str | None = None,
    calibration_tokens: int = CALIBRATION_TOKENS,
    trust_remote_code: bool = False,
    progress: bool = False,
    head_budget: str = "uniform",
) -> HeadChoices:
    """Measure the source of `plan` on calibration text (unless the recipe and the head budget need none) and choose
    every layer's shared heads, the recipe's router (and its statistics, in the permuted head order) and, with
    `head_budget="calibrated"`, `moh_active_heads_per_layer` (head_budget.py: measured on the first
    `SENSITIVITY_TOKENS` calibration tokens), `"threshold"` those budgets and `moh_head_thresholds` (measured on all
    the calibration tokens). Returns what it chose (`HeadChoices`); `plan` is left as it is. `recipe`: a named recipe
    (`resolve_recipe` resolves "auto"), its router's tensors planned (`plan_recipe`)."""
    if head_budget not in HEAD_BUDGETS:
        raise ConversionError(f"--head_budget must be one of {', '.join(HEAD_BUDGETS)}, got {head_budget!r}")
    record = {"recipe": asdict(recipe), "head_budget": {"kind": head_budget}}
    if not recipe.needs_calibration and not HEAD_BUDGETS[head_budget]:
        return HeadChoices(None, record)
    calibration = _calibrate(plan, recipe, calibration_file, calibration_tokens, trust_remote_code, progress)
    stats, config = calibration.stats, plan.config
    shared, heads = config.moh_shared_heads, config.num_attention_heads
    order = SHARED_HEADS[recipe.shared_heads].order
    orders = [order(row, shared, config.num_key_value_heads) for row in stats.importance]
    router = ROUTERS[recipe.router]
    choices = HeadChoices(None, record, fields=router.fields(stats, orders))
    record.update(router.record(stats))
    choices.tensors = router.tensors(config, stats, orders, _planned_dtypes(plan))
    for step in HEAD_BUDGETS[head_budget]:  # each sees the fields chosen before it
        fields, words = step(calibration, choices.configured(config), orders, choices.tensors, progress)
        choices.fields.update(fields)
        record["head_budget"].update(words)
    del calibration.model
    record["calibration"] = calibration.record
    record["layers"] = [
        {
            "head_order": order,
            "shared_source_heads": sorted(order[:shared]),
            "importance": [round(v, 5) for v in stats.importance[i]],
        }
        for i, order in enumerate(orders)
    ]
    choices.orders = None if all(order == list(range(heads)) for order in orders) else orders
    return choices


def _planned_dtypes(plan) -> dict:
    """The torch dtype of every router tensor `plan_recipe` planned on `plan`, by name."""
    import torch

    torch_dtypes = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    return {
        t.name: torch_dtypes[t.dtype]
        for shard in plan.shards
        for t in shard.tensors
        if t.added and f".{ROUTER_PREFIX}" in t.name
    }


def _budgets(calibration: _Calibration, config, orders, tensors, progress: bool) -> tuple[dict, dict]:
    """Per-layer routed budgets at the uniform total (head_budget.py), measured on the first blocks."""
    blocks = calibration.blocks
    sensitivity = blocks[: max(1, SENSITIVITY_TOKENS // blocks.shape[1])]  # (N, T): the first blocks
    budgets, delta = calibrated_budgets(calibration.model, config, orders, sensitivity, progress, tensors)
    return {"moh_active_heads_per_layer": budgets}, dict(
        routed_active_heads_per_layer=budgets,
        sensitivity="mean KL(source || model) of the next-token distributions with only layer l at K routed "
        "heads active, K = 1..R; the budgets minimise its sum over the layers at the uniform total",
        sensitivity_tokens=sensitivity.numel(),
        kl=[[round(v, 6) for v in row] for row in delta],
    )


def _thresholds(calibration: _Calibration, config, orders, tensors, progress: bool) -> tuple[dict, dict]:
    """Per-layer score thresholds that give each layer its budget on average over the calibration tokens."""
    thresholds, fractions = calibrated_thresholds(calibration.model, config, orders, calibration.blocks, tensors)
    return {"moh_head_thresholds": thresholds}, dict(
        thresholds=thresholds,
        routing="per token, the routed heads whose score exceeds the layer's threshold (set so that the "
        "calibration tokens take the layer's budget on average)",
        routed_active_fraction=[round(v, 4) for v in fractions],
    )


# --head_budget: name -> the steps that choose it, in order, each (calibration, config, orders, tensors, progress)
# -> (config fields, its words in moh_conversion.json's "head_budget"); "uniform" needs none (nor calibration)
HEAD_BUDGETS = {"uniform": (), "calibrated": (_budgets,), "threshold": (_budgets, _thresholds)}


__all__ = [
    "CALIBRATION_TOKENS",
    "DEFAULT_RECIPE",
    "FIT_RIDGE",
    "HEAD_BUDGETS",
    "HELDOUT_TOKENS",
    "RECIPES",
    "ROUTER_CHOICES",
    "SHARED_CHOICES",
    "HeadChoices",
    "HeadRecipe",
    "HeadStats",
    "RouterFit",
    "calibration_blocks",
    "choose_heads",
    "plan_recipe",
    "resolve_recipe",
    "default_calibration_text",
    "fit_routers",
    "head_recipe",
    "measure_heads",
    "read_calibration",
    "split_tokens",
    "text_ids",
    "token_blocks",
]
