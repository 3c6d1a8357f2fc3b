"""Model speed on CPU, side by side: a training step (forward, backward, AdamW) and a cached decoding step of small
MHMoE / MoH-LLaMA models, and the MoE blocks of benchmarks/moe_layer.py, for this checkout's sources and, with
`--other_src DIR`, another source tree (e.g. `git archive <commit> src | tar -x -C DIR`: the code before a change) in
the same run.

Models (public API only, so that any version of the sources builds them; fp32, d=240, 4 layers, 8 heads, 2×256 tokens):

  dense        MHMoE with decoder_sparse_step=0 (Llama's computation)
  smoe         MHMoE, E=8, top-1, f=1024
  mhmoe_h3     MHMoE h=3, E=24, top-3, f=256, with MoH (learned router, 2 shared + 4 of the 6 routed heads)
  moh_llama    MoH-LLaMA, l2 router (4 shared + 2 of the 4 routed heads; decoding skips the inactive heads)
  block_smoe   the SMoE block of moe_layer.py (d=768, E=8, top-1, f=2048), 1024 tokens: fwd+bwd and fwd (no grad)
  block_h3     the MH-MoE h=3 block of moe_layer.py (E=96, top-3, f=512, head + merge layers), the same

Each round runs every (source, model) once, in a rotated order, each in a fresh process (imports and model building
are not timed): two warm-up steps, then `--steps` timed steps, the median kept. A candidate's time is its median over
rounds; "vs this" is the median over rounds of (other / this) in the same round, so a shared machine's drift cancels.

Usage: python benchmarks/model_step.py [--other_src DIR] [--rounds 5] [--steps 5] [--threads 2]
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("dense", "smoe", "mhmoe_h3", "moh_llama", "block_smoe", "block_h3")

WORKER = r"""
import json, statistics, sys, time
import torch
name, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
import mhmoe
from mhmoe import MHMoEConfig, MHMoEForCausalLM, MoHLlamaConfig, MoHLlamaForCausalLM

base = dict(vocab_size=4096, hidden_size=240, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
            max_position_embeddings=512)
block = dict(vocab_size=32, hidden_size=768, num_hidden_layers=1, num_attention_heads=12)
if name == "block_smoe":
    model = MHMoEForCausalLM(MHMoEConfig(**block, moe_heads=1, num_experts=8, num_experts_per_tok=1,
                                         moe_intermediate_size=2048))
elif name == "block_h3":
    model = MHMoEForCausalLM(MHMoEConfig(**block, moe_heads=3, num_experts=96, num_experts_per_tok=3,
                                         moe_intermediate_size=512))
elif name == "dense":
    model = MHMoEForCausalLM(MHMoEConfig(**base, decoder_sparse_step=0))
elif name == "smoe":
    model = MHMoEForCausalLM(MHMoEConfig(**base, num_experts=8, num_experts_per_tok=1, moe_intermediate_size=1024))
elif name == "mhmoe_h3":
    model = MHMoEForCausalLM(MHMoEConfig(**base, moe_heads=3, num_experts=24, num_experts_per_tok=3,
                                         moe_intermediate_size=256, moh_shared_heads=2, moh_active_heads=4,
                                         moh_router="learned", moh_straight_through=False))
else:
    model = MoHLlamaForCausalLM(MoHLlamaConfig(**base, moh_shared_heads=4, moh_active_heads=2))
torch.manual_seed(0)
ids = torch.randint(0, 4096, (2, 256))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step():
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def cache_of(out):  # named "cache" from Transformers 5.24, "past_key_values" before
    return out["cache"] if "cache" in out else out["past_key_values"]


def decode_step(state={}):
    with torch.no_grad():
        if "cache" not in state:
            out = model(input_ids=ids[:1, :64], use_cache=True)
            state["cache"], state["next"] = cache_of(out), out.logits[:, -1:].argmax(-1)
        out = model(input_ids=state["next"], past_key_values=state["cache"], use_cache=True)
        state["cache"], state["next"] = cache_of(out), out.logits[:, -1:].argmax(-1)


mlp = model.model.layers[0].mlp  # the MoE block of the block candidates (a model's: public API only)
x = torch.randn(1, 1024, 768) * 0.5
grad = torch.randn(1, 1024, 768)


def block_fwd_bwd():
    leaf = x.clone().requires_grad_()
    mlp(leaf).backward(grad)


def block_fwd():
    with torch.no_grad():
        mlp(x)


result = {}
runs = (("train", train_step, steps), ("decode", decode_step, 8 * steps))
if name.startswith("block"):
    runs = (("fwd+bwd", block_fwd_bwd, steps), ("fwd", block_fwd, steps))
for label, step, count in runs:
    model.train(label in ("train", "fwd+bwd"))
    for _ in range(2):
        step()
    times = []
    for _ in range(count):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    result[label] = statistics.median(times)
print(json.dumps(result))
"""


def run(src: Path, name: str, steps: int, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, name, str(steps), str(threads)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode:
        raise SystemExit(f"{name} from {src} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other_src", type=Path, default=None, help="another source tree, timed beside this one")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    args = parser.parse_args(argv)
    sources = {"this": ROOT / "src"} | ({"other": args.other_src.resolve()} if args.other_src else {})
    candidates = [(source, name) for name in args.models for source in sources]
    times = {c: {} for c in candidates}
    for round_index in range(args.rounds):
        shift = round_index % len(candidates)
        for candidate in candidates[shift:] + candidates[:shift]:
            for label, seconds in run(sources[candidate[0]], candidate[1], args.steps, args.threads).items():
                times[candidate].setdefault(label, []).append(seconds)
    print(
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
        f"{args.threads} threads, {args.rounds} rounds × {args.steps} train steps / {8 * args.steps} decode steps"
    )
    print(f"this: {sources['this']}" + (f"; other: {sources['other']}" if args.other_src else ""))
    print("median ms per step; 'other vs this': median over rounds of other/this in the same round")
    for name in args.models:
        for label in times[("this", name)]:
            this = times[("this", name)][label]
            line = f"{name:10s} {label:7s} this {1000 * statistics.median(this):8.1f} ms"
            if args.other_src:
                other = times[("other", name)][label]
                ratios = [o / t for o, t in zip(other, this)]
                line += f"   other {1000 * statistics.median(other):8.1f} ms   other vs this {statistics.median(ratios):.3f}"
                line += f" ({min(ratios):.3f}-{max(ratios):.3f})"
            print(line)


if __name__ == "__main__":
    main()
