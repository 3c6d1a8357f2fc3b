"""`mhmoe-export` (and `python -m mhmoe.hub`): export a checkpoint with its modeling code, optionally to the Hub.

The arguments are parsed before torch and Transformers are imported, so a usage error prints at once."""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mhmoe-export",
        description="Export an mhmoe checkpoint with its modeling code (loads with trust_remote_code=True without "
        "mhmoe installed), a model card and the tokenizer; optionally upload it to the Hugging Face Hub.",
    )
    parser.add_argument("src_dir", help="checkpoint directory (model_type mhmoe or moh_llama, safetensors)")
    parser.add_argument("out_dir", help="directory to write (must be new or empty unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    parser.add_argument("--push_to_hub", metavar="REPO", help="upload the exported folder to this Hub repo id")
    parser.add_argument("--private", action="store_true", help="create the Hub repo as private")
    parser.add_argument("--no_model_card", action="store_true", help="do not write README.md")
    parser.add_argument(
        "--trust_remote_code",
        action="store_true",
        help="let Transformers run code that SRC_DIR's config or tokenizer names (off: never run)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    """`mhmoe-export SRC_DIR OUT_DIR [--overwrite] [--push_to_hub REPO]`; refusals exit with status 2 and one line, a
    full disk or another problem of the machine with status 1."""
    parser = build_parser()
    args = parser.parse_args(argv)

    from .._plumbing.checkpoint_files import exit_status, write_error_message
    from .export import ExportError, export_pretrained

    before = _identity(args.out_dir)
    try:
        out = export_pretrained(
            args.src_dir,
            args.out_dir,
            overwrite=args.overwrite,
            model_card=not args.no_model_card,
            push_to_hub=args.push_to_hub,
            private=args.private or None,
            trust_remote_code=args.trust_remote_code,
        )
    except KeyboardInterrupt:
        from .._plumbing.interrupts import report

        report("mhmoe-export", _what_is_left(args, exported=_identity(args.out_dir) != before))
    except ExportError as e:
        parser.exit(exit_status(e), f"mhmoe-export: error: {e}\n")
    except Exception as e:  # full disk, file size limit, read-only, permissions: one line saying which and where
        message = write_error_message(e, args.out_dir)
        if message is None:
            raise
        parser.exit(1, f"mhmoe-export: error: {message}\n")
    print(f"exported {args.src_dir} -> {out}" + (f" (uploaded to {args.push_to_hub})" if args.push_to_hub else ""))


def _identity(path: str) -> tuple | None:
    """The folder at `path` as the file system knows it (device, inode), None when there is none: the export renames a
    new folder into place at its very end, so a changed identity means it finished."""
    import os

    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino)


def _what_is_left(args, exported: bool) -> str:
    """After Ctrl-C: nothing was written (the export writes a hidden folder and renames it at the end), or the export
    was complete and the upload was not."""
    if not exported:
        return f"nothing was written to {args.out_dir}: run the same command again"
    if args.push_to_hub:
        return (
            f"{args.out_dir} was exported completely, the upload to {args.push_to_hub} did not finish: run the same "
            "command with --overwrite to export and upload again"
        )
    return f"{args.out_dir} was exported completely"


__all__ = ["build_parser", "main"]
