"""End-to-end demo, offline on CPU: MH-MoE + MoH trained, reloaded; LLaMA -> MoH recovery; lm-eval.

Run `python -m mhmoe.demo` (or `mhmoe-demo`; `--quick` is a smoke run of about a minute). Every stage reuses the
library's own pieces: `mhmoe.training` (the one training loop; it trains the tokenizer too), the Auto classes,
`mhmoe.evaluation` (expert/head load heat-maps, lm-eval) and `mhmoe.recovery_demo` (dense LLaMA -> MoH
continue-tuning). It sits at the top of the package because it runs every job. The corpus is the Python stdlib's `pydoc_data.topics` (~465K characters of English reference
text; every 10th topic held out), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# torch, Transformers and the library's jobs are imported where they are used: `--help` and a usage error print at once

PROMPT = 'The "if" statement is used'

# "default" for the demo, "quick" for tests. 4 attention heads, 2 shared + 1 of 2 routed active: MoH at 75% heads.
MODEL_SIZES = {
    "default": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        moe_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
    ),
    "quick": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        moe_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
    ),
}


def demo_config(size: str, vocab_size: int, block_size: int):
    """An MH-MoE model whose attention is MoH (learned two-stage router), with both balance losses on."""
    from .models.mhmoe.configuration_mhmoe import MHMoEConfig

    return MHMoEConfig(
        vocab_size=vocab_size,
        max_position_embeddings=block_size,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        moh_shared_heads=2,
        moh_active_heads=1,
        moh_router="learned",  # the paper's from-scratch router with soft gates (the defaults: its continue-tuning)
        moh_straight_through=False,
        output_router_logits=True,
        **MODEL_SIZES[size],
    )


def train_model(args, data_dir: Path, out: Path):
    """Write the config JSON and train from it with `mhmoe.training` (which trains the BPE tokenizer on the data)."""
    from .recovery_demo import write_corpus
    from .training.loop import train
    from .training.prepare import reset_accelerate_state

    train_file, val_file = write_corpus(str(data_dir))
    config_path = out / "mhmoe_moh_config.json"
    demo_config("quick" if args.quick else "default", args.vocab_size, args.block_size).to_json_file(config_path)
    reset_accelerate_state()
    result = train(
        dict(
            model_name_or_path=str(config_path),
            output_dir=str(out / "model"),
            train_file=[train_file],
            validation_file=[val_file],
            block_size=args.block_size,
            per_device_train_batch_size=args.batch_size,
            per_device_eval_batch_size=32,
            max_steps=args.steps,
            learning_rate=args.lr,
            warmup_steps=max(1, args.steps // 20),
            eval_at_start=True,
            eval_steps=max(1, args.steps // 4),
            seed=args.seed,
            overwrite_output_dir=True,
        )
    )
    return result, train_file, val_file


def reload_and_check(model_dir: Path, trained, val_blocks):
    """Reload through the Auto classes; the reloaded model must give the trained model's logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=False).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    with torch.no_grad():
        diff = (model(val_blocks[:2]).logits - trained.eval()(val_blocks[:2]).logits).abs().max().item()
    if diff > 1e-5:
        raise RuntimeError(f"the reloaded model's logits differ from the trained model's by {diff:.2e}")
    return model, tokenizer, diff


def generate_sample(model, tokenizer, prompt: str = PROMPT, max_new_tokens: int = 40) -> str:
    inputs = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def lm_eval_perplexity(model_dir: Path, val_file: str, block_size: int, limit: int | None) -> dict:
    """lm-eval's rolling log-likelihood on the held-out topics (`mhmoe_ppl_wikipedia` on a local file)."""
    from .evaluation.lm_eval_model import ROUTING_KEY, MHMoELM
    from .evaluation.suites import simple_evaluate, task_manager

    lm = MHMoELM(pretrained=str(model_dir), batch_size=8, max_length=block_size, device="cpu")
    tm = task_manager(["mhmoe_ppl"], metadata={"wikipedia_path": val_file})
    results = simple_evaluate(model=lm, tasks=["mhmoe_ppl_wikipedia"], task_manager=tm, limit=limit, bootstrap_iters=0)
    metrics = {k.split(",")[0]: v for k, v in results["results"]["mhmoe_ppl_wikipedia"].items() if "stderr" not in k}
    return {"metrics": metrics, "routing": results["config"][ROUTING_KEY]}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mhmoe-demo", description=__doc__.splitlines()[0])
    parser.error = lambda message: parser.exit(2, f"mhmoe-demo: error: {message} (see mhmoe-demo --help)\n")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 600, 40 with --quick)")
    parser.add_argument("--output_dir", default="outputs/demo", help="where data, models, plots and results go")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--vocab_size", type=int, default=None, help="BPE vocabulary (default 4096, 512 with --quick)")
    parser.add_argument("--skip_recovery", action="store_true", help="skip the dense LLaMA -> MoH recovery stage")
    parser.add_argument("--quick", action="store_true", help="tiny model and vocabulary, few steps")
    args = parser.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (40 if args.quick else 600)
    args.vocab_size = args.vocab_size if args.vocab_size is not None else (512 if args.quick else 4096)
    for name, low in (("steps", 1), ("batch_size", 1), ("block_size", 2), ("vocab_size", 259)):
        if getattr(args, name) < low:
            parser.error(f"--{name} {getattr(args, name)}: must be >= {low}")
    if not args.lr > 0:
        parser.error(f"--lr {args.lr}: must be > 0")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    from .evaluation.analysis import expert_load, head_load, plot_load
    from .recovery_demo import format_result, run_recovery_demo
    from .training.data import read_files, tokenize_and_pack

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    print("== 1. MH-MoE with MoH attention, trained from scratch with mhmoe.training")
    result, train_file, val_file = train_model(args, out / "data", out)
    evals = [r for r in result.history if "eval_ppl" in r]
    ppl_before, ppl_after = evals[0]["eval_ppl"], result.final_eval["eval_ppl"]
    print(f"held-out perplexity: {ppl_before:.1f} before training -> {ppl_after:.1f} after {args.steps} steps")

    print("== 2. save_pretrained -> AutoModelForCausalLM.from_pretrained, generate")
    model_dir = out / "model"
    val_blocks = tokenize_and_pack(read_files([val_file]), result.tokenizer, args.block_size)
    model, tokenizer, diff = reload_and_check(model_dir, result.model, val_blocks)
    print(f"reloaded {type(model).__name__} from {model_dir}: max |logit difference| = {diff:.1e}")
    sample = generate_sample(model, tokenizer)
    print(f"greedy sample (KV cache): {sample!r}")

    print("== 3. expert and head load (heat-maps)")
    batches = [val_blocks[i : i + 8] for i in range(0, min(len(val_blocks), 32), 8)]
    experts, heads = expert_load(model, batches), head_load(model, batches)
    plot_load(experts, str(out / "expert_load.png"), title="MH-MoE expert load per layer", unit="expert")
    plot_load(heads, str(out / "head_load.png"), title="MoH head load per layer", unit="head")
    print(f"expert load, layer 0: {' '.join(f'{x:.2f}' for x in experts[0].tolist())} -> {out / 'expert_load.png'}")
    print(f"head load, layer 0: {' '.join(f'{x:.2f}' for x in heads[0].tolist())} -> {out / 'head_load.png'}")

    recovery = None
    if not args.skip_recovery:
        print("== 4. dense LLaMA -> MoH (75% heads) continue-tuning recovery (MoH paper Fig. 2, small)")
        steps = dict(dense_steps=60, tune_steps=20, eval_steps=10) if args.quick else {}
        recovery = run_recovery_demo(str(out / "recovery"), seed=args.seed, control=not args.quick, **steps)
        print(format_result(recovery))

    print("== 5. lm-eval on local held-out text (mhmoe_ppl_wikipedia)")
    evaluation = lm_eval_perplexity(model_dir, val_file, args.block_size, limit=8 if args.quick else None)
    m, routing = evaluation["metrics"], evaluation["routing"]
    print(
        f"lm-eval: token perplexity {m['token_perplexity']:.1f}, word perplexity {m['word_perplexity']:.1f}, "
        f"bits per byte {m['bits_per_byte']:.3f}; activated heads {routing['activated_heads_pct']:.0f}%, "
        f"expert load entropy {routing['expert_load_entropy']:.2f}"
    )
    print(
        f"same from the shell: mhmoe-eval --model_args pretrained={model_dir},max_length={args.block_size} "
        f"--tasks mhmoe_ppl_wikipedia --metadata '{json.dumps({'wikipedia_path': val_file})}'"
    )

    elapsed = time.perf_counter() - start
    print(f"done in {elapsed:.0f} s; everything is in {out}")
    summary = dict(
        ppl_before=ppl_before,
        ppl_after=ppl_after,
        max_logit_diff=diff,
        sample=sample,
        expert_load=experts.tolist(),
        head_load=heads.tolist(),
        lm_eval=evaluation,
        recovery=recovery,
        seconds=elapsed,
    )
    (out / "demo_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


if __name__ == "__main__":
    main()
