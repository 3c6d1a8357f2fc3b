"""Command lines built from an arguments dataclass, without importing Transformers (or torch).

`HfArgumentParser` needs `import transformers` (seconds) before it can even print a usage error. `dataclass_parser`
makes the same command line from the same dataclass (the one definition of the flags): `--name` and
`--name-with-dashes`, `X | None` parsed as X, `list[X]` as one or more values, bools as `--flag [true/false]` plus
`--no_flag` for those that default to True, and each field's metadata (help, choices) passed on;
tests/training/test_cli_errors.py compares it with HfArgumentParser on mhmoe-train's flags. Usage errors are one
line, `PROG: error: ... (see PROG --help)`, exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing


def string_to_bool(value):
    if isinstance(value, bool):
        return value
    if value.lower() in ("yes", "true", "t", "y", "1"):
        return True
    if value.lower() in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false (yes/no, 1/0), got {value!r}")


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (no usage block), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number_type(kind: type):
    """int/float that name the flag in their error (argparse says "invalid float value: 'x'")."""

    def convert(value: str):
        try:
            return kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {value!r}")

    convert.__name__ = kind.__name__
    return convert


def dataclass_parser(dataclass_type: type, prog: str, description: str | None = None) -> OneLineArgumentParser:
    parser = OneLineArgumentParser(prog=prog, description=description,
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    hints = typing.get_type_hints(dataclass_type)
    for field in dataclasses.fields(dataclass_type):
        if not field.init:
            continue
        kind = hints[field.name]
        options = [f"--{field.name}"] + ([f"--{field.name.replace('_', '-')}"] if "_" in field.name else [])
        kwargs = dict(field.metadata)
        args = typing.get_args(kind)
        if typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in args and bool not in args:
            kind = next(a for a in args if a is not type(None))
        default = field.default
        if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        if kind is bool or kind == (bool | None):
            kwargs.update(type=string_to_bool, nargs="?", const=True,
                          default=False if default is dataclasses.MISSING else default)  # fmt: skip
        elif typing.get_origin(kind) is list:
            kwargs.update(type=typing.get_args(kind)[0], nargs="+")
        else:
            kwargs["type"] = _number_type(kind) if kind in (int, float) else kind
        if "default" not in kwargs:
            if default is dataclasses.MISSING:
                kwargs["required"] = True
            else:
                kwargs["default"] = default
        parser.add_argument(*options, **kwargs)
        if field.default is True and kind is bool:
            parser.add_argument(f"--no_{field.name}", f"--no-{field.name.replace('_', '-')}", action="store_false",
                                dest=field.name, help=f"Turn --{field.name} off.")  # fmt: skip
    return parser


def parse_into(parser: argparse.ArgumentParser, dataclass_type: type, argv: list[str] | None = None):
    """The dataclass instance of a command line (`argv`, default sys.argv[1:]); usage errors exit."""
    namespace = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return dataclass_type(**vars(namespace))


__all__ = ["OneLineArgumentParser", "dataclass_parser", "parse_into", "string_to_bool"]
