"""`save_pretrained` / `push_to_hub` of mhmoe models write a folder that loads with `trust_remote_code=True` where
mhmoe is not installed: the weights plus the modeling code, `auto_map` and a model card.
`save_pretrained(..., self_contained=False)` writes Transformers' plain folder (loads after `import mhmoe`).

The model layer owns the hook, not the writer: `REMOTE_CODE_WRITER` is the function that adds the code to a saved
folder, `writer(save_directory, config)`; `import mhmoe` sets it to one that calls the publishing layer above
(`mhmoe.hub.remote_code.write_remote_code`), so nothing here imports upward. When it is None the save is Transformers'
own.

Runs on torch + transformers alone: in a model loaded from such a folder (its classes live in `transformers_modules`)
the save is Transformers' own.
"""

import os
from collections.abc import Callable

REMOTE_CODE_WRITER: Callable[[str, object], None] | None = None  # set by mhmoe/__init__.py


class SelfContainedSaveMixin:
    """Put before `PreTrainedModel` in the bases of an mhmoe model class."""

    def save_pretrained(self, save_directory, *args, self_contained: bool = True, **kwargs):
        super().save_pretrained(save_directory, *args, **kwargs)
        if not self_contained or not kwargs.get("is_main_process", True):
            return
        if not type(self).__module__.startswith("mhmoe."):  # loaded with trust_remote_code: no mhmoe code to copy
            return
        if REMOTE_CODE_WRITER is not None:
            REMOTE_CODE_WRITER(os.fspath(save_directory), self.config)

    def push_to_hub(self, repo_id: str, *args, **kwargs):
        """Transformers' `push_to_hub` (it uploads what `save_pretrained` writes: the self-contained folder). Without
        the network or a token the error says so and how to publish later."""
        try:
            return super().push_to_hub(repo_id, *args, **kwargs)
        except Exception as e:
            if not _is_connection_problem(e):
                raise
            raise OSError(
                f"push_to_hub({repo_id!r}) could not reach the Hugging Face Hub ({type(e).__name__}: {e}). It needs "
                "the network (HF_HUB_OFFLINE unset) and a token (`hf auth login`, or token=...). To publish later: "
                "`model.save_pretrained(folder)` writes the same self-contained folder, then "
                f"`hf upload {repo_id} folder`"
            ) from e


def _is_connection_problem(error: Exception) -> bool:
    names = {type(e).__name__ for e in (error, error.__cause__, error.__context__) if e is not None}
    known = {"OfflineModeIsEnabled", "LocalTokenNotFoundError", "HfHubHTTPError", "ConnectionError", "ConnectError",
             "ConnectTimeout", "HTTPError", "RepositoryNotFoundError"}  # fmt: skip
    return bool(names & known)
