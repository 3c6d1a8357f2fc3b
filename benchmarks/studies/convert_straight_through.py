"""Which straight-through estimator should the dense -> MoH converter use for its l2 router?

`moh_straight_through=True` (this library's first choice): the backward of the 0/1 gates is the soft top-K gates'
(weights renormalised over the K, ×K, zero on unselected heads). `"scores"`: the MoH paper's eq. 9-10 read with g_i the
raw softmax score of every routed head; `"selected_scores"`: read with g_i zero on unselected heads (the gradient of the
selected heads' raw scores only). All have the same forward, so the converted model before tuning is identical; only
continue-tuning differs.

Runs `mhmoe.recovery_demo.run_recovery_demo` (tiny dense LLaMA trained here, converted at 75% heads,
continue-tuned with the converter's own code path) once per estimator and seed, same parent, same data, same schedule,
and prints the held-out perplexity after continue-tuning. Commands:

    python benchmarks/studies/convert_straight_through.py --seeds 0
    python benchmarks/studies/convert_straight_through.py --seeds 0 --estimators True scores selected_scores

(about 2-3 minutes per run on the shared 2-core CPU; docs/conversion.md has the measured output)
"""

import argparse
import json
import tempfile

from mhmoe.convert import recipe
from mhmoe.recovery_demo import run_recovery_demo

ESTIMATORS = {"True": True, "scores": "scores", "selected_scores": "selected_scores"}  # --estimators -> the value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--dense_steps", type=int, default=300)
    parser.add_argument("--tune_steps", type=int, default=60)
    parser.add_argument("--estimators", nargs="+", choices=list(ESTIMATORS), default=["True", "scores"])
    args = parser.parse_args()
    estimators = [ESTIMATORS[name] for name in args.estimators]
    rows = []
    for seed in args.seeds:
        for estimator in estimators:
            recipe.STRAIGHT_THROUGH = estimator  # read by recipe.moh_fields when the converter writes the config
            with tempfile.TemporaryDirectory() as workdir:
                r = run_recovery_demo(
                    workdir, seed=seed, control=False, dense_steps=args.dense_steps, tune_steps=args.tune_steps
                )
            rows.append(
                dict(
                    seed=seed,
                    straight_through=estimator,
                    dense=r["dense_ppl"],
                    before=r["moh_ppl_before_tuning"],
                    after=r["moh_ppl_after_tuning"],
                    over_dense=r["moh_over_dense"],
                    seconds=r["seconds"],
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    print("\n| seed | straight_through | dense ppl | MoH before tuning | MoH after tuning | after / dense |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['seed']} | {r['straight_through']!r} | {r['dense']:.3f} | {r['before']:.3f} | {r['after']:.3f} | "
            f"{r['over_dense']:.4f} |"
        )
    for estimator in estimators:
        after = [r["after"] for r in rows if r["straight_through"] == estimator]
        print(f"mean after tuning, straight_through={estimator!r}: {sum(after) / len(after):.3f}")


if __name__ == "__main__":
    main()
