#!/usr/bin/env python
"""Convert a dense LLaMA / Mistral / Qwen2 checkpoint into MoH-LLaMA, optionally continue-tune it.

    python conversion/convert_llama_to_moh.py --input_dir LLAMA_DIR --output_dir OUT \
        [--shared_heads_ratio 0.5] [--active_heads_ratio 0.75] [--overwrite] [--skip_logit_check] \
        [--train_file FILE ... --validation_file FILE --max_steps N --eval_steps M --save_steps K ...]

Works under `accelerate launch` with several processes. The logic is the package `mhmoe.convert` (see its docstring
and docs/conversion.md; the recipe's defaults are in src/mhmoe/convert/recipe.py); this file only calls it.
"""

import sys

from mhmoe.convert.cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
