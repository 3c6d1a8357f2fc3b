"""What the checkpoint manifest (every file's size and SHA-256, src/mhmoe/training/manifest.py) adds to a checkpoint.

Trains the demo's default model (the MH-MoE + MoH model `mhmoe-demo` trains on CPU: hidden 128, 4 layers, 8 experts,
vocabulary 4096, blocks of 128, batch 16) with `mhmoe.training.train` for `--steps` steps, a checkpoint every 2 steps,
and times every call of `save_checkpoint` (the time training waits for a checkpoint: Accelerate's state, tokenizer,
config, state file, the loss plot with `--plot`, the default) and the whole run, in three variants run alternately:

- `manifest`: as mhmoe-train writes checkpoints: each file Accelerate writes is hashed and flushed in background
  threads once written; the rest is hashed, the manifest written and the folder renamed in a background thread while
  training goes on (`checkpoints._complete`);
- `manifest in line`: the same, but the program waits for the manifest and the rename (no background completion);
- `before`: every file flushed to disk in line, no hashing, no manifest: what a checkpoint cost before the manifest.

Prints, per plot setting and variant, the median checkpoint time over all checkpoints and the median run time, with
the ratio to `before`.

    python benchmarks/studies/checkpoint_hash.py [--steps 24] [--pairs 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))


class FlushOnly:
    """The checkpoint's files flushed to disk, as before the manifest: no hashing."""

    def __init__(self, folder: str):
        self.folder = folder

    def hashing_writes(self):
        import contextlib

        return contextlib.nullcontext()

    def close(self) -> None:
        pass

    def finish(self) -> None:
        from mhmoe._plumbing.checkpoint_files import fsync

        for root, _, names in os.walk(self.folder):
            for name in names:
                fsync(os.path.join(root, name))
            fsync(root)


class InLine:
    """An executor that runs what is submitted at once (the completion of a checkpoint in line)."""

    def submit(self, fn, *args):
        from concurrent.futures import Future

        future = Future()
        future.set_result(fn(*args))
        return future


VARIANTS = ("manifest", "manifest in line", "before")


def run_once(root: str, data: tuple[str, str], tokenizer: str, config: str, steps: int, plot: bool, variant: str):
    import mhmoe.training.checkpoints as checkpoints
    import mhmoe.training.loop as loop
    from mhmoe.training.prepare import reset_accelerate_state

    times = []
    real = loop.save_checkpoint, checkpoints.Sealer, checkpoints._COMPLETER

    def timed(*args, **kwargs):
        start = time.perf_counter()
        real[0](*args, **kwargs)
        times.append(time.perf_counter() - start)

    loop.save_checkpoint = timed
    if variant != "manifest":
        checkpoints._COMPLETER = InLine()
    if variant == "before":
        checkpoints.Sealer = FlushOnly
    out = os.path.join(root, f"{variant}-{plot}-{time.time_ns()}".replace(" ", "_"))
    try:
        reset_accelerate_state()
        start = time.perf_counter()
        loop.train(
            dict(
                model_name_or_path=config,
                tokenizer_name_or_path=tokenizer,
                train_file=[data[0]],
                output_dir=out,
                block_size=128,
                per_device_train_batch_size=16,
                max_steps=steps,
                save_steps=2,
                learning_rate=3e-3,
                warmup_steps=1,
                disable_tqdm=True,
                plot=plot,
                seed=0,
            )
        )
        run_seconds = time.perf_counter() - start
    finally:
        loop.save_checkpoint, checkpoints.Sealer, checkpoints._COMPLETER = real
    size = sum(
        os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(os.path.join(out, "checkpoint-2")) for n in ns
    )
    shutil.rmtree(out)
    return times, run_seconds, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()

    import torch

    from mhmoe.demo import demo_config
    from mhmoe.recovery_demo import write_corpus
    from mhmoe.training.data import read_files, train_tokenizer

    torch.set_num_threads(2)
    root = tempfile.mkdtemp(prefix="checkpoint-hash-")
    try:
        data = write_corpus(os.path.join(root, "data"))
        tokenizer = os.path.join(root, "tokenizer")
        train_tokenizer(read_files([data[0]]), 4096, 128).save_pretrained(tokenizer)
        config = os.path.join(root, "config.json")
        demo_config("default", 4096, 128).to_json_file(config)
        results, runs = {}, {}
        for plot in (True, False):
            for pair in range(args.pairs):
                order = VARIANTS[pair % 3 :] + VARIANTS[: pair % 3]  # rotated
                for variant in order:
                    times, seconds, size = run_once(root, data, tokenizer, config, args.steps, plot, variant)
                    results.setdefault((plot, variant), []).extend(times)
                    runs.setdefault((plot, variant), []).append(seconds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"torch {torch.__version__}, demo default model, checkpoint {size / 1e6:.1f} MB, {args.steps} steps x "
        f"{args.pairs} runs per variant, a checkpoint every 2 steps; load average {os.getloadavg()[0]:.2f}"
    )
    for plot in (True, False):
        before = statistics.median(results[(plot, "before")])
        before_run = statistics.median(runs[(plot, "before")])
        for variant in VARIANTS:
            checkpoint = statistics.median(results[(plot, variant)])
            run = statistics.median(runs[(plot, variant)])
            setting = "--plot (default)" if plot else "--no_plot"
            print(
                f"{setting:>16} {variant:>16}: checkpoint {1000 * checkpoint:6.1f} "
                f"ms (x{checkpoint / before:.3f}, {1000 * (checkpoint - before):+6.1f} ms), run {run:6.2f} s "
                f"(x{run / before_run:.3f})"
            )


if __name__ == "__main__":
    main()
