"""Per-layer head budgets (`mhmoe-convert --head_budget calibrated`): how many routed heads each layer keeps active per
token, at the uniform budget's total (layers × `moh_active_heads`, so the same average active fraction).

Measured, not guessed. `measure_sensitivity` runs the converted model (in memory, with its routers) on calibration
text with only layer l restricted to K routed heads, every other layer with all heads active, and compares it with
itself with every head active (which computes the dense source exactly): Δ_l(K) = the mean over tokens of
KL(source || model) of the next-token distributions, K = 1..R (Δ_l(R) = 0). `allocate_budgets` then chooses the K_l
minimising Σ_l Δ_l(K_l) at Σ_l K_l = the total (exact, dynamic programming over the layers; the layers' losses are
taken as additive). A rule on head importances alone (the largest o_proj contributions) was worse than the uniform
budget on SmolLM2-135M: contribution norms grow with depth, so the early layers kept one routed head
(benchmarks/results/moh_head_budgets.md).

`--head_budget threshold` keeps the calibrated budgets as each layer's average and lets the count vary per token:
`calibrated_thresholds` sets, per layer, the score threshold that the calibration tokens' routed scores pass K_l
times per token on average (`moh_head_thresholds`; head_routers.py). Measured on SmolLM2-135M (fitted router, 7/9):
benchmarks/results/moh_head_thresholds.md.
"""

from __future__ import annotations

from .errors import ConversionError
from .verify import all_heads_active, moh_routers

SENSITIVITY_TOKENS = 512  # the first calibration tokens the per-layer sensitivities are measured on


def allocate_budgets(delta: list[list[float]], total: int) -> list[int]:
    """K_l in 1..R for every layer, minimising Σ_l delta[l][K_l - 1] with Σ_l K_l = `total`. `delta`: (layers, R), the
    loss of layer l with K routed heads active at [l][K - 1]. Exact: dynamic programming over the layers
    (O(layers · total · R)); among equal sums the first allocation found (deterministic)."""
    layers, routed = len(delta), len(delta[0])
    if not layers <= total <= layers * routed:
        raise ConversionError(
            f"{total} routed heads cannot be shared out over {layers} layers of {routed} routed heads "
            f"(each layer keeps 1..{routed})"
        )
    # best[s] = (the least Σ delta of the layers so far using s routed heads, the budgets that reach it)
    best: dict[int, tuple[float, list[int]]] = {0: (0.0, [])}
    for row in delta:
        step: dict[int, tuple[float, list[int]]] = {}
        for used, (cost, budgets) in best.items():
            for k in range(1, routed + 1):
                candidate = cost + row[k - 1]
                if used + k not in step or candidate < step[used + k][0]:
                    step[used + k] = (candidate, budgets + [k])
        best = step
    return best[total][1]


def _layer_calls(model, ids) -> list[tuple[tuple, dict]]:
    """Each decoder layer's call (args, kwargs) in one forward of `ids`: the hidden states entering it and the rest."""
    calls = []
    hooks = [
        layer.register_forward_pre_hook(lambda module, args, kwargs: calls.append((args, kwargs)), with_kwargs=True)
        for layer in model.model.layers
    ]
    try:
        model(ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def _log_probs_from(model, calls, first: int):
    """(B, T, V) fp32 next-token log-probabilities, running decoder layers `first`.. on the hidden states that entered
    layer `first` (the layers before it do not change when only layer `first` is restricted)."""
    import torch

    args, kwargs = calls[first]
    hidden_states = args[0]
    for layer, (args, kwargs) in zip(model.model.layers[first:], calls[first:]):
        hidden_states = layer(hidden_states, *args[1:], **kwargs)
    logits = model.get_output_embeddings()(model.model.norm(hidden_states))
    return torch.log_softmax(logits.float(), dim=-1)


def measure_sensitivity(model, blocks, progress: bool = False, batch: int = 4) -> list[list[float]]:
    """Δ (layers, R): Δ[l][K - 1] = the mean over tokens of KL(all heads || layer l at K) of the next-token
    distributions of `model` (a MoH-LLaMA) on `blocks` (N, T) token ids, with only layer l at K routed heads active
    (every other layer, and the reference, with all heads active). R - 1 passes per layer over layers l.. only."""
    import torch
    from tqdm.auto import tqdm

    routers = moh_routers(model)
    with torch.no_grad(), all_heads_active(model):
        calls = [_layer_calls(model, blocks[i : i + batch].to(model.device)) for i in range(0, len(blocks), batch)]
        reference = [_log_probs_from(model, c, 0) for c in calls]
        delta = []
        for first, router in enumerate(
            tqdm(routers, desc="head budget sensitivity", unit="layer", disable=not progress)
        ):
            row = []
            for k in range(1, router.routed_heads):
                router.active_heads = k
                total = sum(
                    (ref.exp() * (ref - _log_probs_from(model, c, first))).sum().item()
                    for ref, c in zip(reference, calls)
                )
                row.append(max(total / blocks.numel(), 0.0))  # ≥ 0 up to rounding
            router.active_heads = router.routed_heads
            delta.append(row + [0.0])
    return delta


def converted_in_memory(source, config, orders: list[list[int]] | None, tensors: dict | None = None):
    """The MoH model `config` describes, holding `source`'s weights (its heads permuted by `orders`) and `tensors`
    (the ones the converter adds: the fitted router's), in `source`'s dtype and device: what the converter will
    write, without writing it (the weights are shared, not copied)."""
    import torch

    from ..models.moh_llama import MoHLlamaForCausalLM
    from .heads import permute_state_dict

    state = source.state_dict()
    if orders is not None:
        state = permute_state_dict(state, orders, config.num_key_value_heads, config.head_dim)
    state.update({name: t.to(source.device) for name, t in (tensors or {}).items()})
    dtype = next(source.parameters()).dtype
    with torch.device(source.device):
        model = MoHLlamaForCausalLM._from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ConversionError(f"the source's weights do not fit the MoH model: missing {missing}, extra {unexpected}")
    model.tie_weights()
    return model.eval()


def calibrated_budgets(
    source, config, orders, blocks, progress: bool = False, tensors: dict | None = None
) -> tuple[list[int], list[list[float]]]:
    """(per-layer routed budgets at the uniform total, Δ) for the conversion `config` + `orders` (+ added `tensors`)
    of `source`, measured on `blocks` with the router the conversion writes."""
    model = converted_in_memory(source, config, orders, tensors)
    delta = measure_sensitivity(model, blocks, progress)
    return allocate_budgets(delta, config.moh_active_heads * len(delta)), delta


def calibrated_thresholds(
    source, config, orders, blocks, tensors: dict | None = None, batch: int = 4
) -> tuple[list[float | None], list[float]]:
    """(per-layer score thresholds, each layer's routed active fraction on `blocks`) for `--head_budget threshold`:
    layer l's threshold is the score that the layer's N tokens × R routed scores exceed K_l·N times (K_l: its
    calibrated budget), halfway between the (K_l·N)-th and the next largest, so that on calibration text a token takes
    K_l routed heads on average and the ones the router scores highest overall: more where several heads matter, fewer
    where one does. The scores are measured with the top-K routing upstream. None where K_l = R (every head)."""
    import torch

    model = converted_in_memory(source, config, orders, tensors)
    routers = moh_routers(model)
    scores: list[list] = [[] for _ in routers]
    hooks = [
        router.register_forward_hook(lambda m, a, out, i=i: scores[i].append(out[1].detach().float().flatten()))
        for i, router in enumerate(routers)
    ]
    try:
        with torch.no_grad():
            for start in range(0, len(blocks), batch):
                model(blocks[start : start + batch].to(model.device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    thresholds, fractions = [], []
    for router, layer_scores in zip(routers, scores):
        flat, routed, active = torch.cat(layer_scores), router.routed_heads, router.active_heads
        if active >= routed:
            thresholds.append(None)
            fractions.append(1.0)
            continue
        on = active * (flat.numel() // routed)  # K_l · N scores above the threshold
        top = flat.topk(on + 1).values
        threshold = float((top[on - 1] + top[on]) / 2)
        thresholds.append(threshold)
        fractions.append(float((flat > threshold).float().mean()))
    return thresholds, fractions


__all__ = [
    "SENSITIVITY_TOKENS",
    "allocate_budgets",
    "calibrated_budgets",
    "calibrated_thresholds",
    "converted_in_memory",
    "measure_sensitivity",
]
