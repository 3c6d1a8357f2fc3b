"""Peak training memory on CPU: MH-MoE h=3 against the matched top-1 SMoE (issue #23, point 6).

Each model is measured in its own fresh process: build it and AdamW, one warm-up step (so the optimizer state exists),
free the gradients, then one training step (forward, backward, AdamW step). Reported per model:
  - step peak: the process's peak resident memory during that step (Linux VmHWM, reset just before it through
    /proc/self/clear_refs) minus its resident memory just before: what one step adds on top of weights and optimizer
    state (activations saved for backward, transient buffers, gradients);
  - saved for backward: the bytes of distinct storages autograd saves during the forward (`saved_tensors_hooks`;
    parameters are not counted, nor the expert function's integer routing indices, kept on its context, are not in it), and the part saved while inside
    the MoE blocks (head/merge layers, router, experts; the block input counts where a layer there saves it);
  - total peak: the step peak plus what was resident before (weights, AdamW state, the Python process itself).
The CPU buffer pool of the grouped_mm experts is off (MHMOE_CPU_BUFFER_POOL_MB=0) so that kept buffers do not blur the peaks.

    python benchmarks/memory.py [--hidden 576] [--layers 4] [--batch 4] [--block 512] [--bf16]

The models: the reproduction's gpu-scale widths by default (d=576, f=1536, E=8, vocab 8192), every layer MoE,
MH-MoE h=3 sized with `mhmoe.matched_to_smoe` (k=3 per sub-token).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


def _configs(args):
    from mhmoe import MHMoEConfig, matched_to_smoe

    smoe = MHMoEConfig(
        vocab_size=8192,
        hidden_size=args.hidden,
        intermediate_size=args.inter,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_experts=8,
        num_experts_per_tok=1,
        moe_intermediate_size=args.inter,
        moe_heads=1,
        decoder_sparse_step=1,
        max_position_embeddings=args.block,
        tie_word_embeddings=False,
    )
    return {"smoe": smoe, "mhmoe_h3": matched_to_smoe(smoe, moe_heads=3, num_experts_per_tok=3)}


def measure(name: str, args) -> dict:
    """One model's numbers, in this process (see the module docstring)."""
    import torch

    from mhmoe import MHMoEForCausalLM
    from mhmoe.models.mhmoe.sparse_moe import MHMoESparseMoeBlock

    torch.manual_seed(0)
    config = _configs(args)[name]
    model = MHMoEForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.block))
    dtype = torch.bfloat16 if args.bf16 else None

    def step(saved=None):
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            if saved is None:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            else:
                seen, in_moe, inside = {}, {}, [0]

                weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

                def pack(tensor):
                    storage = tensor.untyped_storage()
                    if storage.data_ptr() in weights:  # a parameter (or a view of one): not an activation
                        return tensor
                    seen[storage.data_ptr()] = storage.nbytes()
                    if inside[0]:
                        in_moe[storage.data_ptr()] = storage.nbytes()
                    return tensor

                def enter(*_):
                    inside[0] += 1

                def leave(*_):
                    inside[0] -= 1

                blocks = [m for m in model.modules() if isinstance(m, MHMoESparseMoeBlock)]
                handles = [
                    hook
                    for b in blocks
                    for hook in (b.register_forward_pre_hook(enter), b.register_forward_hook(leave))
                ]
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                for handle in handles:
                    handle.remove()
                saved["bytes"], saved["moe_bytes"] = sum(seen.values()), sum(in_moe.values())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    step()
    peak = _status("VmHWM")
    saved: dict = {}
    step(saved)
    return {
        "model": name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "resident_before": before,
        "step_peak": peak - before,
        "total_peak": peak,
        "saved_for_backward": saved["bytes"],
        "saved_in_moe_blocks": saved["moe_bytes"],
        "moe_heads": config.moe_heads,
        "num_experts": config.num_experts,
        "experts_per_token": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--inter", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--block", type=int, default=512)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 master weights)")
    parser.add_argument("--one", choices=["smoe", "mhmoe_h3"], help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args)))
        return 0
    rows = {}
    env = {**os.environ, "MHMOE_CPU_BUFFER_POOL_MB": "0"}
    for name in ("smoe", "mhmoe_h3"):
        child = [sys.executable, __file__, "--one", name, *(argv if argv is not None else sys.argv[1:])]
        proc = subprocess.run(child, env=env, capture_output=True, text=True, check=True)
        rows[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    mib = 2**20
    print(
        f"d={args.hidden}, f={args.inter}, {args.layers} MoE layers, {args.batch}×{args.block} tokens, "
        f"{'bf16 autocast' if args.bf16 else 'fp32'}, CPU ({torch_threads()} threads)"
    )
    print(
        "| model | params | step peak (MiB) | saved for backward (MiB) | of which in the MoE blocks | "
        "total peak (MiB) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        print(
            f"| {name} (h={r['moe_heads']}, E={r['num_experts']}, k={r['experts_per_token']}, "
            f"I={r['moe_intermediate_size']}) | {r['parameters']:,} | {r['step_peak'] / mib:,.0f} | "
            f"{r['saved_for_backward'] / mib:,.0f} | {r['saved_in_moe_blocks'] / mib:,.0f} | "
            f"{r['total_peak'] / mib:,.0f} |"
        )
    h3, smoe = rows["mhmoe_h3"], rows["smoe"]
    print(
        f"MH-MoE h=3 / SMoE: step peak {h3['step_peak'] / smoe['step_peak']:.2f}x, saved for backward "
        f"{h3['saved_for_backward'] / smoe['saved_for_backward']:.2f}x (in the MoE blocks "
        f"{h3['saved_in_moe_blocks'] / smoe['saved_in_moe_blocks']:.2f}x), total peak "
        f"{h3['total_peak'] / smoe['total_peak']:.2f}x"
    )
    return 0


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    sys.exit(main())
