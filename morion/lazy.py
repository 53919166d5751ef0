"""Package attributes imported on first use (PEP 562), so that importing a package stays cheap."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_attributes(package: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: attribute name -> the module that defines it, imported when
    the name is first used and then kept in the package's namespace."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
