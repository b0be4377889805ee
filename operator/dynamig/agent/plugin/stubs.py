"""Lazy access to the generated kubelet gRPC modules (``_generated/``, built by ``make proto``).

The generated code is not in version control. Importing it only when a server or client is built keeps
``import dynamig.agent.plugin`` working without it, and turns a missing build step into an error that says
what to run.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType

_PACKAGE = "dynamig.agent.plugin._generated"


class StubsMissingError(ImportError):
    """The generated gRPC modules are absent or stale."""


@dataclass(frozen=True, slots=True)
class Stubs:
    """The generated modules: messages (``*_pb2``) and service glue (``*_pb2_grpc``)."""

    dra_v1: ModuleType
    dra_v1_grpc: ModuleType
    dra_v1beta1: ModuleType
    dra_v1beta1_grpc: ModuleType
    registration: ModuleType
    registration_grpc: ModuleType


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(f"{_PACKAGE}.{name}")
    except ImportError as exc:
        raise StubsMissingError(
            f"kubelet gRPC stubs are not generated ({_PACKAGE}.{name}: {exc}); run `make proto` "
            "(python -m dynamig.agent.plugin.build_protos)"
        ) from exc


@functools.cache
def load_stubs() -> Stubs:
    """Imports the generated modules once. Raises StubsMissingError telling to run ``make proto``."""
    return Stubs(
        dra_v1=_import("dra_v1_pb2"),
        dra_v1_grpc=_import("dra_v1_pb2_grpc"),
        dra_v1beta1=_import("dra_v1beta1_pb2"),
        dra_v1beta1_grpc=_import("dra_v1beta1_pb2_grpc"),
        registration=_import("pluginregistration_pb2"),
        registration_grpc=_import("pluginregistration_pb2_grpc"),
    )
