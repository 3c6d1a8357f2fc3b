"""Plumbing, at the bottom of the house: it imports nothing else of mhmoe.

- `lazy`: PEP 562 `__getattr__`/`__dir__` so that packages load their public names on first use (`import mhmoe` stays
  free of torch and Transformers).
- `registration` over `import_hooks`: mhmoe's model types in Transformers' Auto classes, and `peft_defaults`: PEFT's
  default LoRA targets for them, each filled in as soon as the other package loads its tables.
- `extras`: optional dependencies grouped as the pyproject extras, and the one-line error naming the extra to install.
- `resources`: the data folders shipped with mhmoe (`eval_tasks/`, `model_cards/`).
- `cli`: the console scripts of pyproject.toml.
- `checkpoint_files`: checkpoint folders on disk, for every job that reads or writes one: safetensors weight files and
  their headers (pickles refused), atomic folder and JSON writes, recovery from a killed writer.

The modules above it (`registration`, `cli`) are named here as strings, like pyproject's entry points and
Transformers' own Auto tables: the import happens when they are needed, and the arrows of the source stay downward.
"""
