"""A package face whose names load their module on first use (PEP 562 module ``__getattr__``),
shared by the packages that keep their ``import`` light (``event_plane.adapters``, ``advisor``)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: a name of ``exports`` (name → dotted module
    that defines it) is imported from its module on first use and kept in the package's
    namespace, so later lookups skip this function.

    Raises (from the returned function):
        AttributeError: the name is not in ``exports``.
        ImportError: its module cannot be imported.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
