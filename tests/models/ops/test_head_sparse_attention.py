"""Head-sparse attention (ops/head_sparse_attention): the reference against the model's masked computation
(`tests/models/moh_reference.masked_heads_attention`), and the CPU path (PyTorch) and the Triton kernels (under TRITON_INTERPRET=1) against
the reference on odd shapes: outputs and the gradients of query, key, value and gates, with GQA, sliding windows,
padding masks (boolean and additive) and static caches (queries not at the end of the keys)."""

import pytest
import torch

from mhmoe.models.ops.head_sparse_attention import head_sparse_attention_cpu as cpu_path
from mhmoe.models.ops.head_sparse_attention import head_sparse_attention_triton as triton_path
from mhmoe.models.ops.head_sparse_attention.head_sparse_attention_cpu import head_sparse_attention_cpu
from mhmoe.models.ops.head_sparse_attention.head_sparse_attention_cpu_policy import (
    DEFAULT_CPU_POLICY,
    CpuHeadSparsePolicy,
)
from mhmoe.models.ops.head_sparse_attention.head_sparse_attention_naive import (
    head_sparse_attention_naive,
    visible_keys,
)
from mhmoe.models.ops.head_sparse_attention.head_sparse_attention_triton import head_sparse_attention_triton
from tests.models.moh_reference import masked_heads_attention

SCALING = 0.3


def make_inputs(
    batch,
    heads,
    kv_heads,
    tokens,
    keys,
    head_dim,
    offset=None,
    mask_kind=None,
    active=0.6,
    full_groups=(),
    dtype=torch.float64,
    seed=0,
):
    """Query (B, H, T, hd) as the model has it after RoPE (a transposed (B, T, H, hd) tensor), key/value, gates with
    ~`active` of the pairs non-zero (the heads of `full_groups` always), and a 4-D mask whose last batch row is
    left-padded (its first 3 keys hidden)."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, tokens, heads, head_dim, generator=generator, dtype=dtype).transpose(1, 2)
    key = torch.randn(batch, kv_heads, keys, head_dim, generator=generator, dtype=dtype)
    value = torch.randn(batch, kv_heads, keys, head_dim, generator=generator, dtype=dtype)
    gates = torch.rand(batch, tokens, heads, generator=generator, dtype=dtype) + 0.5
    gates = gates * (torch.rand(batch, tokens, heads, generator=generator) < active)
    groups = heads // kv_heads
    for g in full_groups:
        gates[..., g * groups : (g + 1) * groups] = 1.0
    mask = None
    if mask_kind is not None:
        start = keys - tokens if offset is None else offset
        visible = visible_keys(tokens, keys, start)[None, None].repeat(batch, 1, 1, 1)
        visible[-1, ..., :3] = False
        mask = (
            visible
            if mask_kind == "bool"
            else torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)
        )
    return query, key, value, gates, mask


def seen_rows(batch, tokens, keys, offset, window, mask) -> torch.Tensor:
    """(B, T) bool: query rows that see at least one key (the others have no defined output)."""
    start = keys - tokens if offset is None else offset
    seen = visible_keys(tokens, keys, start, window)[None].expand(batch, tokens, keys).clone()
    if mask is not None:
        seen &= mask[:, 0, :, :keys] if mask.dtype == torch.bool else mask[:, 0, :, :keys] > -1
    return seen.any(-1)


def compare(fn, inputs, offset=None, window=None, rtol=1e-10, atol=1e-10, reference_dtype=None, **kwargs):
    """fn against the reference (in `reference_dtype`, default the inputs'): outputs on rows that see a key, and the
    gradients of query, key, value and gates for an output gradient that is zero on the other rows."""
    query, key, value, gates, mask = inputs
    dtype = reference_dtype or query.dtype
    batch, _, tokens, _ = query.shape
    seen = seen_rows(batch, tokens, key.shape[2], offset, window, mask)
    leaves = [x.detach().clone().requires_grad_() for x in (query, key, value, gates)]
    ref_leaves = [x.detach().to(dtype).requires_grad_() for x in (query, key, value, gates)]
    ref_mask = mask if mask is None or mask.dtype == torch.bool else mask.to(dtype)
    got = fn(*leaves, SCALING, mask, offset, window, **kwargs)
    want = head_sparse_attention_naive(*ref_leaves, SCALING, ref_mask, offset, window)
    assert got.shape == want.shape == (batch, tokens, query.shape[1], query.shape[3])
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[seen].to(dtype), want[seen], rtol=rtol, atol=atol)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=got.dtype)
    grad = grad * seen[..., None, None]
    got.backward(grad)
    want.backward(grad.to(dtype))
    for name, have, expected in zip(["query", "key", "value", "gates"], leaves, ref_leaves):
        assert torch.isfinite(have.grad).all(), name
        torch.testing.assert_close(have.grad.to(dtype), expected.grad, rtol=rtol, atol=atol, msg=name)
    return got


# ---------------------------------------------------------------------------------------------------------------------
# the reference is the model's masked computation


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize("kv_heads", [6, 2, 1])
def test_reference_is_the_masked_computation(kv_heads, mask_kind):
    """head_sparse_attention_naive, flattened and projected, is masked_heads_attention (tests/models/moh_reference.py) given the same 4-D mask;
    with no mask it is causal by position (a static cache: the queries start at `query_offset`, later slots unused)."""
    batch, heads, tokens, keys, head_dim, offset = 2, 6, 5, 12, 4, 3
    query, key, value, gates, mask = make_inputs(
        batch, heads, kv_heads, tokens, keys, head_dim, offset, mask_kind, dtype=torch.float32
    )
    o_proj = torch.nn.Linear(heads * head_dim, 7)
    with torch.no_grad():
        ours = o_proj(head_sparse_attention_naive(query, key, value, gates, SCALING, mask, offset).flatten(2))
        masked = masked_heads_attention(query, key, value, mask, gates, o_proj, SCALING)
        seen = seen_rows(batch, tokens, keys, offset, None, mask)
        torch.testing.assert_close(ours[seen], masked[seen], rtol=1e-5, atol=1e-6)
        causal = visible_keys(tokens, keys, offset)[None, None]
        torch.testing.assert_close(
            head_sparse_attention_naive(query, key, value, gates, SCALING, None, offset).flatten(2),
            head_sparse_attention_naive(query, key, value, gates, SCALING, causal, offset).flatten(2),
        )
    assert (ours[seen] != o_proj.bias).any()


# ---------------------------------------------------------------------------------------------------------------------
# the CPU path


CHUNKED = CpuHeadSparsePolicy(short_tokens=0)  # the prefill tests' short sequences on the chunked path
SHORT = CpuHeadSparsePolicy(short_tokens=10**9, short_dense_share=0.99)  # short prefills (masked rows) at any length,
# every key/value head but the fully active ones as masked rows


TORCH_CASES = {  # (B, H, Hkv, T, L, hd, offset, window, mask, chunk, full groups)
    "decode-mha": (2, 6, 6, 1, 9, 5, None, None, None, None, ()),
    "decode-gqa-bool": (2, 6, 2, 1, 9, 5, None, None, "bool", None, ()),
    "decode-3-tokens-float": (2, 6, 3, 3, 11, 5, None, None, "float", None, ()),
    "decode-static-cache": (2, 6, 2, 1, 16, 5, 6, None, "float", None, ()),
    "decode-window": (1, 4, 2, 2, 13, 3, None, 4, None, None, ()),
    "decode-group-skipped": (1, 6, 3, 1, 9, 5, None, None, None, None, (2,)),
    "prefill-gqa-shared": (2, 9, 3, 37, 37, 6, None, None, None, 8, (0,)),
    "prefill-gqa-shared-middle": (2, 9, 3, 37, 37, 6, None, None, None, 8, (1,)),
    "prefill-mha": (1, 6, 6, 29, 29, 4, None, None, None, 8, ()),
    "prefill-odd-chunk": (2, 6, 2, 33, 33, 5, None, None, None, 7, (0,)),
    "prefill-after-cache": (2, 6, 2, 33, 40, 5, None, None, None, 8, (0,)),
    "prefill-after-cache-one-chunk": (2, 6, 2, 33, 40, 5, None, None, None, None, (0,)),  # masked rows after a cache
    "prefill-static-cache": (2, 6, 2, 33, 48, 5, 0, None, None, 8, (1,)),
    "prefill-static-cache-offset": (2, 6, 2, 21, 48, 5, 9, None, "float", 8, ()),
    "prefill-window": (2, 6, 2, 37, 37, 5, None, 7, None, 8, (0,)),
    "prefill-bool-padding": (2, 6, 3, 37, 41, 5, None, None, "bool", 8, (0,)),
    "prefill-float-window": (2, 6, 2, 37, 41, 5, None, 5, "float", 8, ()),
    "prefill-default-chunk": (1, 9, 3, 150, 150, 4, None, None, None, None, (0,)),
    "prefill-shared-odd-length": (1, 9, 3, 263, 263, 4, None, None, None, 32, (0,)),
}


PATHS = [  # every case; the prefills also as short prefills (masked rows)
    pytest.param(case, path, id=f"{name}-{path}")
    for name, case in TORCH_CASES.items()
    for path in (["chunked", "short"] if case[3] > DEFAULT_CPU_POLICY.decode_max_tokens else ["decode"])
]


@pytest.mark.parametrize("case, path", PATHS)
def test_cpu_path_matches_reference(case, path):
    batch, heads, kv_heads, tokens, keys, head_dim, offset, window, mask_kind, chunk, full = case
    inputs = make_inputs(batch, heads, kv_heads, tokens, keys, head_dim, offset, mask_kind, full_groups=full)
    compare(
        head_sparse_attention_cpu,
        inputs,
        offset,
        window,
        chunk_size=chunk,
        policy=SHORT if path == "short" else CHUNKED,
    )


@pytest.fixture
def flash_calls(monkeypatch) -> list:
    """The CPU path's flash-attention calls, recorded as they run: (query shape, key shape, causal) each."""
    calls = []
    original = cpu_path._flash

    def spy(query, key, value, mask, scaling, causal=False):
        calls.append((tuple(query.shape), tuple(key.shape), causal))
        return original(query, key, value, mask, scaling, causal)

    monkeypatch.setattr(cpu_path, "_flash", spy)
    return calls


def test_cpu_path_prefill_computes_only_active_rows(flash_calls):
    """The flash calls of a prefill see the active rows only, outside the diagonal blocks: a fully active key/value
    head is one causal call over its heads, the diagonal blocks one call, and each (batch row, key/value head, chunk)
    after the first chunk one call of its active rows against the keys before its chunk."""
    calls = flash_calls
    batch, heads, kv_heads, tokens, chunk = 2, 9, 3, 64, 16
    query, key, value, gates, _ = make_inputs(batch, heads, kv_heads, tokens, tokens, 4, full_groups=(0,))
    with torch.no_grad():
        out = head_sparse_attention_cpu(query, key, value, gates, SCALING, chunk_size=chunk, policy=CHUNKED)
    torch.testing.assert_close(out, head_sparse_attention_naive(query, key, value, gates, SCALING))
    dense, prefix, diagonal = calls[0], calls[1:-1], calls[-1]
    assert dense == ((batch, 3, tokens, 4), (batch, 1, tokens, 4), True)  # the shared heads' key/value head
    assert diagonal == ((batch * tokens // chunk, 6, chunk, 4), (batch * tokens // chunk, 2, chunk, 4), True)
    assert all(key_shape[2] % chunk == 0 and not causal for _, key_shape, causal in prefix)
    assert len(prefix) == batch * 2 * (tokens // chunk - 1)
    assert sum(shape[2] for shape, _, _ in prefix) == int((gates[:, chunk:, 3:] != 0).sum())  # rows with a prefix


def test_cpu_path_nearly_dense_group_runs_dense(flash_calls):
    """A key/value head whose query heads are active on at least the policy's dense_share of the tokens runs as causal attention
    over all its heads (with the fully active group beside it: one call), its inactive pairs zeroed: outputs and
    gradients equal the reference, for soft gates and for 0/1 gates without gradient (where the gates' multiply is
    skipped, so the op itself must pass no gradient through the zeroed pairs)."""
    query, key, value, gates, _ = make_inputs(2, 9, 3, 70, 70, 4, full_groups=(0,))
    generator = torch.Generator().manual_seed(5)
    nearly = (torch.rand(2, 70, 3, generator=generator) < 0.93).to(gates.dtype)
    gates[..., 3:6] = nearly * (torch.rand(2, 70, 3, generator=generator, dtype=gates.dtype) + 0.5)
    assert CHUNKED.dense_share <= float((gates[..., 3:6] != 0).float().mean()) < 1
    compare(head_sparse_attention_cpu, (query, key, value, gates, None), chunk_size=16, policy=CHUNKED)
    assert (flash_calls[0][0], flash_calls[0][2]) == ((2, 6, 70, 4), True)  # key/value heads 0 and 1 together
    binary = (gates != 0).to(gates.dtype)
    leaves = [x.detach().clone().requires_grad_() for x in (query, key, value)]
    ref_leaves = [x.detach().clone().requires_grad_() for x in (query, key, value)]
    got = head_sparse_attention_cpu(*leaves, binary, SCALING, chunk_size=16, policy=CHUNKED)
    want = head_sparse_attention_naive(*ref_leaves, binary, SCALING)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert (got[binary == 0] == 0).all()
    grad = torch.randn(got.shape, generator=generator, dtype=got.dtype)
    got.backward(grad)
    want.backward(grad)
    for name, have, expected in zip(["query", "key", "value"], leaves, ref_leaves):
        torch.testing.assert_close(have.grad, expected.grad, rtol=1e-10, atol=1e-10, msg=name)


def test_short_prefill_runs_sparse_groups_as_masked_rows(flash_calls):
    """Short prefills: a key/value head active on less than the policy's short_dense_share of its pairs is one masked call per
    batch row, its active rows against the keys up to its last active row; the others are causal calls over all their
    heads. Outputs and gradients equal the reference."""
    policy = CpuHeadSparsePolicy(short_tokens=10**9, short_dense_share=0.5)
    batch, tokens = 2, 70
    query, key, value, gates, _ = make_inputs(batch, 9, 3, tokens, tokens, 4, full_groups=(0,))
    generator = torch.Generator().manual_seed(3)
    for heads, share in ((slice(3, 6), 0.3), (slice(6, 9), 0.7)):
        on = torch.rand(batch, tokens, 3, generator=generator) < share
        gates[..., heads] = on * (torch.rand(batch, tokens, 3, generator=generator, dtype=gates.dtype) + 0.5)
    gates[1, 60:, 3:6] = 0  # batch row 1's last active row of key/value head 1 comes earlier
    densities = (gates != 0).view(batch, tokens, 3, 3).double().mean(dim=(0, 1, 3))
    assert densities[1] < policy.short_dense_share <= densities[2] < 1
    compare(head_sparse_attention_cpu, (query, key, value, gates, None), policy=policy)
    assert flash_calls[:2] == [((batch, 3, tokens, 4), (batch, 1, tokens, 4), True)] * 2  # key/value heads 0 and 2
    masked = flash_calls[2:]
    assert len(masked) == batch
    for b, (query_shape, key_shape, causal) in enumerate(masked):
        active = gates[b, :, 3:6] != 0
        last = int(active.any(-1).nonzero().max())
        assert query_shape == (1, 1, int(active.sum()), 4) and key_shape == (1, 1, last + 1, 4) and not causal
    assert masked[1][1][2] <= 60


def test_cpu_path_decode_reads_only_needed_key_value_heads(monkeypatch):
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        calls.append(tuple(key.shape))
        return original(query, key, value, **kwargs)

    monkeypatch.setattr(cpu_path.F, "scaled_dot_product_attention", spy)
    query, key, value, _, _ = make_inputs(2, 6, 3, 1, 10, 4)
    gates = torch.zeros(2, 1, 6, dtype=query.dtype)
    gates[0, 0, [0, 1]] = 1  # key/value head 0
    gates[1, 0, 5] = 0.5  # key/value head 2
    with torch.no_grad():
        out = head_sparse_attention_cpu(query, key, value, gates, SCALING)
    assert calls == [(2, 1, 10, 4), (2, 1, 10, 4)]  # heads 0 and 2, never 1
    want = head_sparse_attention_naive(query, key, value, gates, SCALING)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


def test_cpu_path_off_the_cpu_is_the_reference(monkeypatch):
    """Off the CPU (no CPU flash kernel) a prefill is the naive reference."""
    calls = []
    monkeypatch.setattr(cpu_path, "_reference", lambda *args: calls.append(args) or "reference")
    query, key, value, gates, _ = make_inputs(1, 6, 2, 20, 20, 4, dtype=torch.float32)
    meta = [x.to("meta") for x in (query, key, value, gates)]
    assert head_sparse_attention_cpu(*meta, SCALING) == "reference" and len(calls) == 1


def test_cpu_path_fp32_and_bf16():
    inputs = make_inputs(2, 9, 3, 40, 40, 8, full_groups=(0,), dtype=torch.float32)
    kwargs = dict(reference_dtype=torch.float64, chunk_size=16, policy=CHUNKED)
    compare(head_sparse_attention_cpu, inputs, rtol=1e-5, atol=1e-5, **kwargs)
    inputs = [x.to(torch.bfloat16) if x is not None else None for x in inputs]
    compare(head_sparse_attention_cpu, inputs, rtol=0.05, atol=0.05, **kwargs)


@pytest.mark.parametrize("fn", [head_sparse_attention_cpu, head_sparse_attention_triton], ids=["torch", "triton"])
@pytest.mark.parametrize("tokens", [1, 3, 30])
def test_binary_gates_at_inference(fn, tokens):
    """0/1 gates without gradient (straight-through gates at inference), where the gates' multiply is skipped: the
    inactive pairs are still 0 (decoding computes inactive heads of needed key/value heads: they must be zeroed)."""
    if fn is head_sparse_attention_triton and not triton_path.HAS_TRITON:
        pytest.skip("triton is not installed")
    query, key, value, gates, _ = make_inputs(2, 9, 3, tokens, 40, 8, dtype=torch.float32, full_groups=(0,))
    gates = (gates != 0).float()
    with torch.no_grad():
        got = fn(query, key, value, gates, SCALING)
    want = head_sparse_attention_naive(query, key, value, gates, SCALING)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got[gates == 0] == 0).all()


@pytest.mark.parametrize("tokens", [1, 30])
def test_no_active_pair_gives_zeros_and_no_gradient(tokens):
    query, key, value, gates, _ = make_inputs(1, 6, 2, tokens, 30, 4, active=0.0)
    leaves = [x.clone().requires_grad_() for x in (query, key, value, gates)]
    out = head_sparse_attention_cpu(*leaves, SCALING, chunk_size=8, policy=CHUNKED)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert all(leaf.grad is None or torch.equal(leaf.grad, torch.zeros_like(leaf)) for leaf in leaves)


def test_rows_that_see_no_key_stay_finite():
    """A left-padded query row sees no key: its output (undefined, ignored by the loss) is finite, and so are the
    gradients that pass through it."""
    for tokens in (1, 20):
        query, key, value, gates, mask = make_inputs(2, 6, 2, tokens, 24, 4, offset=0, mask_kind="bool", active=1.0)
        leaves = [x.clone().requires_grad_() for x in (query, key, value, gates)]
        out = head_sparse_attention_cpu(*leaves, SCALING, mask, 0, chunk_size=8, policy=CHUNKED)
        out.sum().backward()
        assert torch.isfinite(out).all() and all(torch.isfinite(leaf.grad).all() for leaf in leaves)


@pytest.mark.parametrize("fn", [head_sparse_attention_cpu, head_sparse_attention_naive])
def test_bad_shapes_are_refused_in_words(fn):
    query, key, value, gates, _ = make_inputs(1, 6, 4, 5, 5, 4)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        fn(query, key, value, gates, SCALING)
    query, key, value, gates, _ = make_inputs(1, 6, 2, 5, 5, 4)
    with pytest.raises(ValueError, match="gates must be"):
        fn(query, key, value, gates[:, :4], SCALING)
    with pytest.raises(ValueError, match="do not fit 5 keys"):
        fn(query, key, value, gates, SCALING, None, 3)
    with pytest.raises(ValueError, match="attention_mask must be 4-D"):
        fn(query, key, value, gates, SCALING, torch.ones(1, 5, 5, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------------------------------
# the Triton kernels, in the interpreter


TRITON_CASES = {  # (B, H, Hkv, T, L, hd, offset, window, mask, full groups)
    "gqa-hd12": (2, 6, 2, 19, 19, 12, None, None, None, (0,)),
    "gqa3-hd5-after-cache": (2, 6, 3, 19, 23, 5, None, None, None, ()),
    "window": (2, 6, 2, 19, 23, 12, None, 7, None, ()),
    "bool-padding": (2, 6, 2, 19, 23, 12, None, None, "bool", (1,)),
    "float-window": (2, 6, 2, 19, 23, 12, None, 5, "float", ()),
    "static-cache-mha": (2, 6, 6, 19, 30, 12, 2, None, "bool", ()),
    "one-kv-head-long": (1, 4, 1, 37, 40, 8, 3, None, None, ()),
    "static-cache-causal": (2, 6, 2, 19, 30, 16, 2, None, None, (1,)),
    "decode": (2, 6, 2, 1, 21, 12, None, None, "bool", ()),
}


@pytest.mark.skipif(not triton_path.HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("case", list(TRITON_CASES.values()), ids=list(TRITON_CASES))
def test_triton_kernels_match_reference(case):
    """Tiles of 16 rows and 16 keys: several row blocks per segment, key loops over several tiles, odd head dims."""
    batch, heads, kv_heads, tokens, keys, head_dim, offset, window, mask_kind, full = case
    inputs = make_inputs(
        batch, heads, kv_heads, tokens, keys, head_dim, offset, mask_kind, full_groups=full, dtype=torch.float32
    )
    compare(
        head_sparse_attention_triton,
        inputs,
        offset,
        window,
        rtol=2e-5,
        atol=2e-5,
        reference_dtype=torch.float64,
        block_m=16,
        block_n=16,
    )


@pytest.mark.skipif(not triton_path.HAS_TRITON, reason="triton is not installed")
def test_triton_kernels_bf16():
    """bf16 tensors in and out (the interpreter computes in fp32 after loading: `UPCAST`), against the fp64
    reference within bf16's rounding."""
    inputs = make_inputs(2, 6, 2, 19, 23, 12, mask_kind="bool", full_groups=(0,), dtype=torch.float32)
    inputs = [x.to(torch.bfloat16) if x is not None and x.is_floating_point() else x for x in inputs]
    got = compare(
        head_sparse_attention_triton,
        inputs,
        rtol=0.05,
        atol=0.05,
        reference_dtype=torch.float64,
        block_m=16,
        block_n=16,
    )
    assert got.dtype == torch.bfloat16


@pytest.mark.skipif(not triton_path.HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("window, max_block", [(None, 4096), (5, 4096), (None, 16)])
def test_triton_row_lists_and_key_block_bounds(window, max_block, monkeypatch):
    """The row lists are each segment's active pairs in token order, with their key positions (after every key past
    the count); dK/dV programs loop over the rows found by `key_block_bounds`: every row that sees a key of the block,
    no more than the window allows, and from `full` on (causal, no window) only rows that see every key of the block.
    A static cache: keys past the last query. `max_block` 16: each segment scanned in several steps."""
    monkeypatch.setattr(triton_path._Plan, "MAX_BLOCK", max_block)
    batch, heads, kv_heads, tokens, keys, block, offset = 2, 6, 3, 23, 30, 4, 5
    groups = heads // kv_heads
    generator = torch.Generator().manual_seed(0)
    active = torch.rand(batch, tokens, heads, generator=generator) < 0.5
    active[0, :, groups : 2 * groups] = True  # a full segment
    active[1, :, :groups] = False  # an empty one
    plan = triton_path._Plan(active, kv_heads, None, keys, offset)
    bounds = plan.key_block_bounds(keys, block, window)
    capacity = groups * tokens
    for segment in range(batch * kv_heads):
        b, g = divmod(segment, kv_heads)
        count = int(plan.counts[segment])
        slots = plan.rows[segment * capacity : segment * capacity + count].tolist()
        pairs = [(t, j) for t in range(tokens) for j in range(groups) if active[b, t, g * groups + j]]
        assert slots == [t * groups + j for t, j in pairs]
        positions = [t + offset for t, _ in pairs]
        assert plan.positions[segment].tolist() == positions + [torch.iinfo(torch.int32).max] * (capacity - count)
        for key_block in range(-(-keys // block)):
            first, last = key_block * block, min(keys, key_block * block + block) - 1
            in_window = [p >= first and (window is None or p - window < last) for p in positions]
            sees = [i for i, yes in enumerate(in_window) if yes]
            start, full, end = bounds[segment, key_block].tolist()
            assert all(start <= row < end for row in sees) and end - start == len(sees)
            assert start <= full <= end
            if window is None:
                whole = first + block - 1 < keys
                assert all(positions[row] >= last for row in range(full, end)) and (whole or full == end)
                assert all(positions[row] < first + block - 1 for row in range(start, full))


@pytest.mark.skipif(not triton_path.HAS_TRITON, reason="triton is not installed")
def test_triton_kernels_compile_for_sm90():
    """Triton's ahead-of-time pipeline down to a cubin for an H100, in a fresh interpreter without TRITON_INTERPRET
    (what the interpreter never exercises: code generation, layouts, shared memory within the GPU's). The suite's cells
    (`--cells suite`, 7 of 12: the slow fp32-IEEE ones but one out; `--cells all` compiles every one)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(repo / "src"), str(repo), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.models.ops.head_sparse_attention_gpu_compile",
            "--arch",
            "90",
            "--cells",
            "suite",
        ],
        env=env,
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if run.returncode == 77:
        pytest.skip(run.stderr.strip())
    assert run.returncode == 0, run.stdout + run.stderr
    compiled = [line for line in run.stdout.splitlines() if line.startswith("sm_90")]
    assert len(compiled) == 3 + 3 * 7 and all(": shared " in line for line in compiled), run.stdout


def test_runs_are_the_maximal_stretches_of_consecutive_ids():
    """`runs` (the CPU op's and the fused decoding step's one helper) against itertools.groupby on id - position."""
    import itertools
    import random

    from mhmoe.models.ops.head_sparse_attention.head_sparse_attention_naive import runs

    rng = random.Random(0)
    for _ in range(200):
        ids = sorted(rng.sample(range(40), rng.randint(1, 40)))
        groups = [list(g) for _, g in itertools.groupby(enumerate(ids), key=lambda p: p[1] - p[0])]
        assert runs(ids) == [(g[0][1], g[-1][1] + 1) for g in groups]
    assert runs([]) == []
