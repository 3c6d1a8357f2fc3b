"""Every tuning threshold of the CPU head-sparse op (`head_sparse_attention_cpu.py`) in one frozen dataclass.

Each value was set by a measurement on one machine: the project's shared 2-core CPU (x86-64, 2 torch threads, fp32,
torch 2.13.0+cpu), unless a comment says otherwise; the comment names the benchmark and its committed output. On
another CPU, torch version or thread count the crossovers move: pass the op a policy of your own
(`head_sparse_attention_cpu(..., policy=CpuHeadSparsePolicy(short_tokens=0))`). Each path of the op has one
crossover, documented at its field. `DEFAULT_CPU_POLICY` is what the op uses when given none.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class CpuHeadSparsePolicy:
    # Decoding: up to this many query tokens a call takes the decode path (the G query heads of a key/value head
    # packed as its query rows, one SDPA call per run of needed key/value heads). Not a measured crossover: a few
    # tokens per sequence (speculative or batched decoding) are "decoding"; set with the op (89837c9).
    decode_max_tokens: int = 16

    # The CPU decoding step of a MoH model (`moh/fused_decoding.py`) reads the key/value heads by runs, one SDPA call
    # each, when the key/value heads no active head needs between those runs hold at least this many cached key rows
    # (heads × keys); else one call over the span from the first to the last needed one. Crossover: benchmarks/
    # moh_attention.py --model (16 heads, 8 shared + 4 of 8 routed, l2, static cache, 1 thread, at 92b7d57):
    # always by runs ×1.029 against ×1.006 the dense step at 1,024 keys, ×0.924 against ×0.977 at 2,048, ×0.808
    # against ×0.962 at 8,192 (benchmarks/results/moh_decode_runs.txt); ~2 skipped key/value heads a step there.
    decode_split_min_skipped_keys: int = 4096

    # Dense path (prefill without a cache, a mask or a window): a key/value head whose query heads are active on at
    # least this share of the tokens runs as one causal flash call over all its heads, its inactive pairs zeroed
    # (MoH's shared heads: share 1). Crossover: SmolLM2-135M's real gates at 7/9 heads (c9883a1; the busiest routed
    # group of a layer reaches 91% of its pairs: benchmarks/results/moh_head_sparse.md, benchmarks/moh_head_sparse.py
    # run at c9883a1, "Why the first version ... gained little"). Its removal (`--cpu_policy no_dense:dense_share=2`:
    # the shared heads through the row machinery too), quiet machine, batch 1: ×0.975 against the default's ×1.039
    # (7/9) and ×1.035 against ×1.133 (5/9) at 2,048 tokens, ×1.015 / ×1.061 and ×1.097 / ×1.194 at 4,096, control
    # ×1.032 / ×0.988 (benchmarks/results/head_sparse_cpu_paths.md, run 5): kept.
    dense_share: float = 0.8

    # Chunked path (prefill, no mask or window): T query tokens in chunks of about T / chunk_divisor tokens (a power
    # of two from chunk_min_tokens to chunk_max_tokens). The diagonal blocks (C / T of the dense work) are computed for
    # every head of a sparse key/value head; each chunk costs one prefix call. Set with the op (89837c9, 274f6e1).
    chunk_divisor: int = 8
    chunk_min_tokens: int = 64
    chunk_max_tokens: int = 256

    # Short path (inference-sized prefills under short_tokens query tokens; no cache, mask or window): a key/value head
    # active on less than short_dense_share of its pairs runs as masked rows, one call per batch row over the keys up
    # to its last active row; the others run dense. Crossover: benchmarks/studies/head_sparse_short.py
    # (benchmarks/results/head_sparse_short.txt: 2 of 6 routed heads active, batch 1, the short path ×0.771 of the
    # parent's attention at 512 tokens against ×0.961 chunked; ×0.950 against ×1.028 at 768, the chunked path ahead
    # from 1,024). On the model (benchmarks/moh_head_sparse.py --cpu_policy no_short:short_tokens=0, SmolLM2-135M at
    # 5/9, 512 tokens, batch 1): without it slower in 13 of 15 interleaved rounds, median -10%
    # (benchmarks/results/head_sparse_cpu_paths.md, run 2).
    short_tokens: int = 768
    short_dense_share: float = 0.5
    # causal masks up to this many keys are built once per (size, dtype, device) and gathered from (4 MB in fp32)
    causal_mask_cache_tokens: int = 1024

    # Whether a MoH layer takes the op at all (`moh/head_skipping.head_sparse_pays`; the CPU default backend). From
    # prefill_min_tokens query tokens always; below it the inactive heads' attention is a small share of a layer's
    # work and the op's bookkeeping costs more than it saves (6405379: benchmarks/studies/head_sparse_layer.py, one
    # SmolLM2-135M layer at 7/9 and 5/9 heads). In inference without a mask where at most few_active_share of the
    # routed heads are active (top-K) also from few_active_tokens[0] to [1] (the short path) and from [2] (the chunked
    # path); in between, the parent's kernel runs its large query blocks and the op's lead at batch 1 is within what
    # its gates and bookkeeping cost on a real model (d874add: benchmarks/studies/head_sparse_short.py,
    # benchmarks/results/head_sparse_short.txt).
    prefill_min_tokens: int = 2048
    few_active_share: float = 0.4
    few_active_tokens: tuple[int, int, int] = (384, 768, 1024)

    def chunk_tokens(self, tokens: int) -> int:
        """Query tokens per chunk of the chunked path: a power of two near T / chunk_divisor, clamped."""
        near = 1 << max(0, (tokens // self.chunk_divisor).bit_length() - 1)
        return max(self.chunk_min_tokens, min(self.chunk_max_tokens, near))


DEFAULT_CPU_POLICY = CpuHeadSparsePolicy()

__all__ = ["DEFAULT_CPU_POLICY", "CpuHeadSparsePolicy"]
