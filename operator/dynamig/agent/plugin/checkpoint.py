"""The plugin's checkpoint: which claims are prepared on this node and with what answer.

A versioned JSON document with a checksum over its data, written temp file -> fsync -> rename, so a plugin
that restarts (or crashes mid-write) reads either the old or the new state and answers the kubelet as before.
The format is an API: ``version`` names the schema; an unknown version or a checksum mismatch is refused
with an error instead of being silently taken as "nothing prepared".

``encode``/``decode`` are pure; ``CheckpointStore`` reads and writes the file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamig.agent.plugin.instances import PreparedInstance
from dynamig.fileio import write_atomic

CHECKPOINT_VERSION = "mig.dynamig.io/checkpoint/v1"


class CheckpointError(Exception):
    """The checkpoint file exists but cannot be trusted (corrupt, unknown version, bad checksum)."""


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One device of a prepared claim, as answered to the kubelet."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    instance: PreparedInstance


@dataclass(frozen=True, slots=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]


def _instance_to_json(i: PreparedInstance) -> dict[str, Any]:
    return {
        "deviceName": i.device_name,
        "migUUID": i.mig_uuid,
        "parentUUID": i.parent_uuid,
        "gpuIndex": i.gpu_index,
        "gpuMinor": i.gpu_minor,
        "giID": i.gi_id,
        "ciID": i.ci_id,
        "profile": i.profile,
        "placementStart": i.placement_start,
    }


def _instance_from_json(d: dict[str, Any]) -> PreparedInstance:
    return PreparedInstance(
        device_name=str(d["deviceName"]),
        mig_uuid=str(d["migUUID"]),
        parent_uuid=str(d["parentUUID"]),
        gpu_index=int(d["gpuIndex"]),
        gpu_minor=int(d["gpuMinor"]),
        gi_id=int(d["giID"]),
        ci_id=int(d["ciID"]),
        profile=str(d.get("profile", "")),
        placement_start=int(d.get("placementStart", -1)),
    )


def _claims_to_json(claims: dict[str, PreparedClaim]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for uid in sorted(claims):
        c = claims[uid]
        out[uid] = {
            "namespace": c.namespace,
            "name": c.name,
            "devices": [
                {
                    "requestNames": list(d.request_names),
                    "poolName": d.pool_name,
                    "deviceName": d.device_name,
                    "cdiDeviceIDs": list(d.cdi_device_ids),
                    "instance": _instance_to_json(d.instance),
                }
                for d in c.devices
            ],
        }
    return out


def _claims_from_json(data: dict[str, Any]) -> dict[str, PreparedClaim]:
    claims: dict[str, PreparedClaim] = {}
    for uid, c in data.items():
        devices = tuple(
            PreparedDevice(
                request_names=tuple(str(r) for r in d["requestNames"]),
                pool_name=str(d["poolName"]),
                device_name=str(d["deviceName"]),
                cdi_device_ids=tuple(str(x) for x in d["cdiDeviceIDs"]),
                instance=_instance_from_json(d["instance"]),
            )
            for d in c["devices"]
        )
        claims[str(uid)] = PreparedClaim(
            uid=str(uid), namespace=str(c["namespace"]), name=str(c["name"]), devices=devices
        )
    return claims


def _checksum(version: str, data: Any) -> str:
    canonical = json.dumps({"version": version, "data": data}, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def encode(claims: dict[str, PreparedClaim]) -> bytes:
    """The checkpoint document for ``claims``. Pure."""
    data = {"preparedClaims": _claims_to_json(claims)}
    doc = {"version": CHECKPOINT_VERSION, "checksum": _checksum(CHECKPOINT_VERSION, data), "data": data}
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def decode(raw: bytes) -> dict[str, PreparedClaim]:
    """Claims of a checkpoint document. Pure; CheckpointError when it cannot be trusted."""
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise CheckpointError("checkpoint is not a JSON object")
    version = doc.get("version")
    if version != CHECKPOINT_VERSION:
        raise CheckpointError(f"checkpoint version {version!r} is not supported ({CHECKPOINT_VERSION!r} is)")
    data = doc.get("data")
    if not isinstance(data, dict):
        raise CheckpointError("checkpoint has no data object")
    if doc.get("checksum") != _checksum(CHECKPOINT_VERSION, data):
        raise CheckpointError("checkpoint checksum does not match its data (file corrupted or edited)")
    try:
        return _claims_from_json(data["preparedClaims"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint data is malformed: {exc!r}") from exc


class CheckpointStore:
    """Reads and writes the checkpoint file. Not thread-safe: the driver serialises access."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[str, PreparedClaim]:
        """Prepared claims from disk; empty when there is no file yet. Side effect: reads the file."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            return decode(raw)
        except CheckpointError as exc:
            raise CheckpointError(f"{self.path}: {exc}") from exc

    def save(self, claims: dict[str, PreparedClaim]) -> None:
        """Replaces the checkpoint atomically. Side effect: writes the file."""
        write_atomic(self.path, encode(claims), mode=0o600)
