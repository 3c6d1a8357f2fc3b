"""Transformers' `HfArgumentParser`, without importing Transformers: the command lines parse their arguments first, so
that a usage error or `--help` prints at once instead of after the seconds that importing torch and Transformers take.

`transformers/hf_argparser.py` imports only the standard library and PyYAML, so it is loaded here from its file as a
module of its own (`transformers/__init__.py` is not run); the flags are the dataclasses' fields, as everywhere, and
parsing is Transformers' own code. Should a Transformers release give that file other imports, the ordinary
`from transformers import HfArgumentParser` is used instead (slower, the same result).
"""

from __future__ import annotations

import importlib.util
import os
import sys

_MODULE = "mhmoe._plumbing._hf_argparser"


def _standalone_module():
    if _MODULE in sys.modules:
        return sys.modules[_MODULE]
    spec = importlib.util.find_spec("transformers")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), "hf_argparser.py")
    module_spec = importlib.util.spec_from_file_location(_MODULE, path)
    if module_spec is None or not os.path.isfile(path):
        return None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[_MODULE] = module
    try:
        module_spec.loader.exec_module(module)
    except ImportError:  # it imports more than the standard library now
        del sys.modules[_MODULE]
        return None
    return module


def hf_argument_parser(dataclass_types, **kwargs):
    """`transformers.HfArgumentParser(dataclass_types, **kwargs)`, built without importing Transformers when it can.
    Its usage errors are one line (`PROG: error: MESSAGE (see PROG --help)`, exit status 2), not the usage of every
    flag followed by the message."""
    module = _standalone_module()
    if module is None:
        from transformers import HfArgumentParser
    else:
        HfArgumentParser = module.HfArgumentParser
    parser = HfArgumentParser(dataclass_types, **kwargs)

    def one_line_error(message: str):
        parser.exit(2, f"{parser.prog}: error: {message} (see {parser.prog} --help)\n")

    parser.error = one_line_error
    return parser


def parse_or_exit(parser, argv: list[str] | None):
    """`parser.parse_args_into_dataclasses(argv)`, with flags the dataclasses do not have refused the argparse way
    (usage and one line, exit status 2) instead of HfArgumentParser's ValueError traceback."""
    *parsed, remaining = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if remaining:
        parser.error(f"unrecognized arguments: {' '.join(remaining)}")
    return parsed


__all__ = ["hf_argument_parser", "parse_or_exit"]
