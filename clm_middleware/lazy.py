"""Package namespaces whose names are imported on first use (PEP 562).

A package ``__init__`` that imported every submodule would make any import of a light
one (a list of choices for the CLI) load torch and transformers first; ``clm --help``
took 7 s. ``lazy_namespace`` gives the package a ``__getattr__`` and ``__dir__`` that
import a name's module only when the name is first read, then keep the value.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_namespace(
    package: str, namespace: dict[str, Any], exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps each name to its module;
    ``namespace`` is the package's ``globals()``, where a looked-up value is kept."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
