"""`edgellm explore OUT`: the program in Google's Model Explorer, through ExecuTorch's adapters
(`executorch-extension-model-explorer`: a `.pte` reader that opens XNNPACK delegates, and
ETRecord's). Model Explorer serves its UI from the installed package: it works offline (without a
network it only misses a web font and its new-version check). The optional extra
`edgellm[explore]` installs both."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError

EXTENSION = "executorch_extension_model_explorer"


def program_of(target) -> Path:
    path = Path(target)
    pte = path / "model.pte" if path.is_dir() else path
    if not pte.is_file() or pte.suffix != ".pte":
        raise InputError(f"{target}: not an export folder or a .pte file (no {pte.name} there)")
    return pte


def explore(target, port: int = 8080, browser: bool = True) -> None:
    """Serve Model Explorer on 127.0.0.1:`port` with the program loaded, opening a browser tab
    unless `browser` is False; returns when the server stops (Ctrl-C)."""
    pte = program_of(target)
    try:
        import model_explorer
        import executorch_extension_model_explorer  # noqa: F401  (installed: its adapters load)
    except ModuleNotFoundError as e:
        raise InputError(f"edgellm explore needs Model Explorer and ExecuTorch's adapters "
                         f"({e.name} is missing): pip install 'edgellm[explore]'") from e
    config = model_explorer.config()
    config.add_model_from_path(str(pte.resolve()))
    model_explorer.visualize_from_config(config=config, extensions=[EXTENSION], host="127.0.0.1",
                                         port=port, no_open_in_browser=not browser)
