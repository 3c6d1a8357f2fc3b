"""Router top-k and dispatch: the one place the model decides where (sub-)tokens go.

Shape legend: N routed rows (tokens × moe_heads sub-tokens, token-major), E experts, K = num_experts_per_tok,
S = N·K (row, expert) assignments. A dropped assignment (over capacity) carries the sentinel expert id E and weight 0.

`route` and `sort_by_expert` are the dispatch points of the routing op (ops/routing/), `l2_head_gates` the one of the
MoH l2 head router (ops/head_router/): the PyTorch reference (`*_naive.py`, the default on CPU) or the Triton kernels
(`*_triton.py`, the default on CUDA when triton is installed). `MHMOE_ROUTING_BACKEND=torch|triton` in the
environment, else the config's `routing_backend`, forces one. When the kernels were chosen automatically and one
fails, the reference runs, the failure is logged once at WARNING and recorded (`kernel_fallbacks()` here, the same
as `ops.kernel_fallbacks.fallbacks()`: {kernel: reason}), and every routing op uses PyTorch until
`reset_fallbacks()`; a forced backend raises instead.
Under torch.compile / torch.export the reference is traced. Exported checkpoints (`trust_remote_code`) ship these
files and run them on torch alone (the kernel file then has no kernels to offer and the reference runs).
"""

import os

import torch

from .configuration_mhmoe import ROUTING_BACKENDS
from .ops.head_router.head_router_naive import l2_head_gates as naive_l2_head_gates
from .ops.head_router.head_router_triton import l2_head_gates_triton
from .ops.kernel_fallbacks import fallbacks as kernel_fallbacks  # {kernel: reason}; the harness reads it here
from .ops.kernel_fallbacks import record_fallback
from .ops.routing.routing_naive import renormalises  # noqa: F401  (part of this module's interface)
from .ops.routing.routing_naive import route as naive_route
from .ops.routing.routing_naive import sort_by_expert as naive_sort_by_expert
from .ops.routing.routing_triton import HAS_TRITON
from .ops.routing.routing_triton import route as triton_route
from .ops.routing.routing_triton import sort_by_expert as triton_sort_by_expert

ROUTING_BACKEND_ENV = "MHMOE_ROUTING_BACKEND"
KERNELS = ("routing.route", "routing.sort_by_expert", "head_router.l2_head_gates")  # names in fallbacks()


def _kernels_failed() -> bool:
    """Whether a routing kernel chosen automatically failed (recorded in `fallbacks()`): PyTorch from then on, until
    `reset_fallbacks()`."""
    return any(name in KERNELS for name in kernel_fallbacks())


def routing_backend(tensor: torch.Tensor, backend: str | None = None) -> tuple[str, bool]:
    """(backend to run for `tensor`, whether it was forced): the environment, else `backend` (the config's), else
    triton on CUDA when installed, else torch."""
    forced = os.environ.get(ROUTING_BACKEND_ENV) or backend
    if forced:
        if forced not in ROUTING_BACKENDS:
            where = ROUTING_BACKEND_ENV if os.environ.get(ROUTING_BACKEND_ENV) else "routing_backend"
            raise ValueError(f"{where} must be one of {ROUTING_BACKENDS}, got {forced!r}")
        return ("torch" if torch.compiler.is_compiling() else forced), True
    if tensor.is_cuda and HAS_TRITON and not torch.compiler.is_compiling() and not _kernels_failed():
        return "triton", False
    return "torch", False


def _run(name: str, backend: str, forced: bool, reference, kernel, *args):
    if backend == "torch":
        return reference(*args)
    if forced:
        return kernel(*args)
    try:
        return kernel(*args)
    except Exception as error:  # an automatic choice must not stop training: say so once, record it, use the reference
        record_fallback(name, error, f"; every routing op uses the torch backend from now on (set "
                                     f"{ROUTING_BACKEND_ENV}=triton to see the error raised)")  # fmt: skip
        return reference(*args)


def route(
    router_logits: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool | str = True,
    capacity_factor: float | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in fp32, top-k, optional renormalisation and Switch capacity (see `routing_naive.route`).

    Returns `weights` (N, K) fp32 and `experts` (N, K) int64; dropped assignments get expert E and weight 0.
    """
    chosen, forced = routing_backend(router_logits, backend)
    args = (router_logits, top_k, norm_topk_prob, capacity_factor)
    return _run(KERNELS[0], chosen, forced, naive_route, triton_route, *args)


def sort_by_expert(
    experts: torch.Tensor, num_experts: int, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group assignments by expert: `order` (S,) sorted by expert, dropped last, stable; `offsets` (E,) int32 ends
    (see `routing_naive.sort_by_expert`)."""
    chosen, forced = routing_backend(experts, backend)
    return _run(KERNELS[1], chosen, forced, naive_sort_by_expert, triton_sort_by_expert, experts, num_experts)


def l2_head_gates(
    query_states: torch.Tensor,
    shared_heads: int,
    active_heads: int,
    straight_through: bool = False,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MoH "l2" head router (see `ops/head_router/head_router_naive.py`) on the routing backend: pre-RoPE queries
    (..., H, hd) -> gates (..., H) fp32, router logits (..., R) fp32, selected routed heads (..., K) int64."""
    lead = query_states.shape[:-2]
    queries = query_states.reshape(-1, *query_states.shape[-2:])  # (M, H, hd)
    chosen, forced = routing_backend(queries, backend)
    args = (queries, shared_heads, active_heads, straight_through)
    gates, logits, index = _run(KERNELS[2], chosen, forced, naive_l2_head_gates, l2_head_gates_triton, *args)
    return gates.view(*lead, -1), logits.view(*lead, -1), index.view(*lead, -1)


def topk_mask(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """(..., E) logits -> (..., E) fp32 0/1: the top-k each row selects, as the routers select (fp32 softmax, top-k).
    Shared by the load statistics and the balancing losses of experts and MoH heads."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    index = torch.topk(probs, top_k, dim=-1).indices
    return torch.zeros_like(probs).scatter(-1, index, 1.0)
