"""``unimem --version``: the installed version, read when asked for."""
from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Any, Optional, Sequence, Union


def version() -> str:
    """What ``--version`` prints: the version of the package imported (its
    ``__version__``, which is also what the build writes into the
    metadata), where it was imported from, which tells an installed copy
    from a checkout, and a note when the installed metadata says another
    version (an install made before the version changed: reinstall)."""
    from importlib import metadata

    import unimem
    number = unimem.__version__
    try:
        installed = metadata.version("unimem")
    except metadata.PackageNotFoundError:
        note = " (source tree, not installed)"
    else:
        note = "" if installed == number else f" (the installed metadata says {installed}: reinstall)"
    return f"unimem {number}{note} from {os.path.dirname(os.path.abspath(unimem.__file__))} " \
           f"(Python {platform.python_version()})"


class VersionAction(argparse.Action):
    """argparse's ``version`` action, the version read when asked for (not
    at every start: reading the metadata scans the installed packages)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: Any = argparse.SUPPRESS, help: Optional[str] = None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Union[str, Sequence[Any], None], option_string: Optional[str] = None) -> None:
        sys.stdout.write(version() + "\n")
        parser.exit()
