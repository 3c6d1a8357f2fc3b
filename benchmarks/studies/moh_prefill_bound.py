"""How close MoH's head-sparse prefill can come to its ideal on this CPU: the converted SmolLM2-135M (the conversions of
`moh_head_sparse.py`, same --gguf_dir / --workdir) against its parent, side by side, with two more rows per setting:

- every head: the MoH model with `config.moh_head_skipping = False` (every head computed, then the gates): the parent's
  attention plus MoH's router and gates;
- bound: a perfect head-sparse op at the parent's own speed per query-key pair, i.e. every head's time minus the
  inactive pairs' share (2/9 or 4/9) of the parent's attention time, measured in the same round (the parent's SDPA
  calls timed as they run). What any head-sparse op built on the parent's attention kernel could reach, with the
  router kept.

Each round runs the five models in a rotated order (`evaluation.conversion_speed.interleaved_prefill`); a speed is the median over
rounds of the per-round ratio parent time / model time. The ideal (flops) is `moh_head_sparse.py`'s.

    python benchmarks/studies/moh_prefill_bound.py --gguf_dir <folder> --workdir <dir> [--tokens 4096] [--batch 1 4]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mhmoe.evaluation.conversion_speed import ideal, interleaved_prefill

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import moh_head_sparse  # noqa: E402  (its conversions and text)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf_dir", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args(argv)


class TimedAttention:
    """Calls the parent with its SDPA calls timed: `seconds` per call of this object."""

    def __init__(self, model):
        self.model, self.seconds = model, []

    def __call__(self, *args, **kwargs):
        sdpa, spent = F.scaled_dot_product_attention, [0.0]

        def timed(*a, **k):
            start = time.perf_counter()
            out = sdpa(*a, **k)
            spent[0] += time.perf_counter() - start
            return out

        F.scaled_dot_product_attention = timed
        try:
            return self.model(*args, **kwargs)
        finally:
            F.scaled_dot_product_attention = sdpa
            self.seconds.append(spent[0])


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    setup_args = argparse.Namespace(
        gguf_dir=args.gguf_dir, workdir=args.workdir, recipe="fitted", head_budget="uniform"
    )
    folders = moh_head_sparse.setup(setup_args)
    tokenizer = AutoTokenizer.from_pretrained(folders["parent"])

    def load(name):
        return AutoModelForCausalLM.from_pretrained(folders[name], dtype=torch.float32).eval()

    parent = TimedAttention(load("parent"))
    models = {"parent": parent}
    for name in moh_head_sparse.SETTINGS:
        models[name] = load(name)
        models[f"{name} every head"] = every = load(name)
        every.config.moh_head_skipping = False
    with torch.no_grad():  # warm-up
        for model in models.values():
            model(moh_head_sparse.text_ids(tokenizer, 1, 128), use_cache=False, logits_to_keep=1)
    print(
        f"torch {torch.__version__}, {args.threads} threads, fp32, CPU; median of {args.rounds} rotated rounds; "
        f"load average {moh_head_sparse.load_average()}"
    )
    print(
        "| batch | tokens | parent s | its attention | MoH | speed: head-sparse op | every head | bound | ideal (flops) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    config = parent.model.config
    for batch in args.batch:
        for tokens in args.tokens:
            ids = moh_head_sparse.text_ids(tokenizer, batch, tokens)
            parent.seconds.clear()
            times = interleaved_prefill(models, ids, args.rounds)
            attention = parent.seconds
            share = statistics.median(a / p for a, p in zip(attention, times["parent"]))
            for name, active in moh_head_sparse.SETTINGS.items():

                def speed(values):
                    return statistics.median(p / v for p, v in zip(times["parent"], values))

                bound = [v - (1 - active) * a for v, a in zip(times[f"{name} every head"], attention)]
                keys_seen = batch * tokens * (tokens + 1) / 2
                flops = ideal(config, active, batch * tokens, keys_seen, batch)["ideal_speed_ratio"]
                print(
                    f"| {batch} | {tokens} | {statistics.median(times['parent']):.2f} | {share:.3f} | {name} | "
                    f"{speed(times[name]):.3f} | {speed(times[f'{name} every head']):.3f} | {speed(bound):.3f} | "
                    f"{flops:.3f} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
