"""Package layout for setuptools; the metadata is in pyproject.toml.

The code is `src/mhmoe`. The data folders the code reads at run time stay at the top of the repository (one copy in
git) and are mapped into the package as `mhmoe._data.<folder>`, so wheels and sdists carry them as package data under
`mhmoe/_data/<folder>/` (every file, subfolders included); `mhmoe._plumbing.resources.data_dir` finds them there, or in place
from a checkout or an editable install. A folder that does not exist (yet) is simply not mapped.
"""

from pathlib import Path

from setuptools import find_namespace_packages, find_packages, setup

DATA_FOLDERS = ("eval_tasks", "model_cards", "examples")  # top-level folders shipped as mhmoe/_data/<folder>/

ROOT = Path(__file__).resolve().parent
packages = find_packages("src")
package_dir = {"": "src"}
package_data = {"mhmoe": ["py.typed"]}
for folder in DATA_FOLDERS:
    if not (ROOT / folder).is_dir():
        continue
    subfolders = find_namespace_packages(str(ROOT / folder), exclude=["*__pycache__*"])
    for sub in ["", *subfolders]:  # the folder itself, then each subfolder, as packages
        name = f"mhmoe._data.{folder}" + (f".{sub}" if sub else "")
        packages.append(name)
        package_dir[name] = "/".join([folder, *sub.split(".")]) if sub else folder
        package_data[name] = ["*"]

setup(packages=packages, package_dir=package_dir, package_data=package_data)
