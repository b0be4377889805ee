"""Choose the NVML module: the real ``pynvml`` binding or the simulated drop-in ``dynamig.backends.simnvml``.

Both expose the same functions, structures and ``NVMLError_*`` classes, so callers take the returned module
as a parameter and never know which one they drive.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Literal

NvmlKind = Literal["real", "simulated"]


def load_nvml(kind: str = "real") -> ModuleType:
    """Import and return the NVML module for ``kind`` (``"real"`` or ``"simulated"``). Side effect: import.

    The simulated module still needs ``configure(...)`` before ``nvmlInit()``; the real one needs the driver.
    """
    if kind == "real":
        return importlib.import_module("pynvml")
    if kind == "simulated":
        return importlib.import_module("dynamig.backends.simnvml")
    raise ValueError(f"unknown NVML kind {kind!r} (expected 'real' or 'simulated')")


def fresh_simulated_nvml() -> ModuleType:
    """A separate copy of the simulated NVML, with GPUs and state of its own: several simulated nodes in one
    process (a scale benchmark's in-process agents). Side effect: executes the module anew."""
    global _copies
    origin = importlib.util.find_spec("dynamig.backends.simnvml")
    if origin is None or origin.origin is None:
        raise ImportError("dynamig.backends.simnvml not found")
    _copies += 1
    name = f"dynamig.backends.simnvml_copy{_copies}"
    spec = importlib.util.spec_from_file_location(name, origin.origin)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_copies = 0
