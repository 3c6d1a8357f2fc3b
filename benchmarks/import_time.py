"""Import time of `import mhmoe` next to `import transformers`, each in fresh interpreters.

    python benchmarks/import_time.py [--runs 9] [--other_src DIR]

Each statement is timed inside its own new process (time.perf_counter around the statement: interpreter start-up not
included), the statements interleaved run by run so that load on the machine affects them alike; the medians are
printed side by side with the difference to `import transformers`. Also printed: which of the optional packages
(accelerate, peft, lm_eval, matplotlib, triton) each statement leaves in sys.modules. `import transformers` is lazy
and loads no torch, and neither does `import mhmoe` (its names load on first use; `mhmoe._plumbing.lazy`). Using the Auto
classes loads torch; after `import mhmoe` it also loads mhmoe's model classes, which register with them
(`mhmoe._plumbing.registration`), so `import mhmoe; from transformers import AutoModelForCausalLM` is shown next to the same
import without mhmoe. Any model class needs transformers' modeling code (`transformers.modeling_utils`, which imports
torch and, where installed, accelerate and triton): `from transformers import LlamaForCausalLM` is the yardstick for
`from mhmoe import MHMoEForCausalLM`.
`--other_src DIR` adds `import mhmoe` from another source tree (PYTHONPATH=DIR), e.g. an older commit's `src/`.
`--registration` times instead what `import mhmoe` would cost under the other ways to register with the Auto classes
(the alternatives that `mhmoe._plumbing.registration` was chosen against): the config classes registered eagerly
(models resolved later), everything registered eagerly, and Transformers' own `_LazyModule` for mhmoe's names.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

STATEMENTS = {
    "import transformers": "import transformers",
    "import mhmoe": "import mhmoe",
    "from transformers import AutoModelForCausalLM": "from transformers import AutoModelForCausalLM",
    "import mhmoe; ...import AutoModelForCausalLM": "import mhmoe; from transformers import AutoModelForCausalLM",
    "from transformers import LlamaForCausalLM": "from transformers import LlamaForCausalLM",
    "from mhmoe import MHMoEForCausalLM": "from mhmoe import MHMoEForCausalLM",
}
REGISTRATION = {  # what `import mhmoe` would run under each design
    "import transformers": "import transformers",
    "post-import hooks (current): import mhmoe": "import mhmoe",
    "eager configs: + AutoConfig.register": "import mhmoe; mhmoe._plumbing.registration.register_configs()",
    "eager everything: + register_auto_classes()": "import mhmoe; mhmoe.register_auto_classes()",
    "Transformers' _LazyModule: its import": "from transformers.utils.import_utils import _LazyModule",
}
OPTIONAL = ("accelerate", "peft", "lm_eval", "matplotlib", "triton")

_TIMER = """
import json, sys, time
start, start_cpu = time.perf_counter(), time.process_time()
{statement}
wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
print(json.dumps(dict(wall=wall, cpu=cpu, optional=[m for m in {optional!r} if m in sys.modules])))
"""


def time_once(statement: str, pythonpath: str | None = None) -> dict:
    code = _TIMER.format(statement=statement, optional=OPTIONAL)
    env = dict(os.environ) if pythonpath is None else {**os.environ, "PYTHONPATH": pythonpath}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9, help="fresh processes per statement (default 9)")
    parser.add_argument("--other_src", default=None, help="also time `import mhmoe` with PYTHONPATH=OTHER_SRC")
    parser.add_argument("--registration", action="store_true", help="time the alternative registration designs")
    args = parser.parse_args(argv)
    table = REGISTRATION if args.registration else STATEMENTS
    statements = {name: (statement, None) for name, statement in table.items()}
    if args.other_src:
        statements["import mhmoe (--other_src)"] = ("import mhmoe", args.other_src)
    time_once("import mhmoe")  # warm the file cache once, not counted
    results = {name: [] for name in statements}
    for _ in range(args.runs):
        for name, (statement, pythonpath) in statements.items():
            results[name].append(time_once(statement, pythonpath))
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
        f"{args.runs} fresh processes per statement" + (f"; --other_src {args.other_src}" if args.other_src else "")
    )
    print("median seconds (min-max): wall clock, and CPU time of the importing process (less sensitive to load);")
    print(
        "'+/-' = over / under `import transformers`; last column: optional packages the statement left in sys.modules"
    )
    base = {key: statistics.median(r[key] for r in results["import transformers"]) for key in ("wall", "cpu")}
    for name, runs in results.items():
        columns = []
        for key in ("wall", "cpu"):
            values = [r[key] for r in runs]
            median = statistics.median(values)
            columns.append(f"{key} {median:5.2f} ({min(values):.2f}-{max(values):.2f}) {median - base[key]:+5.2f}")
        print(f"{name:<46} {'   '.join(columns)}   {', '.join(runs[-1]['optional']) or 'none'}")


if __name__ == "__main__":
    main()
