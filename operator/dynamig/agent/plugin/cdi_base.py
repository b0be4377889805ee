"""The node's base CDI spec: what NVIDIA's container toolkit generates for the node's driver.

``nvidia-ctk cdi generate`` writes one spec (kind ``nvidia.com/gpu`` by default, YAML unless the output file
ends in ``.json``) whose spec-level ``containerEdits`` are the edits every NVIDIA device needs, whichever
device it is: the driver libraries and binaries (``nvidia-smi`` ...) as bind mounts, the control device
nodes ``/dev/nvidiactl``, ``/dev/nvidia-uvm``, ``/dev/nvidia-uvm-tools``, ``/dev/nvidia-modeset``, the
``nvidia-cdi-hook`` hooks (``create-symlinks``, ``enable-cuda-compat``, ``update-ldcache``, ...) and
``NVIDIA_VISIBLE_DEVICES=void`` (upstream: ``pkg/nvcdi/common-nvml.go``, ``pkg/nvcdi/driver-nvml.go``,
``pkg/nvcdi/wrapper.go`` ``GetCommonEdits``). Its per-device entries describe the devices present when it
was generated; MIG devices come and go here, so the plugin takes only the common edits and adds the device
nodes of each prepared MIG instance itself.

Where it is: the toolkit's ``nvidia-cdi-refresh`` systemd unit writes ``/var/run/cdi/nvidia.yaml``
(``deployments/systemd/nvidia-cdi-refresh.service``, ``NVIDIA_CTK_CDI_OUTPUT_FILE_PATH``); without
``--output`` the command prints to stdout (``cmd/nvidia-ctk/cdi/generate/generate.go``).

:func:`parse_base_spec` and :func:`common_edits` are pure; :func:`read_base_spec` and
:func:`load_base_spec` read the file (each prepare reads it again, so a spec regenerated after a driver
upgrade is used at once).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dynamig.agent.plugin.cdi_validation import spec_errors

VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"


class BaseSpecError(Exception):
    """The node's base CDI spec is missing, unreadable or invalid; the message names the file."""


@dataclass(frozen=True, slots=True)
class BaseSpec:
    """The parts of the node's base spec the plugin uses."""

    path: Path
    kind: str
    cdi_version: str
    container_edits: Mapping[str, Any]  # the spec-level (common) edits, as in the file


def generate_hint(path: Path) -> str:
    """How to create the base spec at ``path``. Pure."""
    return (
        f"generate it on the node with `nvidia-ctk cdi generate --output={path}` (NVIDIA container "
        "toolkit; its nvidia-cdi-refresh service keeps /var/run/cdi/nvidia.yaml up to date), or point the "
        "agent's --cdi-base-spec at the file"
    )


def parse_base_spec(text: str, path: Path) -> BaseSpec:
    """The base spec in ``text`` (YAML or JSON) read from ``path``. Pure; BaseSpecError if it is not a valid
    CDI spec or has no common edits."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise BaseSpecError(f"CDI base spec {path} is not YAML or JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise BaseSpecError(
            f"CDI base spec {path} is not a CDI spec (no mapping at the top); " + generate_hint(path)
        )
    errors = spec_errors(raw)
    if errors:
        raise BaseSpecError(f"CDI base spec {path} is not a valid CDI spec: " + "; ".join(errors))
    edits = raw.get("containerEdits") or {}
    if not (edits.get("mounts") or edits.get("deviceNodes") or edits.get("hooks")):
        raise BaseSpecError(
            f"CDI base spec {path} has no common containerEdits (driver libraries, control device nodes, "
            "hooks): a container would get no driver; " + generate_hint(path)
        )
    return BaseSpec(
        path=path, kind=str(raw["kind"]), cdi_version=str(raw["cdiVersion"]), container_edits=edits
    )


def common_edits(base: BaseSpec) -> dict[str, Any]:
    """A deep copy of the base spec's common edits for a claim's spec, with ``NVIDIA_VISIBLE_DEVICES=void``
    as the only ``NVIDIA_VISIBLE_DEVICES`` entry. Pure.

    ``void`` makes the toolkit's legacy runtime hook treat the container as requesting no devices, so it
    injects nothing on top of CDI (``internal/config/image/devices.go``: ``NewVisibleDevices`` maps "" and
    "void" to ``void``, whose ``List`` is empty; ``nvidia-ctk`` puts the same entry in its common edits).
    """
    edits = copy.deepcopy(dict(base.container_edits))
    env = [e for e in edits.get("env") or [] if not str(e).startswith(f"{VISIBLE_DEVICES_ENV}=")]
    edits["env"] = [*env, f"{VISIBLE_DEVICES_ENV}=void"]
    return edits


def read_base_spec(path: Path) -> BaseSpec | None:
    """The base spec at ``path``, None if there is no such file. Side effect: reads it. BaseSpecError if it
    cannot be read or is invalid."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise BaseSpecError(f"cannot read CDI base spec {path}: {exc.strerror}") from exc
    return parse_base_spec(text, path)


def load_base_spec(path: Path, *, allow_missing: bool) -> BaseSpec | None:
    """The base spec at ``path``; None when it is missing and ``allow_missing`` (device-nodes-only specs, for
    simulated nodes). Side effect: reads the file. BaseSpecError when it is missing and not allowed to be,
    unreadable or invalid."""
    base = read_base_spec(path)
    if base is None and not allow_missing:
        raise BaseSpecError(
            f"CDI base spec {path} does not exist: without NVIDIA's CDI spec a container would get the MIG "
            "device nodes but no driver libraries or nvidia-smi; " + generate_hint(path)
        )
    return base
