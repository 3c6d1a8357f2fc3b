"""MoH on a real model vs its parent, side by side on CPU: SmolLM2-135M-Instruct (GGUF, dequantised to fp32)
converted by `mhmoe-convert --recipe <--recipe>` (default `fitted`, the converter's default) at 7/9 and 5/9 active
heads, with MoH's head-sparse attention
(`moh_head_skipping`, the default: attention computed only for the active (token, head) pairs, the CPU path of
ops/head_sparse_attention), against the dense parent (Transformers' LlamaForCausalLM, sdpa).

    python benchmarks/moh_head_sparse.py --gguf_dir <folder with SmolLM2-135M-Instruct.Q4_1.gguf> --workdir <dir>

Setup, once per --workdir (not timed): the parent dequantised (`dequantise_gguf`, the converter's GGUF step) and the
two conversions (`mhmoe-convert --input_dir <workdir>/dense --recipe <--recipe> --shared_heads_ratio 1/3
--active_heads_ratio 7/9 | 5/9 --head_budget <--head_budget>`: 3 shared heads, one whole key/value group, and 4 or 2
of the 6 routed heads; uniform head budgets by default), in <workdir>/moh-<recipe>-7of9 and -5of9 (for other budgets
moh-<recipe>-<budget>-7of9 and -5of9). With `threshold` a token's count of heads varies: the "active pairs" column
is what the model ran on the benchmark's text.

Cells (fp32, `--threads` threads, no gradients), on Python-docs text (`pydoc_data.topics`, a different stretch per
batch row):
- prefill: one forward over B × T tokens, no cache, the last position's logits only (as `generate`'s prefill);
- decode: greedy decoding of `--new_tokens` tokens (argmax, one token per forward, the model's dynamic cache) after a
  prompt of C tokens (the prompt's prefill is not timed; the cache is cropped back after each round).
Every round runs the models (three; four with --control) in a rotated order; a cell is the median over rounds of
the per-round speed ratio parent time / MoH time (> 1: MoH faster). Prefill: each model's forward once per round;
cells shorter than `--min_cell_s` get more rounds, up to that much time per model (this shared machine's load drifts
within seconds, and a short cell's few rounds leave the ratio to chance). Decode in lockstep: every step runs each
model's next token in a rotated order, so a drift in the machine's load falls on all models alike; a model's round
time is the sum of its step times. One warm-up forward per model first. `--control` adds a second, separately loaded
copy of the parent to every rotation and a row per cell with the speed of the parent against its copy: what this
machine's noise alone makes of a ratio whose true value is 1.

Ideal (the speed-up if the inactive heads' work cost nothing and everything else stayed; from the shapes):
- flops: the model's multiply-adds per token (2 per weight of every linear layer, the lm_head for the last position in
  prefill and for every token in decoding) plus attention's QK^T and PV over the keys each token sees (causal); the
  inactive (token, head) pairs' share of the latter is saved. ideal = dense / (dense - saved).
- bytes (decoding, which is memory-bound): the weights read once per step plus the K/V cache; what MoH can skip is the
  inactive heads' columns of o_proj and, with the fitted router (it scores the attention input, not the queries),
  their rows of q_proj (the decoding step reads only the active heads' weights: models/moh/fused_decoding.py,
  `speed.decoding_skipped_projections`), and the K/V of the key/value heads that no active head of the token needs
  (with GQA groups of 3 and 3 shared heads, one whole group is always needed). The shares are measured from the
  model's own gates during the run. The flops ideal of decoding saves the same projections' work too.
In prefill every q_proj row and o_proj column is computed (the op gathers each head's active rows after the
projections), and k_proj and v_proj always are (every head's K/V is cached: a later token may select it).
"""

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from mhmoe.evaluation.conversion_speed import (  # the converter's --measure_speed: the same timing
    decoding_skipped_projections,
    ideal,
    interleaved_prefill,
    lockstep_decode,
    projection_weights,
)
from mhmoe.models.cache_naming import CACHE

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SETTINGS = {"7/9": 7 / 9, "5/9": 5 / 9}  # active heads of 9 (3 shared + 4 or 2 of 6 routed)
CONTROL = "parent copy"  # --control: the parent against a second copy of itself
MET = {True: "yes", False: "NO", None: "–"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf_dir", required=True, help=f"folder holding {GGUF}")
    parser.add_argument("--workdir", required=True, help="dense parent and conversions are written here once")
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 4096], help="prefill lengths")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="prefill batch sizes")
    parser.add_argument(
        "--contexts", type=int, nargs="*", default=[512, 4096], help="decoding: prompt lengths (none: no decoding)"
    )
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--big_rounds", type=int, default=1, help="rounds of cells over --big_tokens tokens")
    parser.add_argument("--big_tokens", type=int, default=8192, help="B × T above which --big_rounds apply")
    parser.add_argument(
        "--min_cell_s", type=float, default=20.0, help="prefill: more rounds until a model's calls take this long"
    )
    parser.add_argument("--recipe", default="fitted", help="mhmoe-convert --recipe of the two conversions")
    parser.add_argument(
        "--head_budget",
        default="uniform",
        help="mhmoe-convert --head_budget of the two conversions (uniform|calibrated|threshold)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--control", action="store_true", help="also time a copy of the parent: the noise's row")
    parser.add_argument("--output", default=None, help="also write the rows as JSON here")
    parser.add_argument(
        "--cpu_policy",
        action="append",
        default=[],
        metavar="NAME:FIELD=VALUE[,FIELD=VALUE]",
        help="also time each MoH model with its CPU head-sparse op under the default CpuHeadSparsePolicy with these "
        "fields replaced, as the row '<setting> NAME', in the same rounds (repeatable)",
    )
    return parser.parse_args(argv)


def setup(args) -> dict[str, str]:
    """{name: checkpoint folder}: the dequantised parent and its two conversions (made once)."""
    from mhmoe.convert import main as convert
    from mhmoe.convert.gguf import dequantise_gguf

    work = Path(args.workdir)
    dense = work / "dense"
    if not (dense / "model.safetensors").is_file():
        dense.mkdir(parents=True, exist_ok=True)
        dequantise_gguf(args.gguf_dir, GGUF, str(dense))
    folders = {"parent": str(dense)}
    for name, ratio in SETTINGS.items():
        budget = "" if args.head_budget == "uniform" else f"-{args.head_budget}"
        out = work / f"moh-{args.recipe}{budget}-{name.replace('/', 'of')}"
        if not (out / "moh_conversion.json").is_file():
            convert(
                [
                    "--input_dir",
                    str(dense),
                    "--output_dir",
                    str(out),
                    "--overwrite",
                    "--recipe",
                    args.recipe,
                    "--shared_heads_ratio",
                    repr(1 / 3),
                    "--active_heads_ratio",
                    repr(ratio),
                    "--disable_tqdm",
                    "--head_budget",
                    args.head_budget,
                ]
            )
        folders[name] = str(out)
    return folders


def text_ids(tokenizer, rows: int, tokens: int) -> torch.Tensor:
    """(rows, tokens) ids of Python-docs text, row r from the r-th quarter of the topics (cycled if short)."""
    from pydoc_data.topics import topics

    ids = tokenizer("\n\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False)["input_ids"]
    stride = max(1, len(ids) // max(rows, 4))
    out = []
    for row in range(rows):
        start = row * stride
        piece = (ids[start:] + ids)[:tokens]
        out.append(piece)
    return torch.tensor(out)


def decode_bytes(model, config, context: int, new_tokens: int, active_share: float, needed_kv_share: float, skipped):
    """(bytes read per decoding step, of which skippable: the inactive heads' part of the `skipped` projections
    (`decoding_skipped_projections`: 2 q_proj and o_proj, 1 o_proj) and the K/V cache that no active head needs), fp32,
    averaged over the steps."""
    weights = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n) * 4
    if config.tie_word_embeddings:
        weights += config.vocab_size * config.hidden_size * 4  # the lm_head reads the tied embedding
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    mean_keys = context + (new_tokens + 1) / 2
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * mean_keys * 4
    skippable = kv * (1 - needed_kv_share) + skipped * projection_weights(config) * 4 * (1 - active_share)
    return weights + kv, skippable


class GateRecorder:
    """The share of active (token, head) pairs and of key/value heads some active head of the token needs, read by
    forward hooks on every head router during `record` only: the timed calls run without hooks (a hook's reductions
    and host reads cost as much per layer as the router itself)."""

    def __init__(self, model):
        self.model = model
        self.groups = model.config.num_attention_heads // model.config.num_key_value_heads
        self.active, self.pairs, self.needed, self.kv = 0, 0, 0, 0

    def record(self, call) -> None:
        """Run `call()` once with the hooks on; `shares` then describes that call."""
        self.active, self.pairs, self.needed, self.kv = 0, 0, 0, 0
        handles = [
            module.register_forward_hook(self.hook)
            for module in self.model.modules()
            if type(module).__name__.endswith("Router") and hasattr(module, "active_heads")
        ]
        try:
            call()
        finally:
            for handle in handles:
                handle.remove()

    def hook(self, module, args, output):
        active = output[0] != 0  # (B, T, H)
        self.active += int(active.sum())
        self.pairs += active.numel()
        needed = active.unflatten(-1, (-1, self.groups)).any(-1)  # (B, T, Hkv)
        self.needed += int(needed.sum())
        self.kv += needed.numel()

    def shares(self) -> tuple[float, float]:
        return self.active / max(self.pairs, 1), self.needed / max(self.kv, 1)


class WithPolicy:
    """A loaded MoH model whose CPU head-sparse op runs under `policy` (--cpu_policy): the op's default policy
    replaced for the duration of each call."""

    def __init__(self, model, spec: str):
        from mhmoe.models.ops.head_sparse_attention.head_sparse_attention_cpu_policy import DEFAULT_CPU_POLICY

        fields = dict(item.split("=") for item in spec.split(","))
        self.model, self.config = model, model.config
        self.policy = dataclasses.replace(
            DEFAULT_CPU_POLICY, **{k: type(getattr(DEFAULT_CPU_POLICY, k))(float(v)) for k, v in fields.items()}
        )

    def __call__(self, *args, **kwargs):
        from mhmoe.models.ops.head_sparse_attention import head_sparse_attention_cpu as policies  # the op's default

        default, policies.DEFAULT_CPU_POLICY = policies.DEFAULT_CPU_POLICY, self.policy
        try:
            return self.model(*args, **kwargs)
        finally:
            policies.DEFAULT_CPU_POLICY = default


def moh_rows(models) -> list[tuple[str, str]]:
    """(row name, its setting) of every MoH model: the settings, then their --cpu_policy variants."""
    return [(name, name.split(" ")[0]) for name in models if name.split(" ")[0] in SETTINGS]


def prefill_cells(models, recorders, tokenizer, args, rows: list, batches: list[int]) -> None:
    config = models["parent"].config
    for batch in batches:
        for tokens in args.tokens:
            ids = text_ids(tokenizer, batch, tokens)
            rounds = args.big_rounds if batch * tokens > args.big_tokens else args.rounds

            def forward(model):
                with torch.no_grad():
                    model(ids, use_cache=False, logits_to_keep=1)

            if batch * tokens <= args.big_tokens:
                start = time.perf_counter()
                forward(models["parent"])  # untimed: how long one call takes, for the rounds of a short cell
                rounds = max(rounds, min(int(args.min_cell_s / (time.perf_counter() - start)), 5 * args.rounds))

            times = interleaved_prefill(models, ids, rounds)
            for name, recorder in recorders.items():  # untimed: the gates of the same call
                recorder.record(lambda m=models[name]: forward(m))
            keys_seen = batch * tokens * (tokens + 1) / 2
            for name, setting in moh_rows(models):
                active_share, _ = recorders[setting].shares()
                speed_up = ideal(config, active_share, batch * tokens, keys_seen, batch)["ideal_speed_ratio"]
                report(rows, "prefill", batch, tokens, name, times, speed_up, None, active_share)
            if CONTROL in times:
                report(rows, "prefill", batch, tokens, CONTROL, times, 1.0, None, 1.0)


def decode_cells(models, recorders, tokenizer, args, rows: list) -> None:
    config = models["parent"].config
    for context in args.contexts:
        ids = text_ids(tokenizer, 1, context)
        caches = {}
        with torch.no_grad():
            for name, model in models.items():
                out = model(ids, use_cache=True, logits_to_keep=1)
                caches[name] = (out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True))

        def greedy(name):  # untimed, for the recorder: one model's decoding alone
            model, (cache, token) = models[name], caches[name]
            with torch.no_grad():
                for _ in range(args.new_tokens):
                    token = model(token, **{CACHE: cache}, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            cache.crop(-args.new_tokens)  # back to the prompt for the next round (negative: tokens removed)

        times = lockstep_decode(models, caches, args.new_tokens, args.rounds)
        for name, recorder in recorders.items():  # untimed: the gates of the same decoding
            recorder.record(lambda n=name: greedy(n))
        keys_seen = args.new_tokens * (context + (args.new_tokens + 1) / 2)
        for name, setting in moh_rows(models):
            active_share, needed_share = recorders[setting].shares()
            skipped = decoding_skipped_projections(models[setting])  # q_proj and o_proj (fitted), o_proj (l2)
            flops = ideal(config, active_share, args.new_tokens, keys_seen, args.new_tokens, skipped)
            ideal_flops = flops["ideal_speed_ratio"]
            nbytes, skippable = decode_bytes(
                models["parent"], config, context, args.new_tokens, active_share, needed_share, skipped
            )
            ideal_bytes = nbytes / (nbytes - skippable)
            report(
                rows,
                f"decode {args.new_tokens}",
                1,
                context,
                name,
                times,
                ideal_flops,
                ideal_bytes,
                active_share,
                needed_share,
            )
        if CONTROL in times:
            report(rows, f"decode {args.new_tokens}", 1, context, CONTROL, times, 1.0, 1.0, 1.0, 1.0)


def report(rows, mode, batch, tokens, name, times, ideal_flops, ideal_bytes, active_share, needed_share=None):
    ratios = [p / m for p, m in zip(times["parent"], times[name])]
    row = {
        "pass": mode,
        "batch": batch,
        "tokens": tokens,
        "moh": name,
        "parent_s": statistics.median(times["parent"]),
        "moh_s": statistics.median(times[name]),
        "speed_ratio": statistics.median(ratios),
        "rounds": len(ratios),
        "ideal_flops": ideal_flops,
        "ideal_bytes": ideal_bytes,
        "active_share": active_share,
        "needed_kv_share": needed_share,
        "round_s": {"parent": times["parent"], name: times[name]},  # per round (interleaved): ratios between rows
    }
    rows.append(row)
    ideal = row["ideal_bytes"] if row["ideal_bytes"] is not None else row["ideal_flops"]
    goal = "≥ 0.98" + (f", ≥ {ideal - 0.03:.2f}" if mode == "prefill" and tokens >= 4096 else "")
    met = row["speed_ratio"] >= 0.98 and (mode != "prefill" or tokens < 4096 or row["speed_ratio"] >= ideal - 0.03)
    if name == CONTROL:  # no goal: the spread a true ratio of 1 shows on this machine
        goal, met = "(control)", None
    bytes_cell = f"{ideal_bytes:.3f}" if ideal_bytes is not None else "–"
    print(
        f"| {mode} | {batch} | {tokens} | {name} | {row['parent_s']:.2f} | {row['moh_s']:.2f} | "
        f"**{row['speed_ratio']:.3f}** | {ideal_flops:.3f} | {bytes_cell} | {active_share:.3f} | "
        f"{'–' if needed_share is None else f'{needed_share:.3f}'} | {goal} | {MET[met]} | {len(ratios)} |",
        flush=True,
    )


def load_average() -> str:
    path = Path("/proc/loadavg")
    return "/".join(path.read_text().split()[:3]) if path.exists() else "?"


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    folders = setup(args)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mhmoe.models.moh_llama import MoHLlamaForCausalLM
    from mhmoe.models.ops.backends import fallbacks

    tokenizer = AutoTokenizer.from_pretrained(folders["parent"])
    models = {"parent": AutoModelForCausalLM.from_pretrained(folders["parent"], dtype=torch.float32).eval()}
    if args.control:
        models[CONTROL] = AutoModelForCausalLM.from_pretrained(folders["parent"], dtype=torch.float32).eval()
    for name in SETTINGS:
        models[name] = MoHLlamaForCausalLM.from_pretrained(folders[name], dtype=torch.float32).eval()
    for spec in args.cpu_policy:  # the same models, their op under another policy
        label, fields = spec.split(":")
        for name in SETTINGS:
            models[f"{name} {label}"] = WithPolicy(models[name], fields)
    recorders = {name: GateRecorder(models[name]) for name in SETTINGS}
    setup_s = time.perf_counter() - started
    with torch.no_grad():  # warm-up
        for model in models.values():
            model(text_ids(tokenizer, 1, 128), use_cache=False, logits_to_keep=1)
    attn = {name: model.config._attn_implementation for name, model in models.items()}
    record = json.loads((Path(folders["7/9"]) / "moh_conversion.json").read_text())
    recipe, budget = record.get("recipe"), record.get("head_budget", {}).get("kind", "uniform")
    print(
        f"torch {torch.__version__}, {args.threads} threads, fp32, CPU; attention {attn}; MoH recipe {recipe}, "
        f"{budget} head budget; "
        f"median of {args.rounds} interleaved rounds ({args.big_rounds} for cells over {args.big_tokens} tokens, more "
        f"for prefills under {args.min_cell_s:g} s a model; decoding in lockstep); "
        f"setup {setup_s:.0f} s; load average {load_average()}"
    )
    print(
        "| pass | batch | tokens (prefill) / prompt (decode) | MoH | parent s | MoH s | speed MoH / parent | "
        "ideal (flops) | ideal (bytes) | active pairs | needed K/V heads | goal | met | rounds |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    prefill_cells(models, recorders, tokenizer, args, rows, args.batch[:1])
    decode_cells(models, recorders, tokenizer, args, rows)  # before the larger batches, the longest cells
    prefill_cells(models, recorders, tokenizer, args, rows, args.batch[1:])
    print(
        f"total {time.perf_counter() - started:.0f} s; load average at the end {load_average()}; kernel fallbacks "
        f"{fallbacks() or 'none'}"
    )
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
