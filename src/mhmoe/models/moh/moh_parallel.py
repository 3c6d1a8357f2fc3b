"""Tensor parallelism for the MoH head router: the `"moh_head_router"` style of the models' `base_model_tp_plan`.

Under Transformers' tensor parallelism `q_proj` is column-wise, so rank r holds the queries of a contiguous block of
H / tp heads, and `o_proj` row-wise takes that block's outputs. The head router must still rank every routed head of a
token (top-K over all R routed heads), so:
- routers that read query norms (`reads_query_norms`: "l2" and the calibrated ones): each rank computes the L2 norms
  of its own heads' pre-RoPE queries, (B, T, H / tp), and the norms are all-gathered into (B, T, H): one small
  all-gather per layer, never the queries themselves.
- "learned" router: its weights are replicated and its input (the attention input) is replicated, so every rank
  computes the same (B, T, H) gates without communication.
Each rank then keeps the gates of its own heads. Backward: each rank's loss depends only on its own heads' gates, so
the gradient of the full (B, T, H) gates is all-reduced before it reaches the router (which makes the router weights'
and the input's gradients complete and equal on every rank, like a replicated module's); the gathered norms then
return only their own slice, as the gradient arriving there is already the full one on every rank.

Shape legend: B batch, T tokens, H heads, h = H / tp heads on this rank. Runs on torch + transformers alone.
"""

import torch
import torch.distributed as dist

try:  # Transformers' tensor-parallel styles (5.x); without them the model works, only this TP style is missing
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    from transformers.distributed.tensor_parallel import TensorParallelLayer
except ImportError:
    ALL_PARALLEL_STYLES = None
    TensorParallelLayer = object


class _GatherHeads(torch.autograd.Function):
    """(B, T, h) per rank -> (B, T, H) on every rank; backward: this rank's slice of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group, rank: int, size: int) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.heads = (rank * local.shape[-1], (rank + 1) * local.shape[-1])
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start, end = ctx.heads
        return grad[..., start:end], None, None, None


class _SumGradients(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient (each rank holds the part of its own heads)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class MoHHeadRouterParallel(TensorParallelLayer):
    """TP style of `MoHRouter` (`layers.*.self_attn.head_router`): see the module docstring."""

    def install_forward(self, module, mesh):
        group, rank, size = mesh.get_group(), mesh.get_local_rank(), mesh.size()
        if module.num_heads % size:
            raise ValueError(
                f"MoH under tensor parallelism needs num_attention_heads ({module.num_heads}) divisible by the tensor "
                f"parallel size ({size}): each rank routes whole heads"
            )
        original_forward = module.forward
        module.tensor_parallel = True  # this rank computes some heads: the masked path (attention_plan.py)

        def tp_forward(hidden_states, query_states):
            local_heads = query_states.shape[-2]  # (B, T, h, hd): this rank's heads
            head_norms = None
            if module.reads_query_norms:
                head_norms = _GatherHeads.apply(query_states.float().norm(dim=-1), group, rank, size)  # (B, T, H)
            gates, router_logits, routed_index = original_forward(hidden_states, query_states, head_norms=head_norms)
            if torch.is_grad_enabled() and gates.requires_grad:
                gates = _SumGradients.apply(gates, group)
            return gates[..., rank * local_heads : (rank + 1) * local_heads], router_logits, routed_index

        module.forward = tp_forward
        return module


if ALL_PARALLEL_STYLES is not None:
    ALL_PARALLEL_STYLES.register("moh_head_router", MoHHeadRouterParallel())

__all__ = ["MoHHeadRouterParallel"]
