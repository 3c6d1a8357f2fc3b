"""What the command lines read from a user's folder: never its code, never a file through a link out of it.

Code: Transformers imports the Python files a folder's `config.json` or `tokenizer_config.json` names in an `auto_map`
when asked to (`trust_remote_code=True`), and asks on the terminal when not told either way. Every `from_pretrained`
in mhmoe passes `trust_remote_code` explicitly (False unless the user passed `--trust_remote_code`;
tests/_plumbing/test_trust.py reads the source for it), and `load_tokenizer` / `load_config` turn Transformers' refusal
into one line saying which folder needs code and how to allow it.

Links: a checkpoint folder whose files are symbolic links to files outside it (`vocab.txt -> /etc/passwd`) would make
a command read, copy, re-save and upload those files. `check_links` refuses such a folder in one line before anything
reads it; links that stay inside the folder, and a Hugging Face cache snapshot's links into its `blobs/`, are fine.
"""

from __future__ import annotations

import os
import re

_CODE_REFUSED = "trust_remote_code=True"  # in Transformers' ValueError when a folder's code would be needed
_HUB_BLOB = re.compile(r"(^|/)models--[^/]+/blobs/[^/]+$")  # a file of a Hugging Face cache


def code_refusal(error: Exception, path, what: str, flag: str = "--trust_remote_code") -> str | None:
    """One line for Transformers' refusal to load `path` without running its code; None for any other error."""
    if not isinstance(error, ValueError) or _CODE_REFUSED not in str(error):
        return None
    named = "; ".join(f"{name}'s auto_map names {', '.join(files)}" for name, files in _code_named(path).items())
    return (
        f"the {what} in {path} needs the folder's own Python code, which is never run unless you pass {flag} "
        f"(only for folders you trust){': ' + named if named else ''}"
    )


def _code_named(path) -> dict[str, list[str]]:
    """{file: [module files]} named by the `auto_map` of the folder's tokenizer_config.json and config.json."""
    import json

    found = {}
    for name in ("tokenizer_config.json", "config.json"):
        try:
            with open(os.path.join(path, name), encoding="utf-8") as f:
                auto_map = json.load(f).get("auto_map") or {}
        except (OSError, ValueError, AttributeError):
            continue
        references = [r for v in auto_map.values() for r in (v if isinstance(v, list) else [v]) if isinstance(r, str)]
        modules = sorted({r.split("--")[-1].rsplit(".", 1)[0] + ".py" for r in references})
        if modules:
            found[name] = modules
    return found


def load_tokenizer(
    path,
    error: type[Exception],
    trust_remote_code: bool = False,
    what: str = "tokenizer",
    flag: str = "--trust_remote_code",
    **kwargs,
):
    """`AutoTokenizer.from_pretrained(path, trust_remote_code=...)`; a tokenizer that needs the folder's code without
    `trust_remote_code` raises `error` in one line."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    except ValueError as e:
        message = code_refusal(e, path, what, flag)
        if message is None:
            raise
        raise error(message) from None


def load_config(
    path, error: type[Exception], trust_remote_code: bool = False, flag: str = "--trust_remote_code", **kwargs
):
    """`AutoConfig.from_pretrained(path, trust_remote_code=...)`, refusing a config that needs code in one line."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    except ValueError as e:
        message = code_refusal(e, path, "config", flag)
        if message is None:
            raise
        raise error(message) from None


def _inside(path: str, folder: str) -> bool:
    real, root = os.path.realpath(path), os.path.realpath(folder)
    return real == root or real.startswith(root + os.sep)


def link_allowed(path: str, folder: str) -> bool:
    """Whether the symbolic link `path` in `folder` may be followed: it stays inside the folder, or it is a Hugging
    Face cache file (`.../models--org--name/blobs/HASH`, what a cache snapshot's files link to)."""
    return _inside(path, folder) or bool(_HUB_BLOB.search(os.path.realpath(path).replace(os.sep, "/")))


def links_out(folder: str, limit: int = 1000) -> list[str]:
    """Relative paths of the symbolic links in `folder` (at any depth; linked folders are not entered) that lead out
    of it (`link_allowed`)."""
    found = []
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            if os.path.islink(path) and not link_allowed(path, folder):
                found.append(os.path.relpath(path, folder))
                if len(found) >= limit:
                    return found
    return found


def check_links(folder, error: type[Exception], what: str) -> None:
    """Refuse, in one line, a folder holding symbolic links out of it (`links_out`): nothing is read through them."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        return
    found = links_out(folder)
    if found:
        shown = ", ".join(f"{name} -> {os.path.realpath(os.path.join(folder, name))}" for name in found[:3])
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        raise error(
            f"{what} {folder} holds symbolic links out of the folder ({shown}{more}); nothing is read through "
            "them: copy the files into the folder if you mean to use them, or remove the links"
        )


__all__ = ["check_links", "code_refusal", "link_allowed", "links_out", "load_config", "load_tokenizer"]
