"""The command line of the generated references (``python -m clm_middleware.cli.docs``,
``python -m clm_middleware.store.docs``): one optional path to write, ``--help`` as usual."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def write_reference(render: Callable[[], str], default: str, what: str) -> None:
    """Parse ``sys.argv`` and write ``render()`` to the path given, else ``default``."""
    parser = argparse.ArgumentParser(description=f"Write the {what}, generated from the code.")
    parser.add_argument("path", nargs="?", default=default, help=f"where to write it [default: {default}]")
    target = Path(parser.parse_args().path)
    target.write_text(render(), encoding="utf-8")
