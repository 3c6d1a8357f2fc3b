"""End-to-end MH-MoE demo, offline on CPU: corpus -> tokenizer -> model -> train -> save -> reload -> generate.

Run `python -m mhmoe.demo` (or `mhmoe-demo`); `--quick` is a seconds-long smoke run. Every step is a function so that
later demos (MoH, fine-tuning, lm-eval) can reuse them. The corpus is the Python stdlib's `pydoc_data.topics`
(~465K characters of English reference text), so nothing is downloaded.
"""

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, get_cosine_schedule_with_warmup

import mhmoe  # noqa: F401  (registers model_type "mhmoe" with the Auto classes)
from mhmoe import MHMoEConfig, MHMoEForCausalLM

PAD, BOS, EOS = "<pad>", "<s>", "</s>"  # ids 0, 1, 2: MHMoEConfig's default bos/eos ids
PROMPT = "The \"if\" statement is used"

# model size: "default" for the demo, "quick" for tests (seconds)
MODEL_SIZES = {
    "default": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                    moe_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128),
    "quick": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  moe_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
}  # fmt: skip


def load_corpus(every: int = 10) -> tuple[list[str], list[str]]:
    """pydoc topics sorted by name; every `every`-th topic is held out for validation (whole documents)."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    train = [topics[n] for i, n in enumerate(names) if i % every != every // 2]
    valid = [topics[n] for i, n in enumerate(names) if i % every == every // 2]
    return train, valid


def train_tokenizer(texts: list[str], vocab_size: int = 4096, model_max_length: int = 512) -> PreTrainedTokenizerFast:
    """Byte-level BPE (lossless on any text) that prepends <s>, wrapped as a Transformers fast tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, model_max_length=model_max_length, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )


def pack(tokenizer, texts: list[str], block_size: int) -> torch.Tensor:
    """Concatenate `<s> text </s>` documents and cut them into (num_blocks, block_size) ids (the tail is dropped)."""
    ids = []
    for doc in tokenizer(texts, verbose=False)["input_ids"]:
        ids.extend(doc + [tokenizer.eos_token_id])
    num_blocks = len(ids) // block_size
    return torch.tensor(ids[: num_blocks * block_size]).view(num_blocks, block_size)


def build_model(tokenizer, block_size: int, size: str = "default", **overrides) -> MHMoEForCausalLM:
    """A small MH-MoE whose every layer is an MoE layer, trained with the load-balancing loss."""
    fields = dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=block_size,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        decoder_sparse_step=1,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        **MODEL_SIZES[size],
    )
    fields.update(overrides)
    return MHMoEForCausalLM(MHMoEConfig(**fields))


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor, batch_size: int = 16) -> float:
    """exp(mean next-token cross-entropy) over all blocks, without the router losses."""
    model.eval()
    total, count = 0.0, 0
    for batch in blocks.split(batch_size):
        logits = model(input_ids=batch, output_router_logits=False).logits
        total += F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
        count += batch[:, 1:].numel()
    return math.exp(total / count)


def train(model, blocks: torch.Tensor, steps: int, batch_size: int = 16, lr: float = 3e-3, seed: int = 0) -> list[float]:
    """AdamW with linear warmup + cosine decay on random batches of packed blocks; returns the LM loss per step."""
    cfg = model.config
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = get_cosine_schedule_with_warmup(optimizer, max(1, steps // 10), steps)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    progress = tqdm(range(steps), desc="train", mininterval=1.0)
    for _ in progress:
        batch = blocks[torch.randint(len(blocks), (batch_size,), generator=generator)]
        out = model(input_ids=batch, labels=batch)  # loss = LM loss + weighted router losses
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        lm_loss, postfix = out.loss.item(), {}
        if out.aux_loss is not None:  # report the LM loss alone, and the load-balancing loss beside it
            lm_loss -= cfg.router_aux_loss_coef * out.aux_loss.item() + cfg.router_z_loss_coef * out.z_loss.item()
            postfix["aux"] = f"{out.aux_loss.item():.3f}"
        losses.append(lm_loss)
        progress.set_postfix(loss=f"{lm_loss:.3f}", **postfix)
    model.eval()
    return losses


def save_and_reload(model, tokenizer, output_dir: str | Path):
    """save_pretrained (safetensors) then reload through the Auto classes, as a user without this script would."""
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return AutoModelForCausalLM.from_pretrained(output_dir).eval(), AutoTokenizer.from_pretrained(output_dir)


@torch.no_grad()
def max_logit_difference(model_a, model_b, input_ids: torch.Tensor) -> float:
    return (model_a(input_ids=input_ids).logits - model_b(input_ids=input_ids).logits).abs().max().item()


@torch.no_grad()
def generate_sample(model, tokenizer, prompt: str = PROMPT, max_new_tokens: int = 40) -> str:
    """Greedy decoding with the KV cache; returns the prompt and its continuation."""
    inputs = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True)
    return tokenizer.decode(out[0], skip_special_tokens=True)


@torch.no_grad()
def expert_load(model, blocks: torch.Tensor, layer: int = 0) -> torch.Tensor:
    """Fraction of the top-k assignments each expert of the `layer`-th MoE layer receives on `blocks`."""
    logits = model(input_ids=blocks, output_router_logits=True).router_logits[layer]  # (B·T·h, E)
    chosen = logits.topk(model.config.num_experts_per_tok, dim=-1).indices
    counts = torch.bincount(chosen.flatten(), minlength=model.config.num_experts).float()
    return counts / counts.sum()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mhmoe.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 600, 30 with --quick)")
    parser.add_argument("--output_dir", default="outputs/demo", help="where the model and tokenizer are saved")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--vocab_size", type=int, default=None, help="BPE vocabulary (default 4096, 512 with --quick)")
    parser.add_argument("--quick", action="store_true", help="tiny model, small vocabulary, few steps (seconds)")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    steps = args.steps if args.steps is not None else (30 if args.quick else 600)
    vocab_size = args.vocab_size if args.vocab_size is not None else (512 if args.quick else 4096)
    torch.manual_seed(args.seed)
    start = time.perf_counter()

    train_texts, valid_texts = load_corpus()
    tokenizer = train_tokenizer(train_texts, vocab_size, model_max_length=args.block_size)
    train_blocks = pack(tokenizer, train_texts, args.block_size)
    valid_blocks = pack(tokenizer, valid_texts, args.block_size)
    print(f"corpus: {len(train_texts)} train / {len(valid_texts)} held-out pydoc topics; tokenizer vocab {len(tokenizer)}; "
          f"{train_blocks.numel():,} train / {valid_blocks.numel():,} held-out tokens in blocks of {args.block_size}")

    model = build_model(tokenizer, args.block_size, "quick" if args.quick else "default")
    cfg = model.config
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters; {cfg.num_hidden_layers} layers, "
          f"hidden {cfg.hidden_size}, moe_heads {cfg.moe_heads}, {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}")

    ppl_before = perplexity(model, valid_blocks)
    print(f"held-out perplexity before training: {ppl_before:.1f}")
    losses = train(model, train_blocks, steps, args.batch_size, args.lr, args.seed)
    ppl_after = perplexity(model, valid_blocks)
    print(f"held-out perplexity after {steps} steps: {ppl_after:.1f} (train loss {losses[0]:.2f} -> {losses[-1]:.2f})")

    reloaded, reloaded_tokenizer = save_and_reload(model, tokenizer, args.output_dir)
    diff = max_logit_difference(model, reloaded, valid_blocks[:2])
    if diff > 1e-5:
        raise RuntimeError(f"the reloaded model's logits differ from the trained model's by {diff:.2e}")
    files = sorted(p.name for p in Path(args.output_dir).iterdir())
    print(f"saved to {args.output_dir}: {', '.join(files)}")
    print(f"reloaded with AutoModelForCausalLM as {type(reloaded).__name__}: max |logit difference| = {diff:.2e}")

    sample = generate_sample(reloaded, reloaded_tokenizer)
    print(f"greedy sample: {sample!r}")
    load = expert_load(reloaded, valid_blocks[:8])
    print("expert load, MoE layer 0 (share of top-k sub-token assignments): " + " ".join(f"{x:.2f}" for x in load.tolist()))
    elapsed = time.perf_counter() - start
    print(f"done in {elapsed:.0f} s")
    return dict(ppl_before=ppl_before, ppl_after=ppl_after, losses=losses, max_logit_diff=diff, sample=sample,
                expert_load=load, files=files, seconds=elapsed)  # fmt: skip


if __name__ == "__main__":
    main()
