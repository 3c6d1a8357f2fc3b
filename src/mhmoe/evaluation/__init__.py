"""Evaluation: the lm-eval model `mhmoe` and the shipped suites, and routing statistics with their plots.

`lm_eval_model.py` the lm-eval model (`MHMoELM`, routing statistics per evaluation), `suites.py` the `eval_tasks/` suites and
the papers' table rows, `cli.py` the command line (`mhmoe-eval`), `analysis.py` expert and head load of any mhmoe model
(`expert_load`, `head_load`, `plot_load`, `RoutingStatistics`). lm-eval is the "eval" extra: only `lm_eval_model.py` and
`cli.py` need it.
"""

from typing import TYPE_CHECKING

from .._plumbing.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        **dict.fromkeys(("RoutingStatistics", "expert_load", "head_load", "plot_load"), ".analysis"),
        "MHMoELM": ".lm_eval_model",
        **dict.fromkeys(("add_paper_tables", "eval_tasks_dir", "simple_evaluate", "task_manager"), ".suites"),
    },
)

if TYPE_CHECKING:
    from .analysis import RoutingStatistics, expert_load, head_load, plot_load
    from .lm_eval_model import MHMoELM
    from .suites import add_paper_tables, eval_tasks_dir, simple_evaluate, task_manager

__all__ = [
    "MHMoELM",
    "RoutingStatistics",
    "add_paper_tables",
    "eval_tasks_dir",
    "expert_load",
    "head_load",
    "plot_load",
    "simple_evaluate",
    "task_manager",
]
