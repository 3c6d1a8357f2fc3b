"""Which implementation of each op runs: the one place that chooses, and the one record of kernels that failed.

Every op the models call goes through here. Per op, `IMPLEMENTATIONS` lists its backends: "naive" (the plain
PyTorch reference, `ops/<op>/<op>_naive.py`), "grouped_mm" (torch's grouped GEMM with a hand-written backward,
`ops/experts/experts_grouped_mm.py`), "cpu" (torch's CPU flash-attention kernel on the active rows,
`ops/head_sparse_attention/head_sparse_attention_cpu.py`), "flex" (torch's FlexAttention on each head's active rows,
`head_sparse_attention_flex.py`; backward on CUDA only) and "triton" (`ops/<op>/<op>_triton.py`, CUDA, or CPU under
TRITON_INTERPRET=1).

| op                         | backends                  | by default                                             |
| routing.route              | naive, triton             | triton on CUDA when triton is installed, else naive    |
| routing.sort_by_expert     | naive, triton             | the same                                               |
| head_router.l2_head_gates  | naive, triton             | the same                                               |
| experts                    | naive, grouped_mm, triton | grouped_mm; triton only when asked (behind in fwd+bwd: |
|                            |                           | benchmarks/README.md, gpu_moe on an H200)              |
| head_sparse_attention      | naive, cpu, flex, triton  | cpu; MoH attention calls the op on CPU only unless the |
|                            |                           | config names a backend (moh/attention_plan.py)         |
| head_sparse_decode         | sdpa                      | sdpa (torch's): the CPU decoding step's attention      |

What asks for a backend: for the routing ops and the head router, `MHMOE_ROUTING_BACKEND=torch|triton` in the
environment, else the config's `routing_backend` ("torch" is the naive reference); for the experts, Transformers'
`experts_implementation` ("eager" is the naive reference, "grouped_mm", "triton"; any other function registered with
Transformers' experts interface runs as Transformers runs it, see `sparse_moe.MHMoEExpertsInterface`); for MoH's
head-sparse attention, the config's `moh_head_skipping` when it names a backend (`moh/attention_plan.py`, which
decides every MoH attention call's path). Config fields and that one environment variable: nothing else asks.
A backend asked for runs or raises. A kernel chosen by default that fails is replaced by the reference: the failure is
logged once at WARNING and recorded (`fallbacks()`: {op: reason}, which the benchmarks and the reproduction write
into their results), and no kernel is chosen by default again until `reset_fallbacks()`. Under torch.compile /
torch.export the routing kernels run as `torch.library` custom ops (`routing_triton.py`; chosen as in eager, and a
default one that fails falls back inside its op, recorded the same way); the other ops trace their references (the
experts' grouped_mm path has its own traced form, and on CUDA with SiLU runs its eager code as a custom op).

Adding an op: `ops/<op>/<op>_naive.py` (the reference) beside its kernels (`<op>_triton.py`, importing triton through
`triton_compat.py`), a loader and an entry in `LOADERS` (and `AUTOMATIC`), a function here that the model calls
(kernels are imported when first chosen: importing a config or a model loads none), and tests
against the reference on odd shapes (outputs and gradients). File names must be unique across `models/`: exported
checkpoints flatten the files into one folder (their copies run on torch alone; the kernel files then offer nothing
and the references run).
"""

import functools
import logging
import os
import threading

import torch

ROUTING_BACKEND_ENV = "MHMOE_ROUTING_BACKEND"
ROUTING_BACKENDS = {"torch": "naive", "triton": "triton"}  # config.routing_backend / the environment -> backend
EXPERTS_BACKENDS = {"eager": "naive", "grouped_mm": "grouped_mm", "triton": "triton"}  # experts_implementation ->
# op -> the backend chosen when none is asked for: a kernel on CUDA (when triton is installed), else this
AUTOMATIC = {
    "routing.route": "triton",
    "routing.sort_by_expert": "triton",
    "head_router.l2_head_gates": "triton",
}  # head_sparse_attention's Triton kernels join once a GPU benchmark shows them ahead (benchmarks/gpu_head_sparse.py)
# ops whose kernels have a torch.library form (routing_triton's custom ops): chosen inside traced graphs too
TRACED_KERNELS = ("routing.route", "routing.sort_by_expert")
DEFAULT = {
    "experts": "grouped_mm",
    "head_sparse_attention": "cpu",
    "head_sparse_decode": "sdpa",
}  # ops whose default is not the naive reference
# how to ask for an op's kernel (so that its error is raised); the routing ops' way when not listed
ASK_FOR_KERNEL = {"head_sparse_attention": "set the config's moh_head_skipping = 'triton'"}

# Each backend is imported when first chosen (`IMPLEMENTATIONS` calls its loader once), so that importing a config or a
# model imports no kernel (nor triton). Import statements, not strings: exports copy the files they name.
_KERNEL_RECORDS: dict[str, dict] = {}  # the kernels' own records of failures inside them, once loaded (`fallbacks()`)


def _routing_naive() -> dict:
    from .routing.routing_naive import route, sort_by_expert

    return {"routing.route": route, "routing.sort_by_expert": sort_by_expert}


def _routing_triton() -> dict:
    from .routing.routing_triton import TRACED_FAILED, route, sort_by_expert

    _KERNEL_RECORDS["routing_triton"] = TRACED_FAILED
    return {"routing.route": route, "routing.sort_by_expert": sort_by_expert}


def _head_router_naive() -> dict:
    from .head_router.head_router_naive import l2_head_gates

    return {"head_router.l2_head_gates": l2_head_gates}


def _head_router_triton() -> dict:
    from .head_router.head_router_triton import l2_head_gates_triton

    return {"head_router.l2_head_gates": l2_head_gates_triton}


def _experts_naive() -> dict:
    from .experts.experts_naive import experts_forward

    return {"experts": experts_forward}


def _experts_grouped_mm() -> dict:
    from .experts.experts_grouped_mm import STEPS_FAILED, experts_forward

    _KERNEL_RECORDS["experts_grouped_mm"] = STEPS_FAILED
    return {"experts": experts_forward}


def _experts_triton() -> dict:
    from .experts.experts_triton import experts_forward

    return {"experts": experts_forward}


def _head_sparse_naive() -> dict:
    from .head_sparse_attention.head_sparse_attention_naive import head_sparse_attention_naive

    return {"head_sparse_attention": head_sparse_attention_naive}


def _head_sparse_cpu() -> dict:
    from .head_sparse_attention.head_sparse_attention_cpu import head_sparse_attention_cpu

    return {"head_sparse_attention": head_sparse_attention_cpu}


def _head_sparse_decode_sdpa() -> dict:
    from .head_sparse_attention.head_sparse_decode_sdpa import head_sparse_decode_sdpa

    return {"head_sparse_decode": head_sparse_decode_sdpa}


def _head_sparse_flex() -> dict:
    from .head_sparse_attention.head_sparse_attention_flex import head_sparse_attention_flex

    return {"head_sparse_attention": head_sparse_attention_flex}


def _head_sparse_triton() -> dict:
    from .head_sparse_attention.head_sparse_attention_triton import head_sparse_attention_triton

    return {"head_sparse_attention": head_sparse_attention_triton}


LOADERS = {  # op -> backend -> the loader of its module
    "routing.route": {"naive": _routing_naive, "triton": _routing_triton},
    "routing.sort_by_expert": {"naive": _routing_naive, "triton": _routing_triton},
    "head_router.l2_head_gates": {"naive": _head_router_naive, "triton": _head_router_triton},
    "experts": {"naive": _experts_naive, "grouped_mm": _experts_grouped_mm, "triton": _experts_triton},
    "head_sparse_attention": {
        "naive": _head_sparse_naive,
        "cpu": _head_sparse_cpu,
        "flex": _head_sparse_flex,
        "triton": _head_sparse_triton,
    },
    "head_sparse_decode": {"sdpa": _head_sparse_decode_sdpa},
}


class _Implementations(dict):
    """{backend: function} of one op, each loaded on first use (`LOADERS`); tests may replace an entry."""

    def __init__(self, op: str):
        super().__init__()
        self.op = op

    def __iter__(self):
        return iter(LOADERS[self.op])

    def __contains__(self, backend) -> bool:
        return backend in LOADERS[self.op]

    def __len__(self) -> int:
        return len(LOADERS[self.op])

    def __missing__(self, backend: str):
        function = self[backend] = LOADERS[self.op][backend]()[self.op]
        return function


IMPLEMENTATIONS = {op: _Implementations(op) for op in LOADERS}  # op -> backend -> function

logger = logging.getLogger(__name__)


@functools.cache
def has_triton() -> bool:
    """Whether triton imports: tried on the first call on CUDA, so that importing the models imports no triton."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_FALLBACKS: dict[str, str] = {}
_LOCK = threading.Lock()


def choose(op: str, tensor: torch.Tensor, requested: str | None = None) -> tuple[str, bool]:
    """(the backend of `op` to run on `tensor`'s device, whether it was asked for). `requested`: a backend name of
    `IMPLEMENTATIONS[op]`, or None for the default."""
    if requested is not None:
        if requested not in IMPLEMENTATIONS[op]:
            raise ValueError(f"{op} has no backend {requested!r}; its backends are {tuple(IMPLEMENTATIONS[op])}")
        return requested, True
    kernel = AUTOMATIC.get(op)
    if kernel and tensor.is_cuda and has_triton():
        if torch.compiler.is_compiling():  # in a graph only kernels with a custom op; they fall back inside it
            if op in TRACED_KERNELS:
                return kernel, False
        elif not fallbacks():
            return kernel, False
    return DEFAULT.get(op, "naive"), False


def routing_backend(tensor: torch.Tensor, backend: str | None = None) -> tuple[str, bool]:
    """("torch" | "triton", whether it was asked for): the routing ops' backend on `tensor`'s device, in the words of
    `routing_backend` (config) and `MHMOE_ROUTING_BACKEND` (environment)."""
    chosen, forced = choose("routing.route", tensor, _routing_request(backend))
    return ("triton" if chosen == "triton" else "torch"), forced


def _run(op: str, tensor: torch.Tensor, requested: str | None, *args, **kwargs):
    """`op` on the backend `choose` picks; a kernel chosen by default that raises is recorded and the reference runs."""
    backend, forced = choose(op, tensor, requested)
    implementation = IMPLEMENTATIONS[op][backend]
    if torch.compiler.is_compiling():  # the graph runs later: its op bodies fall back unless the kernel was asked for
        strict = {"strict": forced} if backend == "triton" and op in TRACED_KERNELS else {}
        return implementation(*args, **kwargs, **strict)
    if forced or backend == DEFAULT.get(op, "naive"):
        return implementation(*args, **kwargs)
    try:
        return implementation(*args, **kwargs)
    except Exception as error:  # a default choice must not stop training: say so once, record it, run the reference
        how = ASK_FOR_KERNEL.get(op, f"set {ROUTING_BACKEND_ENV}=triton")
        record_fallback(op, error, f"; no kernel is chosen by default from now on ({how} to see the error raised)")
        return IMPLEMENTATIONS[op][DEFAULT.get(op, "naive")](*args, **kwargs)


def _routing_request(backend: str | None, traced: bool = True) -> str | None:
    """The routing ops' backend asked for, as a backend name (None: the default): the environment's
    `MHMOE_ROUTING_BACKEND`, else the config's `routing_backend`. In traced graphs a kernel without a custom op
    (`traced=False`: the head router) takes the reference."""
    asked = os.environ.get(ROUTING_BACKEND_ENV) or backend
    if not asked:
        return None
    if asked not in ROUTING_BACKENDS:
        where = ROUTING_BACKEND_ENV if os.environ.get(ROUTING_BACKEND_ENV) else "routing_backend"
        raise ValueError(f"{where} must be one of {tuple(ROUTING_BACKENDS)}, got {asked!r}")
    return "naive" if not traced and torch.compiler.is_compiling() else ROUTING_BACKENDS[asked]


def route(
    router_logits: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool | str = True,
    capacity_factor: float | None = None,
    backend: str | None = None,
    capacity_rounding: str = "switch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in fp32, top-k, optional renormalisation and capacity (`routing_naive.route`): router logits (N, E) ->
    `weights` (N, K) fp32 and `experts` (N, K) int64; dropped assignments get expert E and weight 0."""
    implementation_args = (router_logits, top_k, norm_topk_prob, capacity_factor)
    kwargs = {} if capacity_rounding == "switch" else {"capacity_rounding": capacity_rounding}
    requested = _routing_request(backend)
    return _run("routing.route", router_logits, requested, *implementation_args, **kwargs)


def sort_by_expert(
    experts: torch.Tensor, num_experts: int, backend: str | None = None, positions: bool = False
) -> tuple[torch.Tensor, ...]:
    """Group assignments by expert (`routing_naive.sort_by_expert`): `order` (S,) sorted by expert, dropped last,
    stable; `offsets` (E,) int32 ends; with `positions`, where each assignment sits in `order` (S,)."""
    requested = _routing_request(backend)
    return _run("routing.sort_by_expert", experts, requested, experts, num_experts, positions=positions)


def l2_head_gates(
    query_states: torch.Tensor,
    shared_heads: int,
    active_heads: int,
    straight_through: bool | str = False,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MoH "l2" head router (`head_router_naive.l2_head_gates`): pre-RoPE queries (..., H, hd) -> gates (..., H)
    fp32, router logits (..., R) fp32, selected routed heads (..., K) int64. Both backends take every
    `straight_through` mode (False, True, "scores", "selected_scores") with the same gradient."""
    lead = query_states.shape[:-2]
    queries = query_states.reshape(-1, *query_states.shape[-2:])  # (M, H, hd)
    requested = _routing_request(backend, traced=False)
    args = (queries, shared_heads, active_heads, straight_through)
    gates, logits, index = _run("head_router.l2_head_gates", queries, requested, *args)
    return gates.view(*lead, -1), logits.view(*lead, -1), index.view(*lead, -1)


def head_sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    gates: torch.Tensor,
    scaling: float,
    attention_mask: torch.Tensor | None = None,
    query_offset: int | None = None,
    sliding_window: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """MoH attention for the active (token, head) pairs only (`head_sparse_attention_naive`, the contract): query
    (B, H, T, hd) post-RoPE, key/value (B, Hkv, L, hd), gates (B, T, H) -> (B, T, H, hd), each active pair's output
    times its gate, 0 elsewhere. `backend`: "naive", "cpu", "flex" or "triton" (None: the default)."""
    args = (query, key, value, gates, scaling, attention_mask, query_offset, sliding_window)
    return _run("head_sparse_attention", query, backend, *args)


def head_sparse_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    attention_mask: torch.Tensor | None = None,
    kv_runs: tuple | None = None,
) -> torch.Tensor:
    """The CPU decoding step's attention (`head_sparse_decode_sdpa`): query (B, n, hd) of the query heads of key/value
    (B, m, L, hd), only the runs `kv_runs` of key/value heads read when given -> (B, n, hd)."""
    return IMPLEMENTATIONS["head_sparse_decode"]["sdpa"](query, key, value, scaling, attention_mask, kv_runs)


def experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act_fn,
    backend: str = "grouped_mm",
    routing_backend: str | None = None,
    may_drop: bool = False,
) -> torch.Tensor:
    """SwiGLU experts on routed rows: (N, W) rows, their (N, K) experts (id E: dropped) and weights -> (N, W) =
    Σ_k weight · down[e](act(gate[e] x) · up[e] x). `backend`: "naive", "grouped_mm" or "triton" (SiLU only);
    `routing_backend`: the sort's; `may_drop`: assignments may carry the dropped id (capacity routing)."""
    backend, _ = choose("experts", hidden_states, backend)
    implementation = IMPLEMENTATIONS["experts"][backend]
    if backend == "naive":
        return implementation(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, act_fn)
    if backend == "triton":
        from .experts.experts_grouped_mm import is_silu

        if not is_silu(act_fn):
            raise ValueError(f"the triton experts implement SiLU experts only, got {type(act_fn).__name__}")
        order, offsets = sort_by_expert(top_k_index, gate_up_proj.shape[0], routing_backend)  # (S,), (E,)
        return implementation(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, order, offsets)
    order, offsets, positions = sort_by_expert(top_k_index, gate_up_proj.shape[0], routing_backend, positions=True)
    return implementation(
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, act_fn, order, offsets, may_drop, positions
    )


def record_fallback(op: str, error: BaseException, note: str = "") -> bool:
    """Record that `op`'s kernel failed with `error` and its reference ran instead; log it at WARNING the first time.
    Returns whether this was the op's first recorded failure."""
    reason = f"{type(error).__name__}: {error}"
    with _LOCK:
        first = op not in _FALLBACKS
        if first:
            _FALLBACKS[op] = reason
    if first:
        logger.warning("the %s kernel failed (%s); its PyTorch reference runs instead%s", op, reason, note)
    return first


def fallbacks() -> dict[str, str]:
    """{op: reason of its kernel's first failure} for every kernel replaced by its reference since the last reset
    (the grouped_mm experts' fused steps included)."""
    with _LOCK:
        return {**_FALLBACKS, **{op: why for records in _KERNEL_RECORDS.values() for op, why in records.items()}}


def reset_fallbacks() -> None:
    """Forget recorded failures (tests; a harness between runs): kernels are chosen by default again."""
    with _LOCK:
        _FALLBACKS.clear()
        for records in _KERNEL_RECORDS.values():
            records.clear()
