"""``python -m unimem``: the command line (see :mod:`unimem.cli.main`)."""
import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m unimem"))
