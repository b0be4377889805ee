"""CDI specs for prepared claims, and the NVIDIA capability files they are built from.

One spec file per claim, kind ``k8s.mig.dynamig.io/claim``, one CDI device per allocated MIG instance named
``<claim-uid>-<device-name>``. A MIG instance is reached through the parent GPU's ``/dev/nvidia<minor>`` and
two capability nodes ``/dev/nvidia-caps/nvidia-cap<N>``: one for its GPU instance, one for its compute
instance (the three nodes NVIDIA's toolkit gives a MIG device:
``internal/platform-support/dgpu/nvml.go``, ``newNvmlMigDiscoverer``). Their minors are in the driver's
procfs files ``/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<X>/access`` and
``.../gi<X>/ci<Y>/access``, each with a ``DeviceFileMinor: N`` line.

What a claim's spec holds:

- spec-level ``containerEdits``: the common edits of the node's base spec (``cdi_base``: what
  ``nvidia-ctk cdi generate`` wrote: driver libraries and binaries, control nodes ``/dev/nvidiactl``,
  ``/dev/nvidia-uvm`` ..., the ``nvidia-cdi-hook`` hooks), with ``NVIDIA_VISIBLE_DEVICES=void`` so the
  toolkit's legacy hook injects nothing on top. Without a base spec (allowed only on simulated nodes):
  ``/dev/nvidiactl``, ``/dev/nvidia-uvm`` and the same ``void`` entry.
- per device: the three device nodes of that MIG instance, and ``DYNAMIG_MIG_UUIDS=<uuid>[,<uuid>...]``:
  the MIG UUIDs of every device of the same request (CDI env entries of one name do not merge, so each
  device carries the whole list). It tells the workload which slice it got without being a variable any
  NVIDIA component acts on. A whole GPU (MIG mode off) is its one node ``/dev/nvidia<minor>`` (as the
  toolkit's ``newFullGPUDiscoverer`` gives it) and ``DYNAMIG_GPU_UUIDS``, the GPU UUIDs of its request.
- ``cdiVersion``: the lowest version the content requires (``cdi_validation.required_version``), as
  ``nvidia-ctk`` does.

Every spec is validated (``cdi_validation``: the CDI JSON schema and the CDI library's own checks) before it
is written; an invalid one is refused (``InvalidSpecError``) and never reaches the runtime.

``build_spec``, ``device_nodes`` and ``parse_access_file`` are pure; the ``read_*``, ``write_*`` and
``remove_*`` functions touch the filesystem. Specs are written atomically (temp file, fsync, rename) so the
container runtime never reads half a spec.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamig.agent.plugin.cdi_base import BaseSpec, common_edits
from dynamig.agent.plugin.cdi_validation import check_spec, required_version
from dynamig.agent.plugin.instances import PreparedInstance
from dynamig.fileio import write_atomic

CDI_VENDOR = "k8s.mig.dynamig.io"
CDI_CLASS = "claim"
CDI_KIND = f"{CDI_VENDOR}/{CDI_CLASS}"
SPEC_PREFIX = f"{CDI_VENDOR}-{CDI_CLASS}_"
# Per-device variable with the MIG UUIDs of the device's request; NVIDIA_VISIBLE_DEVICES stays "void".
MIG_UUIDS_ENV = "DYNAMIG_MIG_UUIDS"
GPU_UUIDS_ENV = "DYNAMIG_GPU_UUIDS"  # the same for whole GPUs
# Control nodes every MIG device needs; in the base spec's common edits, else added by ``build_spec``.
CONTROL_NODES = ("nvidiactl", "nvidia-uvm")

_MINOR_RE = re.compile(r"^\s*DeviceFileMinor:\s*(\d+)\s*$", re.MULTILINE)
_CLAIM_UID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]*$")


class CapabilityError(Exception):
    """A capability file is missing or unreadable; the message names the file."""


@dataclass(frozen=True, slots=True)
class CapabilityMinors:
    """Minors of the ``/dev/nvidia-caps/nvidia-cap<N>`` nodes that grant access to one MIG instance."""

    gi_access: int
    ci_access: int


@dataclass(frozen=True, slots=True)
class CdiDevice:
    """One MIG instance of a claim, as it goes into the claim's CDI spec."""

    instance: PreparedInstance
    minors: CapabilityMinors | None  # None for a whole GPU: no capability nodes
    # MIG UUIDs of every device of the same request (NVIDIA_VISIBLE_DEVICES takes a list; a container that
    # references the request must see all of them, and CDI env entries do not merge).
    request_uuids: tuple[str, ...] = ()


def parse_access_file(text: str) -> int:
    """The ``DeviceFileMinor`` of an ``access`` file's content. Pure; ValueError if absent."""
    match = _MINOR_RE.search(text)
    if match is None:
        raise ValueError("no 'DeviceFileMinor: N' line")
    return int(match.group(1))


def capabilities_dir(proc_root: Path, gpu_minor: int) -> Path:
    """``<proc>/driver/nvidia/capabilities/gpu<minor>``. Pure."""
    return proc_root / "driver" / "nvidia" / "capabilities" / f"gpu{gpu_minor}"


def gi_access_path(proc_root: Path, gpu_minor: int, gi_id: int) -> Path:
    return capabilities_dir(proc_root, gpu_minor) / "mig" / f"gi{gi_id}" / "access"


def ci_access_path(proc_root: Path, gpu_minor: int, gi_id: int, ci_id: int) -> Path:
    return capabilities_dir(proc_root, gpu_minor) / "mig" / f"gi{gi_id}" / f"ci{ci_id}" / "access"


def _read_minor(path: Path) -> int:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CapabilityError(f"capability file {path} does not exist (is the MIG instance there?)") from None
    except OSError as exc:
        raise CapabilityError(f"cannot read capability file {path}: {exc.strerror}") from exc
    try:
        return parse_access_file(text)
    except ValueError:
        raise CapabilityError(f"capability file {path} has no 'DeviceFileMinor: N' line") from None


def read_capability_minors(proc_root: Path, instance: PreparedInstance) -> CapabilityMinors | None:
    """Reads the GI and CI capability minors of ``instance`` (None for a whole GPU, which has none). Side
    effect: reads procfs."""
    if instance.whole_gpu:
        return None
    gi = _read_minor(gi_access_path(proc_root, instance.gpu_minor, instance.gi_id))
    ci = _read_minor(ci_access_path(proc_root, instance.gpu_minor, instance.gi_id, instance.ci_id))
    return CapabilityMinors(gi_access=gi, ci_access=ci)


def device_nodes(instance: PreparedInstance, minors: CapabilityMinors | None) -> tuple[str, ...]:
    """Device node paths under ``/dev`` of the instance itself (not the control nodes), parent GPU first;
    a whole GPU's one node. Pure."""
    if minors is None:
        return (f"nvidia{instance.gpu_minor}",)
    return (
        f"nvidia{instance.gpu_minor}",
        f"nvidia-caps/nvidia-cap{minors.gi_access}",
        f"nvidia-caps/nvidia-cap{minors.ci_access}",
    )


def missing_device_nodes(dev_root: Path, nodes: Iterable[str]) -> list[Path]:
    """Those of ``nodes`` that do not exist under ``dev_root``. Side effect: stats files."""
    return [dev_root / n for n in nodes if not (dev_root / n).exists()]


def parse_char_major(proc_devices: str, name: str) -> int | None:
    """Major number of character device ``name`` in ``/proc/devices`` content, else None. Pure."""
    in_char = False
    for line in proc_devices.splitlines():
        if line.strip().endswith(":"):
            in_char = line.strip() == "Character devices:"
            continue
        parts = line.split()
        if in_char and len(parts) == 2 and parts[1] == name and parts[0].isdigit():
            return int(parts[0])
    return None


def create_capability_nodes(dev_root: Path, proc_root: Path, minors: CapabilityMinors | None) -> list[Path]:
    """Creates missing ``nvidia-caps/nvidia-cap<N>`` nodes (mode 0444, as ``nvidia-modprobe`` makes them)
    for the driver's ``nvidia-caps`` character device major. Returns the nodes created. Side effect: mknod.

    The driver creates a capability's procfs entry when the instance appears, but its ``/dev`` node only when
    something asks for it; on a node where nothing did, the container would get a dangling device.
    """
    if minors is None:
        return []
    wanted = [dev_root / "nvidia-caps" / f"nvidia-cap{m}" for m in (minors.gi_access, minors.ci_access)]
    missing = [p for p in wanted if not p.exists()]
    if not missing:
        return []
    try:
        major = parse_char_major((proc_root / "devices").read_text(), "nvidia-caps")
    except OSError:
        major = None
    if major is None:
        return []
    created: list[Path] = []
    for path in missing:
        minor = int(path.name.removeprefix("nvidia-cap"))
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mknod(path, 0o444 | stat.S_IFCHR, os.makedev(major, minor))
        except FileExistsError:
            continue
        os.chmod(path, 0o444)  # mknod's mode is filtered by the umask
        created.append(path)
    return created


def record_created_nodes(ledger: Path, nodes: Sequence[Path]) -> None:
    """Appends ``nodes`` to the ledger of device nodes this plugin made (uninstall removes exactly those,
    never the ones the driver or nvidia-modprobe made). Side effect: a file."""
    if nodes:
        ledger.parent.mkdir(parents=True, exist_ok=True)
        with ledger.open("a") as out:
            out.writelines(f"{n}\n" for n in nodes)


def cdi_device_name(claim_uid: str, device_name: str) -> str:
    """CDI device name of one device of a claim. Pure."""
    return f"{claim_uid}-{device_name}"


def cdi_device_id(claim_uid: str, device_name: str) -> str:
    """Fully qualified CDI device id (``vendor/class=name``) the kubelet hands to the runtime. Pure."""
    return f"{CDI_KIND}={cdi_device_name(claim_uid, device_name)}"


def _node_edits(nodes: Iterable[str], dev_root: Path) -> list[dict[str, str]]:
    return [{"path": f"/dev/{n}", "hostPath": str(dev_root / n)} for n in nodes]


def build_spec(
    claim_uid: str, devices: Sequence[CdiDevice], dev_root: Path, base: BaseSpec | None
) -> dict[str, Any]:
    """The CDI spec (as JSON-able dict) for one claim on top of the node's base spec. Pure.

    ``path`` is where a node appears in the container (always ``/dev/...``); ``hostPath`` is where it is on
    the host, under ``dev_root``. ``base`` None: device nodes only (simulated nodes).
    """
    cdi_devices: list[dict[str, Any]] = []
    for dev in devices:
        inst = dev.instance
        own = inst.parent_uuid if inst.whole_gpu else inst.mig_uuid
        uuids = ",".join(dev.request_uuids or (own,))
        env = GPU_UUIDS_ENV if inst.whole_gpu else MIG_UUIDS_ENV
        cdi_devices.append(
            {
                "name": cdi_device_name(claim_uid, inst.device_name),
                "containerEdits": {
                    "env": [f"{env}={uuids}"],
                    "deviceNodes": _node_edits(device_nodes(inst, dev.minors), dev_root),
                },
            }
        )
    if base is not None:
        edits = common_edits(base)
        annotations = {"mig.dynamig.io/claim-uid": claim_uid, "mig.dynamig.io/cdi-base-spec": str(base.path)}
    else:
        edits = {"env": ["NVIDIA_VISIBLE_DEVICES=void"], "deviceNodes": _node_edits(CONTROL_NODES, dev_root)}
        annotations = {"mig.dynamig.io/claim-uid": claim_uid}
    spec: dict[str, Any] = {
        "cdiVersion": "",
        "kind": CDI_KIND,
        "annotations": annotations,
        "devices": cdi_devices,
        "containerEdits": edits,
    }
    spec["cdiVersion"] = required_version(spec)
    return spec


def spec_path(cdi_root: Path, claim_uid: str) -> Path:
    """Spec file of a claim. Pure; ValueError for a UID that is not a safe file-name component."""
    if not _CLAIM_UID_RE.match(claim_uid):
        raise ValueError(f"claim UID {claim_uid!r} is not a valid UID")
    return cdi_root / f"{SPEC_PREFIX}{claim_uid}.json"


def claim_uid_of_spec(path: Path) -> str | None:
    """The claim UID a spec file written by ``write_spec`` belongs to, else None. Pure."""
    name = path.name
    if not (name.startswith(SPEC_PREFIX) and name.endswith(".json")):
        return None
    uid = name[len(SPEC_PREFIX) : -len(".json")]
    return uid if _CLAIM_UID_RE.match(uid) else None


def write_spec(cdi_root: Path, claim_uid: str, spec: dict[str, Any]) -> Path:
    """Validates a claim's spec and writes it atomically; returns its path. Side effect: file under
    ``cdi_root``. InvalidSpecError (nothing written) if the spec is not valid CDI."""
    path = spec_path(cdi_root, claim_uid)
    check_spec(spec, f"CDI spec for claim {claim_uid}")
    write_atomic(path, (json.dumps(spec, indent=2, sort_keys=True) + "\n").encode())
    return path


def remove_spec(cdi_root: Path, claim_uid: str) -> bool:
    """Removes a claim's spec; True if there was one. Side effect: deletes a file."""
    try:
        spec_path(cdi_root, claim_uid).unlink()
    except FileNotFoundError:
        return False
    return True


def spec_claim_uids(cdi_root: Path) -> set[str]:
    """UIDs of the claims that have a spec written by this plugin under ``cdi_root``. Reads the directory."""
    if not cdi_root.is_dir():
        return set()
    return {uid for p in cdi_root.iterdir() if (uid := claim_uid_of_spec(p)) is not None}
