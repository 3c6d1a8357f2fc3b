"""`mhmoe-convert --measure_speed`: the converted MoH model timed against its dense parent on this machine, side by
side in one process, before the output folder is renamed into place (so its card states the figures). A benchmark,
not a conversion step: the converter (`convert/conversion.py`) calls `measure_speed` with its checked settings
(`convert/options.py`'s `SpeedSettings`) and the calibration text; nothing here imports the converter.

Two cells, batch 1, the checkpoint's dtype, on CPU with torch's threads, on the calibration text (`--calibration_file`,
else Python's docs; random token ids when the source has no tokenizer):
- prefill: one forward over the prompt (`--speed_tokens`, capped by the text and the model's positions), no cache, the
  last position's logits only (as `generate`'s prefill). Every round runs parent and MoH once each, alternating which
  goes first; while a model's prefills take under `PREFILL_MIN_SECONDS` in all, more rounds (up to 5 × `--speed_rounds`):
  a short cell's few rounds would leave the ratio to chance.
- decode: greedy decoding of `--speed_new_tokens` tokens after that prompt (argmax, the model's dynamic cache; the
  prompt's prefill untimed) in lockstep: every step runs the parent's next token and MoH's, alternating which goes
  first, so a drift in the machine's load falls on both alike; the caches are cropped back after each round.
A cell is the median over rounds of the per-round ratio parent time / MoH time (> 1: MoH faster), with each model's
tokens/s from its median time. The ideal is the speed-up if the inactive heads' work cost nothing and everything else
stayed, from the shapes: ideal = all / (all - inactive share × heads' work) in multiply-adds, where the heads' work is
their attention (QK^T and PV) and, in decoding, the projections whose inactive heads' weights its step does not read
(`decoding_skipped_projections`: o_proj, and q_proj too with the fitted router). benchmarks/moh_head_sparse.py, the
repeatable benchmark, also counts bytes and measures the gates.
"""

from __future__ import annotations

import contextlib
import statistics
import time

PREFILL_MIN_SECONDS = 5.0  # a model's prefills in all, before the rounds stop growing
BENCHMARK = "benchmarks/moh_head_sparse.py"


def forward_flops(config, tokens: int, keys_seen: float, logits_rows: int) -> tuple[float, float]:
    """(all multiply-add flops, attention core flops) of a forward of `config` over `tokens` tokens that see
    `keys_seen` keys in all (summed over tokens), the lm_head on `logits_rows` positions."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    per_layer = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 3 * hidden * config.intermediate_size
    linear = 2 * tokens * layers * per_layer + 2 * logits_rows * hidden * config.vocab_size
    attention = 2 * 2 * layers * heads * head_dim * keys_seen  # QK^T and PV
    return linear + attention, attention


def active_head_share(config) -> float:
    """The share of (token, head) pairs a MoH config computes: shared + routed budget over all heads, layers averaged
    (top-K routing picks exactly its budget per token; with `moh_head_thresholds` this is the calibration text's
    average: `measured_head_share`)."""
    heads, shared = config.num_attention_heads, config.moh_shared_heads
    budgets = getattr(config, "moh_active_heads_per_layer", None) or [config.moh_active_heads]
    return sum(shared + k for k in budgets) / (len(budgets) * heads)


@contextlib.contextmanager
def head_counter(model):
    """[active, total] (token, head) pairs of `model`'s MoH routers' gates, counted while the block runs."""
    counts = [0, 0]

    def count(module, args, output):
        counts[0] += int((output[0] != 0).sum())  # gates (B, T, H)
        counts[1] += output[0].numel()

    from ..models.moh.head_routers import MoHRouter

    routers = [module for module in model.modules() if isinstance(module, MoHRouter)]  # layer 0 first
    hooks = [router.register_forward_hook(count) for router in routers]
    try:
        yield counts
    finally:
        for hook in hooks:
            hook.remove()


def measured_head_share(model, ids) -> float:
    """The share of (token, head) pairs `model` activates on `ids` (its routers' gates over one forward)."""
    import torch

    with head_counter(model) as counts, torch.no_grad():
        model(ids, use_cache=False, logits_to_keep=1)
    return counts[0] / max(counts[1], 1)


def projection_weights(config) -> int:
    """Weights of one H·hd × d projection (q_proj or o_proj) over all layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * config.hidden_size * config.num_attention_heads * head_dim


def ideal(config, share: float, tokens: int, keys_seen: float, logits_rows: int, projections: int = 0) -> dict:
    """The inactive heads' share of the work (attention, and their part of `projections` of the two H·hd × d
    projections: 1 o_proj, 2 q_proj and o_proj) and the speed-up if it cost nothing."""
    total, heads_work = forward_flops(config, tokens, keys_seen, logits_rows)
    heads_work += projections * 2 * tokens * projection_weights(config)
    inactive = (1 - share) * heads_work / total
    return {"inactive_attention_share": inactive, "ideal_speed_ratio": 1 / (1 - inactive), "projections": projections}


def decoding_skipped_projections(model) -> int:
    """How many of q_proj and o_proj `model`'s CPU decoding step reads only the active heads' part of
    (`models/moh/fused_decoding.py`, fp32): 2 when the router scores the attention input (the fitted one), 1 (o_proj)
    when it scores the queries (l2), 0 otherwise."""
    from ..models.moh.fused_decoding import fused_projection

    for module in model.modules():
        if getattr(module, "head_router", None) is not None:
            projection = fused_projection(module)
            if projection is None or not projection.skips_heads:
                return 0
            return 2 if projection.skips_queries else 1
    return 0


def _rotated(names: list[str], shift: int) -> list[str]:
    shift %= len(names)
    return names[shift:] + names[:shift]


def interleaved_prefill(models: dict, ids, rounds: int) -> dict[str, list[float]]:
    """Seconds per model and round of a prefill of `ids`, the models in a rotated order each round."""
    import torch

    times = {name: [] for name in models}
    with torch.no_grad():
        for index in range(rounds):
            for name in _rotated(list(models), index):
                start = time.perf_counter()
                models[name](ids, use_cache=False, logits_to_keep=1)
                times[name].append(time.perf_counter() - start)
    return times


def lockstep_decode(models: dict, caches: dict, new_tokens: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per model and round of greedy decoding `new_tokens` tokens from `caches` ({name: (cache, first
    token)}), every step running each model's next token in a rotated order; the caches cropped back each round."""
    import torch

    from ..models.cache_naming import CACHE

    names = list(models)
    times = {name: [] for name in names}
    with torch.no_grad():
        for index in range(rounds):
            tokens = {name: caches[name][1] for name in names}
            spent = dict.fromkeys(names, 0.0)
            for step in range(new_tokens):
                for name in _rotated(names, index * new_tokens + step):
                    start = time.perf_counter()
                    logits = models[name](tokens[name], **{CACHE: caches[name][0]}, use_cache=True).logits
                    tokens[name] = logits[:, -1].argmax(-1, keepdim=True)
                    spent[name] += time.perf_counter() - start
            for name in names:
                caches[name][0].crop(-new_tokens)  # back to the prompt (negative: tokens removed)
                times[name].append(spent[name])
    return times


def cell(times: dict[str, list[float]], tokens: int) -> dict:
    """A cell's record: the per-round seconds, the median of the per-round ratios parent / MoH, tokens/s of each."""
    parent, moh = times["parent"], times["moh"]
    return {
        "rounds": len(parent),
        "parent_seconds": parent,
        "moh_seconds": moh,
        "speed_ratio": statistics.median(p / m for p, m in zip(parent, moh)),
        "parent_tokens_per_s": tokens / statistics.median(parent),
        "moh_tokens_per_s": tokens / statistics.median(moh),
    }


def _prompt_ids(source_dir: str, vocab_size: int, tokens: int, text: str, trust_remote_code: bool):
    """(1, ≤ tokens) ids of `text`, or None when the source has no usable tokenizer."""
    import torch

    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source_dir, trust_remote_code=trust_remote_code)
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"][:tokens]
        if ids and max(ids) < vocab_size:
            return torch.tensor([ids])
    except (OSError, ValueError, TypeError, KeyError):
        pass
    return None


def _random_ids(vocab_size: int, tokens: int):
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (1, tokens), generator=generator)


def measure_speed(
    source_dir: str,
    converted_dir: str,
    settings,
    text: tuple[str, str],
    trust_remote_code: bool = False,
    progress: bool = True,
) -> dict:
    """Time the converted model in `converted_dir` against its parent `source_dir` (both loaded, checkpoint dtype,
    CPU) on `text` ((text, label): the calibration text) with `settings` (tokens, new_tokens, rounds: the converter's
    `SpeedSettings`): the record moh_conversion.json keeps as "speed" and the card states
    (`mhmoe.hub.conversion_cards.speed_rows`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..models.cache_naming import CACHE
    from ..models.moh_llama import MoHLlamaForCausalLM

    started = time.perf_counter()
    parent = AutoModelForCausalLM.from_pretrained(source_dir, dtype="auto", trust_remote_code=False).eval()
    moh = MoHLlamaForCausalLM.from_pretrained(converted_dir, dtype="auto", trust_remote_code=False).eval()
    models = {"parent": parent, "moh": moh}
    config = moh.config
    positions = config.max_position_embeddings
    new_tokens = min(settings.new_tokens, positions // 2)
    tokens = min(settings.tokens, positions - new_tokens)
    ids = _prompt_ids(source_dir, config.vocab_size, tokens, text[0], trust_remote_code)
    label = text[1] if ids is not None else "random token ids"
    ids = _random_ids(config.vocab_size, tokens) if ids is None else ids
    prompt = ids.shape[1]
    if progress:
        print(
            f"timing the converted model against its parent (--measure_speed): prefill of {prompt} tokens, greedy "
            f"decoding of {new_tokens} tokens, {torch.get_num_threads()} threads",
            flush=True,
        )
    with torch.no_grad():  # warm-up, and one prefill's time for the rounds
        moh(ids, use_cache=False, logits_to_keep=1)
        start = time.perf_counter()
        parent(ids, use_cache=False, logits_to_keep=1)
        one = time.perf_counter() - start
    rounds = max(settings.rounds, min(int(PREFILL_MIN_SECONDS / max(one, 1e-9)), 5 * settings.rounds))
    prefill = cell(interleaved_prefill(models, ids, rounds), prompt)
    with torch.no_grad():  # the prompt's prefill with the cache, untimed
        caches = {}
        for name, model in models.items():
            out = model(ids, use_cache=True, logits_to_keep=1)
            caches[name] = (out[CACHE], out.logits[:, -1].argmax(-1, keepdim=True))
    decode = cell(lockstep_decode(models, caches, new_tokens, settings.rounds), new_tokens)
    share = active_head_share(config)
    if getattr(config, "moh_head_thresholds", None) is not None:  # a count per token: what this text activates
        share = measured_head_share(moh, ids)
    prefill.update(tokens=prompt, **ideal(config, share, prompt, prompt * (prompt + 1) / 2, 1))
    keys_seen = new_tokens * (prompt + (new_tokens + 1) / 2)
    decode.update(
        prompt_tokens=prompt,
        new_tokens=new_tokens,
        **ideal(config, share, new_tokens, keys_seen, new_tokens, projections=decoding_skipped_projections(moh)),
    )
    return {
        "prefill": prefill,
        "decode": decode,
        "batch": 1,
        "text": label,
        "device": str(next(moh.parameters()).device),
        "dtype": str(next(moh.parameters()).dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "attention": {name: model.config._attn_implementation for name, model in models.items()},
        "active_head_share": share,
        "settings": {"tokens": settings.tokens, "new_tokens": settings.new_tokens, "rounds": settings.rounds},
        "seconds": round(time.perf_counter() - started, 3),
        "benchmark": BENCHMARK,
    }


def speed_line(speed: dict) -> str:
    """The converter's report line of a "speed" record."""
    p, d = speed["prefill"], speed["decode"]
    return (
        f"  speed vs parent (this machine, {speed['threads']} threads, {speed['dtype']}): prefill {p['tokens']} tokens "
        f"×{p['speed_ratio']:.3f} (ideal ×{p['ideal_speed_ratio']:.3f}, {p['rounds']} rounds); decode "
        f"{d['new_tokens']} tokens ×{d['speed_ratio']:.3f} (ideal ×{d['ideal_speed_ratio']:.3f}, {d['rounds']} rounds)"
    )


__all__ = [
    "BENCHMARK",
    "PREFILL_MIN_SECONDS",
    "active_head_share",
    "head_counter",
    "measured_head_share",
    "forward_flops",
    "interleaved_prefill",
    "lockstep_decode",
    "measure_speed",
    "speed_line",
]
