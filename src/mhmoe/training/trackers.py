"""`--report_to`: experiment trackers through Accelerate (`Accelerator(log_with=...)`, `init_trackers`, `log`).

Every metrics record's numbers go to each tracker at its step (metrics.jsonl is written as always). Offline unless
the environment says otherwise: TensorBoard writes under `output_dir/runs/`, Trackio too (unless it was imported
before, or TRACKIO_DIR is set), W&B runs offline into `output_dir/wandb` (`WANDB_MODE` changes it; `wandb sync`
uploads later), MLflow logs to `output_dir/mlflow.db` (SQLite; with
mlflow-skinny, which has no SQL store, to the file store `output_dir/mlruns`) unless `MLFLOW_TRACKING_URI` is set. A tracker that is not installed is one line naming the package.
"""

from __future__ import annotations

import importlib.util
import os

from .arguments import TrainingError, recorded_args, report_to
from .state import TrainRun

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}
LOG_DIR = "runs"


def _local_stores(names: list[str], output_dir: str, run_name: str) -> dict:
    """Each tracker's `init` keyword arguments, pointing it at `output_dir` unless the environment says otherwise."""
    kwargs = {"tensorboard": {}, "trackio": {"name": run_name}, "mlflow": {"run_name": run_name}}
    kwargs["wandb"] = {"name": run_name, "dir": output_dir, "mode": os.environ.get("WANDB_MODE", "offline")}
    if "mlflow" in names and "MLFLOW_TRACKING_URI" not in os.environ:
        import mlflow

        if importlib.util.find_spec("sqlalchemy") is not None:  # MLflow's recommended local store
            mlflow.set_tracking_uri("sqlite:///" + os.path.abspath(os.path.join(output_dir, "mlflow.db")))
        else:  # mlflow-skinny has no SQL store: the file store, which MLflow 3 keeps behind a switch
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri("file:" + os.path.abspath(os.path.join(output_dir, "mlruns")))
    if "trackio" in names:  # read when trackio is first imported
        os.environ.setdefault("TRACKIO_DIR", os.path.abspath(os.path.join(output_dir, LOG_DIR, "trackio")))
    return {name: kwargs[name] for name in names}


def tracker_settings(args) -> dict:
    """The Accelerator's keyword arguments for --report_to (none: {}); refuses a tracker that is not installed."""
    names = report_to(args)
    if not names:
        return {}
    missing = [PACKAGES[n] for n in names if importlib.util.find_spec(PACKAGES[n]) is None]
    if missing:
        raise TrainingError(
            f"--report_to {args.report_to}: {', '.join(missing)} is not installed (pip install {' '.join(missing)})"
        )
    from accelerate.utils import ProjectConfiguration

    logging_dir = os.path.join(args.output_dir, LOG_DIR)
    return {"log_with": names, "project_config": ProjectConfiguration(args.output_dir, logging_dir=logging_dir)}


def setup_trackers(run: TrainRun) -> None:
    """Start the trackers the Accelerator was made with (their files go into the output folder, now prepared)."""
    args, accelerator = run.args, run.accelerator
    names = report_to(args)
    if not names:
        return
    name = args.run_name or os.path.basename(os.path.abspath(args.output_dir))
    config = {k: v for k, v in recorded_args(args).items() if isinstance(v, (int, float, str, bool))}
    try:
        init_kwargs = _local_stores(names, args.output_dir, name)
        accelerator.init_trackers("mhmoe-train", config=config, init_kwargs=init_kwargs)
    except Exception as e:  # a tracker's own setup problem (a store, a login, a folder): one line, before training
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TrainingError(
            f"--report_to {args.report_to}: the tracker did not start ({type(e).__name__}: {first})"
        ) from None
    run.trackers = True


def end_trackers(run: TrainRun) -> None:
    if run.trackers:
        run.trackers = False
        run.accelerator.end_training()


__all__ = ["end_trackers", "setup_trackers", "tracker_settings"]
