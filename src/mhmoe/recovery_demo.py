"""End-to-end continue-tuning proof on CPU: dense LLaMA -> MoH at 75% heads -> recovered perplexity (Fig. 2, small).

No real LLaMA weights can be downloaded here, so the parent is trained here: a tiny dense `LlamaForCausalLM` learns the
Python documentation topics that ship with the standard library (`pydoc_data.topics`; every 10th topic held out for
validation) until it is far better than chance. It is then converted with `mhmoe.convert`, the paper's recipe (first half of the heads
shared, 75% of all heads active per token, l2 router, straight-through gates) and continue-tuned with `mhmoe.training`
(warmup + cosine to a final LR, weight decay 0.1, clipping 1.0, MoH balance loss β=0.01). The claim checked: held-out
perplexity of the MoH model <= 1.05 × the dense parent's.

Control (on by default): the dense parent continue-tuned with exactly the same data, budget and schedule. If that
control improves as much, the "recovery" partly reflects extra training of an unconverged parent; the report prints
both.

`run_recovery_demo(workdir, ...)` returns the numbers; `python conversion/demo_recovery.py` prints them.
"""

from __future__ import annotations

import json
import math
import os
import time

from .convert.recipe import ACTIVE_HEADS_RATIO, SHARED_HEADS_RATIO


def stdlib_sources() -> list[str]:
    """The Python standard library's own modules (.py, without tests and IDLE): ~11 MB of code and docstrings."""
    import glob
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    skip = (os.sep + "test", os.sep + "idlelib" + os.sep, "site-packages", os.sep + "tests" + os.sep)
    texts = []
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        if any(part in path[len(root) :] for part in skip):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if text.strip():
            texts.append(text)
    return texts


def write_corpus(directory: str, held_out_every: int = 10, stdlib: bool = False) -> tuple[str, str]:
    """train.jsonl / val.jsonl from `pydoc_data.topics` (one topic per record), with `stdlib` also the standard
    library's modules (one per record); every `held_out_every`-th document of each source is held out."""
    import pydoc_data.topics

    sources = [[pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics)]]
    if stdlib:
        sources.append(stdlib_sources())
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, held_out in (("train", False), ("val", True)):
        path = os.path.join(directory, f"{name}.jsonl")
        with open(path, "w") as f:
            for documents in sources:
                for i, text in enumerate(documents):
                    if (i % held_out_every == 0) == held_out:
                        f.write(json.dumps({"text": text}) + "\n")
        paths.append(path)
    return paths[0], paths[1]


def run_recovery_demo(
    workdir: str,
    *,
    vocab_size: int = 384,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 8,
    num_key_value_heads: int = 4,
    block_size: int = 32,
    batch_size: int = 16,
    dense_steps: int = 300,
    dense_lr: float = 3e-3,
    tune_steps: int = 60,
    tune_lr: float = 1e-3,
    tune_min_lr: float = 1e-4,
    tune_warmup: int = 10,
    eval_steps: int = 20,
    shared_heads_ratio: float = SHARED_HEADS_RATIO,
    active_heads_ratio: float = ACTIVE_HEADS_RATIO,
    stdlib: bool = False,
    control: bool = True,
    seed: int = 0,
    progress: bool = False,
    data_files: tuple[str, str] | None = None,
) -> dict:
    """Train a dense parent, convert it, continue-tune it (and, with `control`, the dense parent alike); return the
    perplexities. Everything is written under `workdir` (dense/, moh/, dense_continued/). `data_files`: (train,
    validation) JSONL/text files instead of the standard-library corpus; the tokenizer is trained on the first."""
    import torch
    from transformers import LlamaForCausalLM

    from .training.data import read_files, train_tokenizer
    from .training.prepare import reset_accelerate_state

    started = time.time()
    train_file, val_file = data_files or write_corpus(os.path.join(workdir, "data"), stdlib=stdlib)
    tokenizer = train_tokenizer(read_files([train_file]), vocab_size, 4 * block_size)
    common = _training_settings(train_file, val_file, block_size, batch_size, seed, progress)

    # 1. the dense parent
    torch.manual_seed(seed)
    config = _parent_config(
        tokenizer,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=4 * block_size,
    )
    dense_dir = os.path.join(workdir, "dense")
    dense_ppl = _train_dense_parent(LlamaForCausalLM(config), tokenizer, common, dense_dir, dense_steps, dense_lr)

    # 2. convert + continue-tune (the converter's own code path)
    tune = dict(
        common,
        max_steps=tune_steps,
        learning_rate=tune_lr,
        min_learning_rate=tune_min_lr,
        warmup_steps=tune_warmup,
        eval_steps=eval_steps,
        eval_at_start=True,
    )
    moh_dir = os.path.join(workdir, "moh")
    outcome = _convert_and_tune(dense_dir, moh_dir, tune, shared_heads_ratio, active_heads_ratio, progress)

    # 3. control: the dense parent continue-tuned the same way
    control_ppl = _continue_dense(tune, dense_dir, os.path.join(workdir, "dense_continued")) if control else None
    reset_accelerate_state()

    tokens_per_step = batch_size * block_size
    figures = {"dense_ppl": dense_ppl, **_moh_figures(outcome, dense_ppl), "dense_continued_ppl": control_ppl}
    tokens = {"dense_tokens": dense_steps * tokens_per_step, "tune_tokens": tune_steps * tokens_per_step}
    return _write_record(workdir, vocab_size, figures, outcome["conversion"], tokens, started)


def _write_record(workdir: str, vocab_size: int, figures: dict, conversion, tokens: dict, started: float) -> dict:
    """recovery_demo.json in `workdir`: the perplexities, the heads, the tokens trained and the time taken."""
    result = {
        "chance_ppl": float(vocab_size),
        **figures,
        "active_heads": f"{conversion.active_heads}/{conversion.num_heads}",
        **tokens,
        "seconds": round(time.time() - started, 1),
        "workdir": os.path.basename(os.path.abspath(workdir)),  # its name: the record never holds a local path
    }
    with open(os.path.join(workdir, "recovery_demo.json"), "w") as f:
        json.dump(result, f, indent=2)
    return result


def _training_settings(
    train_file: str, val_file: str, block_size: int, batch_size: int, seed: int, progress: bool
) -> dict:
    """The `mhmoe.training` settings the dense parent, the continue-tuning and the control share."""
    return dict(
        train_file=[train_file],
        validation_file=[val_file],
        block_size=block_size,
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=32,
        seed=seed,
        disable_tqdm=not progress,
        plot=False,
        weight_decay=0.1,
        max_grad_norm=1.0,
    )


def _parent_config(tokenizer, **sizes):
    """The dense parent's `LlamaConfig`: `sizes` (LlamaConfig's own field names), the tokenizer's BOS / EOS ids,
    untied embeddings."""
    from transformers import LlamaConfig

    return LlamaConfig(
        **sizes,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )


def _convert_and_tune(
    dense_dir: str, moh_dir: str, tune: dict, shared_heads_ratio: float, active_heads_ratio: float, progress: bool
) -> dict:
    """The dense parent converted with the paper's recipe and continue-tuned by `mhmoe-convert`'s own code path;
    `convert_and_continue_tune`'s outcome."""
    from .convert.arguments import ConvertArguments
    from .convert.continue_tune import continue_tune_arguments, convert_and_continue_tune
    from .training.prepare import reset_accelerate_state

    reset_accelerate_state()
    return convert_and_continue_tune(
        ConvertArguments(
            input_dir=dense_dir,
            output_dir=moh_dir,
            shared_heads_ratio=shared_heads_ratio,
            active_heads_ratio=active_heads_ratio,
            overwrite=True,
            recipe="paper",
        ),
        continue_tune_arguments(**tune),
        progress=progress,
    )


def _moh_figures(outcome: dict, dense_ppl: float) -> dict:
    """The converted model's perplexities from its recovery summary, and how the tuned one compares to the parent."""
    recovery = outcome["recovery"]
    return {
        "dense_ppl_all_heads_reference": recovery["dense_ppl"],  # the converted model with every head on
        "moh_ppl_before_tuning": recovery["start_ppl"],
        "moh_ppl_after_tuning": recovery["final_ppl"],
        "moh_over_dense": recovery["final_ppl"] / dense_ppl,
        "tokens_to_recover": recovery["tokens_to_recover"],
    }


def _continue_dense(tune: dict, dense_dir: str, output_dir: str) -> float:
    """The control: the dense parent trained with the continue-tuning settings; its held-out perplexity."""
    from .training.loop import train
    from .training.prepare import reset_accelerate_state

    reset_accelerate_state()
    continued = train(
        dict(tune, model_name_or_path=dense_dir, output_dir=output_dir, eval_at_start=False, overwrite_output_dir=True)
    )
    return continued.final_eval["eval_ppl"]


def _train_dense_parent(model, tokenizer, common: dict, output_dir: str, steps: int, lr: float) -> float:
    """Train the dense parent with `mhmoe.training` (warmup, cosine to lr/10); return its held-out perplexity."""
    from .training.loop import train
    from .training.prepare import reset_accelerate_state

    reset_accelerate_state()
    dense = train(
        dict(
            common,
            output_dir=output_dir,
            max_steps=steps,
            learning_rate=lr,
            warmup_steps=max(1, steps // 20),
            min_learning_rate=lr / 10,
            overwrite_output_dir=True,
        ),
        model=model,
        tokenizer=tokenizer,
    )
    return dense.final_eval["eval_ppl"]


def format_result(r: dict) -> str:
    lines = [
        f"dense parent: held-out perplexity {r['dense_ppl']:.3f} (chance {r['chance_ppl']:.0f}) after "
        f"{r['dense_tokens']:,} training tokens",
        f"converted to MoH, {r['active_heads']} heads active per token: {r['moh_ppl_before_tuning']:.3f} "
        f"(×{r['moh_ppl_before_tuning'] / r['dense_ppl']:.3f} of dense)",
        f"continue-tuned {r['tune_tokens']:,} tokens: {r['moh_ppl_after_tuning']:.3f} (×{r['moh_over_dense']:.3f} of "
        f"dense; target <= 1.05) -> {'RECOVERED' if r['moh_over_dense'] <= 1.05 else 'NOT RECOVERED'}",
    ]
    if r["tokens_to_recover"] is not None:
        lines.append(f"within 5% of dense after {r['tokens_to_recover']:,} tokens")
    if r["dense_continued_ppl"] is not None:
        lines.append(
            f"control, dense parent continue-tuned the same way: {r['dense_continued_ppl']:.3f} "
            f"(MoH / control ×{r['moh_ppl_after_tuning'] / r['dense_continued_ppl']:.3f})"
        )
    lines.append(f"({r['seconds']} s; files in {r['workdir']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=None, help="Default: a new temporary directory.")
    parser.add_argument("--dense_steps", type=int, default=300)
    parser.add_argument("--tune_steps", type=int, default=60)
    parser.add_argument("--eval_steps", type=int, default=20)
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--intermediate_size", type=int, default=256)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--num_heads", type=int, default=8)
    parser.add_argument("--num_key_value_heads", type=int, default=4)
    parser.add_argument("--vocab_size", type=int, default=384)
    parser.add_argument("--stdlib", action="store_true", help="Also train on the stdlib's modules (~11 MB).")
    parser.add_argument("--block_size", type=int, default=32)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--dense_lr", type=float, default=3e-3)
    parser.add_argument("--tune_lr", type=float, default=1e-3)
    parser.add_argument("--tune_min_lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no_control", action="store_true", help="Skip the dense continue-tuned control run.")
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="moh-recovery-")
    result = run_recovery_demo(
        workdir,
        dense_steps=args.dense_steps,
        tune_steps=args.tune_steps,
        eval_steps=args.eval_steps,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_key_value_heads=args.num_key_value_heads,
        block_size=args.block_size,
        batch_size=args.batch_size,
        dense_lr=args.dense_lr,
        tune_lr=args.tune_lr,
        tune_min_lr=args.tune_min_lr,
        seed=args.seed,
        vocab_size=args.vocab_size,
        stdlib=args.stdlib,
        control=not args.no_control,
        progress=args.progress,
    )
    print(format_result(result))
    if not math.isfinite(result["moh_over_dense"]) or result["moh_over_dense"] > 1.05:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
