"""Choose the NVML module: the real ``pynvml`` binding or the simulated drop-in ``dynamig.backends.simnvml``.

Both expose the same functions, structures and ``NVMLError_*`` classes, so callers take the returned module
as a parameter and never know which one they drive.
"""

from __future__ import annotations

import importlib
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
