#!/usr/bin/env python
"""Per-layer head budgets on a real model: SmolLM2-135M-Instruct (GGUF) converted by `mhmoe-convert` at 7/9 heads
(3 shared + 4 of 6 routed), `--recipe calibrated`, with `--head_budget uniform` and `--head_budget calibrated`;
zero-shot held-out perplexity (the held-out Python-docs split of benchmarks/reproduce/moh_convert_real.py) against the
parent's, CPU fp32.

    python benchmarks/moh_head_budget_real.py --gguf_dir <gguf_dir> --workdir <workdir> [--eval_blocks 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "reproduce"))
import moh_convert_real as real  # noqa: E402  (the dequantised parent, held-out split and perplexity)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf_dir", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--eval_blocks", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mhmoe.convert import convert
    from mhmoe.models.moh_llama import MoHLlamaForCausalLM

    dense = real.dense_dir(args)
    tokenizer = AutoTokenizer.from_pretrained(dense)
    ids, _ = real.split_text(args.eval_blocks, tokenizer)
    blocks = torch.tensor(ids).view(-1, real.BLOCK)
    parent = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    parent_ppl = real.perplexity(parent, blocks)["ppl"]
    del parent
    rows = {"parent": {"ppl": parent_ppl}}
    print(f"parent: held-out perplexity {parent_ppl:.3f} ({blocks.numel()} tokens)", flush=True)
    for budget in ("uniform", "calibrated"):
        out = Path(args.workdir) / f"head-budget-{budget}-7of9"
        start = time.time()
        convert(dense, str(out), shared_heads=3, active_heads=7, recipe="calibrated", head_budget=budget,
                verify_logits=False, overwrite=True, progress=False)  # fmt: skip
        model = MoHLlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        ppl = real.perplexity(model, blocks)["ppl"]
        per_layer = model.config.moh_active_heads_per_layer
        rows[budget] = {"ppl": ppl, "ratio": ppl / parent_ppl, "routed_active_heads_per_layer": per_layer}
        print(
            f"7/9 --head_budget {budget}: perplexity {ppl:.3f} = x{ppl / parent_ppl:.3f} the parent's; per-layer routed "
            f"budgets {per_layer or 'uniform 4'} (convert + eval {time.time() - start:.0f} s)",
            flush=True,
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
