#!/usr/bin/env python
"""Benchmark the LLaMA -> MoH converter on a synthetic multi-GB checkpoint: throughput vs a plain copy, peak memory.

    PYTHONPATH=src python benchmarks/convert_throughput.py [--layers 22] [--shard_mb 500] [--repeats 2] [--dir /tmp]

Writes a random LLaMA checkpoint shaped like TinyLlama-1.1B (hidden 2048, 22 layers, 32 heads, 4 key/value heads,
intermediate 5632, vocab 32000; bf16, ~2.2 GB in `--shard_mb` shards + index) into a temporary directory, then
alternates `--repeats` times:
  * copy: a plain copy of the same files (shutil.copyfile, i.e. sendfile; with and without fsync per file),
  * convert: `mhmoe.convert.convert(..., verify_logits=False)` in a fresh Python process (the logit check loads the
    whole model and is meant for models that fit in memory; the header/shape checks still run). The converter flushes
    every shard to disk (fsync, overlapped with copying the next shard) before it renames the output into place.
The source stays in the page cache (it was just written); `os.sync()` runs before each timed run so that none pays for
the write-back of the previous one. Times on a shared VM disk vary by ±30% from run to run: compare medians.
Prints throughput (GB/s of checkpoint) and the converter's peak RSS (VmHWM of its own process) next to the
largest shard and next to the RSS of a process that only imports the converter (torch + transformers). Targets
(issue 6): convert >= 0.5x copy speed, peak RSS <= 1.5x the largest shard. Everything is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 2048, 5632, 32, 4, 32000

_WORKER = r"""
import json, sys, time
t0 = time.time()
from mhmoe.convert import convert
t1 = time.time()
if sys.argv[1] != "--import-only":
    report = convert(sys.argv[1], sys.argv[2], verify_logits=False, progress=False)
t2 = time.time()
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
peak = int(status["VmHWM"].split()[0]) * 1024  # this process's own high-water mark (ru_maxrss of a child of a big
print(json.dumps({"import_s": t1 - t0, "convert_s": t2 - t1, "peak_rss": peak}))  # parent includes the parent's)
"""


def tensor_shapes(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    head_dim = HIDDEN // HEADS
    shapes = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "self_attn.q_proj.weight", (HEADS * head_dim, HIDDEN)),
            (p + "self_attn.k_proj.weight", (KV_HEADS * head_dim, HIDDEN)),
            (p + "self_attn.v_proj.weight", (KV_HEADS * head_dim, HIDDEN)),
            (p + "self_attn.o_proj.weight", (HIDDEN, HEADS * head_dim)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
            (p + "mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
            (p + "mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
        ]
    shapes += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    return shapes


def write_checkpoint(directory: str, layers: int, shard_mb: int) -> list[str]:
    """A random bf16 LLaMA checkpoint, sharded like save_pretrained (greedy up to shard_mb), tensor by tensor."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(directory)
    generator = torch.Generator().manual_seed(0)
    groups, current, size = [], [], 0
    for name, shape in tensor_shapes(layers):
        nbytes = 2 * int(torch.Size(shape).numel())
        if current and size + nbytes > shard_mb * 1e6:
            groups.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    groups.append(current)
    names, weight_map, total = [], {}, 0
    for i, group in enumerate(groups, start=1):
        filename = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name, shape in group:
            tensors[name] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
            weight_map[name] = filename
            total += tensors[name].numel() * 2
        save_file(tensors, os.path.join(directory, filename), metadata={"format": "pt"})
        del tensors
        names.append(filename)
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return names


def plain_copy(source: str, target: str, fsync: bool) -> float:
    start = time.perf_counter()
    os.makedirs(target)
    for name in sorted(os.listdir(source)):
        shutil.copyfile(os.path.join(source, name), os.path.join(target, name))
        if fsync:
            fd = os.open(os.path.join(target, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    return time.perf_counter() - start


def run_worker(*args: str) -> tuple[dict, float, int]:
    """(the worker's timings, wall seconds, peak RSS bytes: VmHWM read by the worker itself) of a fresh process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _WORKER, *args], capture_output=True, env=env, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result, wall, result["peak_rss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=22, help="22: TinyLlama-1.1B shape, ~2.2 GB in bf16")
    parser.add_argument("--shard_mb", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", default=None, help="Parent of the temporary directory (default: the system's).")
    args = parser.parse_args()

    root = tempfile.mkdtemp(prefix="mhmoe-convert-bench-", dir=args.dir)
    try:
        source = os.path.join(root, "llama")
        start = time.perf_counter()
        shards = write_checkpoint(source, args.layers, args.shard_mb)
        sizes = [os.path.getsize(os.path.join(source, s)) for s in shards]
        total = sum(os.path.getsize(os.path.join(source, n)) for n in os.listdir(source))
        print(
            f"synthetic LLaMA checkpoint: {args.layers} layers, hidden {HIDDEN}, {HEADS} heads ({KV_HEADS} kv), "
            f"bf16, {total / 1e9:.2f} GB in {len(shards)} shards (largest {max(sizes) / 1e6:.0f} MB), written in "
            f"{time.perf_counter() - start:.1f} s to {root} ({_filesystem(root)})"
        )

        copies, synced, converts, walls, rss = [], [], [], [], []
        for r in range(args.repeats):
            for kind, timings in (("copy", copies), ("copy+fsync", synced)):
                target = os.path.join(root, f"{kind}-{r}")
                os.sync()  # no run pays for the write-back of the one before
                timings.append(plain_copy(source, target, fsync=kind == "copy+fsync"))
                shutil.rmtree(target)
            target = os.path.join(root, f"moh-{r}")
            os.sync()
            timing, wall, peak = run_worker(source, target)
            converts.append(timing["convert_s"])
            walls.append(wall)
            rss.append(peak)
            shutil.rmtree(target)
        _, _, import_rss = run_worker("--import-only")

        gb = total / 1e9
        copy_s, synced_s, convert_s = (statistics.median(t) for t in (copies, synced, converts))
        print(
            f"plain copy (shutil.copyfile):          {', '.join(f'{t:.2f}' for t in copies)} s -> median "
            f"{gb / copy_s:.2f} GB/s"
        )
        print(
            f"plain copy + fsync per file:           {', '.join(f'{t:.2f}' for t in synced)} s -> median "
            f"{gb / synced_s:.2f} GB/s"
        )
        print(
            f"convert (checks, copy, fsync, check):  {', '.join(f'{t:.2f}' for t in converts)} s -> median "
            f"{gb / convert_s:.2f} GB/s = {copy_s / convert_s:.2f}x plain copy, {synced_s / convert_s:.2f}x "
            "copy+fsync (target >= 0.5x)"
        )
        print(f"  whole converter process incl. Python start and imports: {', '.join(f'{t:.2f}' for t in walls)} s")
        largest = max(sizes)
        print(
            f"converter peak RSS: {max(rss) / 1e6:.0f} MB = {max(rss) / largest:.2f}x the largest shard "
            f"({largest / 1e6:.0f} MB; target <= 1.5x); a process that only imports the converter: "
            f"{import_rss / 1e6:.0f} MB"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"removed {root}")


def _filesystem(path: str) -> str:
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True).stdout.splitlines()[-1].split()
        return f"{out[1]} on {out[0]}"
    except (OSError, IndexError):
        return "file system unknown"


if __name__ == "__main__":
    main()
