"""Publishing: checkpoint folders that load anywhere, model cards and the Hub.

`export.py` writes a self-contained folder (`export_pretrained`, `mhmoe-export` in `cli.py`) and uploads it;
`remote_code.py` adds the modeling code and `auto_map` that `trust_remote_code=True` loads to a saved folder (also
called by training's final save and by the converter); `cards.py` fills the model-card templates. Checkpoint folders are read and written safely
(safetensors only, atomic writes) by `mhmoe._plumbing.checkpoint_files`, for the converter and the trainer too.
"""

from typing import TYPE_CHECKING

from .._plumbing.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        **dict.fromkeys(("ExportError", "export_pretrained", "upload_folder"), ".export"),
        **dict.fromkeys(("check_exported_code", "write_remote_code"), ".remote_code"),
        "model_card": ".cards",
    },
)

if TYPE_CHECKING:
    from .cards import model_card
    from .export import ExportError, export_pretrained, upload_folder
    from .remote_code import check_exported_code, write_remote_code

__all__ = [
    "ExportError",
    "check_exported_code",
    "export_pretrained",
    "model_card",
    "upload_folder",
    "write_remote_code",
]
