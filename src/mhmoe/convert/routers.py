"""The converter's vocabulary of head choices: its routers (`--moh_router`, `ROUTERS`) and its shared-head choices
(`--shared_heads_by`, `SHARED_HEADS`), one table each, name -> what it needs from calibration and what it sets.

A converter router says whether it reads the calibration's measurements (`calibrated`; the paper's "l2" does not),
whether the calibration pass fits its weights (`fits`), which tensors it adds to every layer (`added_shapes`,
planned as zeros before calibration so that the disk check counts them), and, from the calibration's `HeadStats` in
the permuted head order, the config fields it sets (`fields`), its part of moh_conversion.json (`record`) and the
tensors it fills in (`tensors`). Adding one touches no if/elif: a `ConverterRouter` subclass decorated with
`@converter_router("name")`, as `models/moh/head_routers.py` registers the model's routers; `--moh_router` offers it
and `--help` describes it by its `help`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .heads import head_order, permute_rows

FIT_RIDGE = 1e-2  # "fitted": λ = FIT_RIDGE × mean diag(XᵀX), fixed beforehand (benchmarks/studies/moh_head_budgets.py)
FIT_LOG_FLOOR = 1e-6  # "fitted": contribution norms clamped here before the log
ROUTER_PREFIX = "self_attn.head_router."  # the added tensors: model.layers.{i}.self_attn.head_router.<key>
ROUTERS: dict[str, ConverterRouter] = {}


def converter_router(name: str):
    """Class decorator: register a `ConverterRouter` subclass under `name` (`--moh_router name`)."""

    def register(cls):
        ROUTERS[name] = cls(name)
        return cls

    return register


class ConverterRouter:
    """The paper's parameter-free kind: the config's `moh_router` is the name, nothing calibrated or added."""

    help = ""  # its words in --moh_router's help
    calibrated = False  # reads the calibration's measurements
    fits = False  # the calibration pass fits its weights (`calibrate.RouterFit`)

    def __init__(self, name: str):
        self.name = name

    def added_shapes(self, config) -> dict[str, tuple[int, ...]]:
        """Per layer, the tensors it adds (`ROUTER_PREFIX` + key -> shape), in the shard of the layer's o_proj."""
        return {}

    def fields(self, stats, orders: list[list[int]]) -> dict:
        """The config fields it sets, in the order they are set."""
        return {"moh_router": self.name}

    def record(self, stats) -> dict:
        """Its entries of moh_conversion.json."""
        return {}

    def tensors(self, config, stats, orders: list[list[int]], dtypes: dict) -> dict:
        """The tensors it adds, by name, in their planned `dtypes` (name -> torch dtype)."""
        return {}


@converter_router("l2")
class L2Router(ConverterRouter):
    help = "the paper's"


class _NormStatisticsRouter(ConverterRouter):
    """A parameter-free router that scores a head's query norm against the head's calibration statistics."""

    calibrated = True

    def fields(self, stats, orders):
        return {
            "moh_router": self.name,
            "moh_head_norm_mean": [[round(v, 6) for v in row] for row in permute_rows(stats.norm_mean, orders)],
            "moh_head_norm_sigma": [
                [round(max(v, 1e-6), 6) for v in row] for row in permute_rows(stats.norm_std, orders)
            ],
        }


@converter_router("l2_standardized")
class L2StandardizedRouter(_NormStatisticsRouter):
    help = "query norm minus its calibration mean, over its calibration std: per-head calibration statistics"


@converter_router("l2_relative")
class L2RelativeRouter(_NormStatisticsRouter):
    help = "query norm over its calibration mean: per-head calibration statistics"


@converter_router("fitted")
class FittedRouter(ConverterRouter):
    """The paper's learned router with straight-through 0/1 gates, its W_r fitted (calibrate.py's `RouterFit`): W_r
    (R, d) = the fitted rows of the routed heads in the permuted head order; W_s, W_h zero (shared gates and stage
    weights 1)."""

    help = "the learned router, its weights fitted on calibration text"
    calibrated = fits = True

    def added_shapes(self, config):
        shared, d = config.moh_shared_heads, config.hidden_size
        shapes = {"routed_weight": (config.num_attention_heads - shared, d)}
        if shared > 1:
            shapes["shared_weight"] = (shared, d)
        if shared > 0:
            shapes["stage_weight"] = (2, d)
        return shapes

    def fields(self, stats, orders):
        return {"moh_router": "learned", "moh_straight_through": True}

    def record(self, stats):
        return {
            "router_fit": {
                "router": "learned (moh_router), W_r fitted; W_s and W_h zero (shared gates and stage weights 1)",
                "target": f"log of each head's o_proj contribution norm (clamped at {FIT_LOG_FLOOR:g})",
                "features": "the attention's input (hidden states after the input layer norm)",
                "ridge": f"lambda = {FIT_RIDGE:g} x mean(diag X^T X) per layer, fixed beforehand",
                "lambda": [round(v, 6) for v in stats.router_fit.ridge],
                "r2": [round(v, 4) for v in stats.router_fit.r2],
                "tokens": stats.tokens,
            }
        }

    def tensors(self, config, stats, orders, dtypes):
        import torch

        shapes, shared = self.added_shapes(config), config.moh_shared_heads
        tensors = {name: torch.zeros(shapes[name.rsplit(".", 1)[1]], dtype=dtype) for name, dtype in dtypes.items()}
        for i, (w, order) in enumerate(zip(stats.router_fit.weights, orders, strict=True)):
            name = f"model.layers.{i}.{ROUTER_PREFIX}routed_weight"
            tensors[name] = w[order[shared:]].to(dtypes[name])  # (R, d)
        return tensors


@dataclass(frozen=True)
class SharedHeads:
    """A shared-head choice: whether it reads the calibration's importance, and each layer's head order from it
    (importance of the layer's heads, shared heads, key/value heads) -> order, the shared heads first."""

    calibrated: bool
    order: Callable[[list[float], int, int], list[int]]


SHARED_HEADS = {
    "first": SharedHeads(False, lambda importance, shared, kv_heads: list(range(len(importance)))),  # the paper
    "importance": SharedHeads(True, head_order),  # the heads that contribute most, moved first (GQA-respecting)
}


def router_help() -> str:
    """--moh_router's words for each router of `ROUTERS`."""
    return ", ".join(f"'{name}' ({router.help})" for name, router in ROUTERS.items())


__all__ = [
    "FIT_LOG_FLOOR",
    "FIT_RIDGE",
    "ROUTERS",
    "ROUTER_PREFIX",
    "SHARED_HEADS",
    "ConverterRouter",
    "SharedHeads",
    "converter_router",
    "router_help",
]
