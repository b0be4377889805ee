"""The simulated GPUs' NVLink links and NVLink fabric: ``nvmlDeviceGetNvLinkState``,
``nvmlDeviceGetGpuFabricInfo`` and ``nvmlDeviceGetGpuFabricInfoV`` as nvml.h documents them, per GPU model,
and the simulation controls that change them.

Part of :mod:`dynamig.backends.simnvml`, which wraps the functions here (it stays the drop-in for ``pynvml``);
what a control changes lives in simnvml's GPU records (:class:`FabricState`) and so in its JSON state file.
``tests/unit/test_simnvml_fabric.py`` checks each behaviour below against the sentence of nvml.h it rests on
(``tests/data/nvml/nvml.h``).

NVLink (``nvmlDeviceGetNvLinkState``):

- nvml.h: "NVML_FEATURE_ENABLED indicates that the link is active and NVML_FEATURE_DISABLED indicates it is
  inactive". Every link of a model with NVLink is active (a fitted bridge or an NVSwitch baseboard) until
  :func:`set_nvlink_active` takes it down.
- nvml.h: "NVML_ERROR_INVALID_ARGUMENT if device or link is invalid": a link index from the model's link
  count up to ``NVML_NVLINK_MAX_LINKS`` and beyond answers ``InvalidArgument``.
- nvml.h: "NVML_ERROR_NOT_SUPPORTED if the device doesn't support this feature": a model without NVLink
  (L4, RTX PRO 6000) answers ``NotSupported`` for every link, whatever its index.

  Links per model (:data:`NVLINK_LINKS`), from NVIDIA's datasheets: a model's NVLink bandwidth divided by
  its generation's per-link bandwidth (50 GB/s, both directions, for the third and fourth generation; 100
  GB/s for the fifth). A100 SXM4: 600 GB/s, 12 links (the count NVIDIA's A100 whitepaper gives); A30
  (bridge): 200 GB/s, 4; H100 SXM5, H200, H20 and GH200: 900 GB/s, 18 (the count of the H100 whitepaper);
  H100 NVL (bridges): 600 GB/s, 12; B200 and GB200: 1.8 TB/s, 18. Derived, not read from a GPU. Each
  catalog key stands for the model simnvml names (``nvmlDeviceGetName``): ``A100-80GB`` is an A100 SXM4,
  ``H100-80GB`` an H100 SXM5, ``H100-94GB`` an H100 NVL.

The fabric (``nvmlDeviceGetGpuFabricInfo``, and ``...InfoV`` with a versioned structure):

- nvml.h: "For Hopper &tm; or newer fully supported devices." and "On Hopper + NVSwitch systems, GPU is
  registered with the NVIDIA Fabric Manager": a Hopper or Blackwell model on an NVSwitch baseboard or
  NVLink domain (:data:`NVSWITCH_MODELS`: H100 SXM5, H200, H20, GH200, B200, GB200) answers
  ``NVML_GPU_FABRIC_STATE_COMPLETED`` with status ``NVML_SUCCESS``, the simulated node's cluster UUID
  (:func:`node_cluster_uuid`, one per simulated machine, derived from its first GPU's UUID) and clique
  :data:`DEFAULT_CLIQUE_ID`; every other model, Ampere included, answers ``NotSupported``
  ("NVML_ERROR_NOT_SUPPORTED If device doesn't support gpu fabric"). The H100 NVL (bridged PCIe cards, no
  NVSwitch) is taken as ``NotSupported`` too.
- nvml.h (``...InfoV``): "accepts a versioned nvmlGpuFabricInfo_v2_t or later output structure" and "The
  caller must set the nvmlGpuFabricInfoV_t.version field": a structure whose ``version`` is neither
  ``nvmlGpuFabricInfo_v2`` nor ``nvmlGpuFabricInfo_v3`` answers ``NVML_ERROR_ARGUMENT_VERSION_MISMATCH``
  ("The provided version is invalid/unsupported", nvml.h's return codes; the function's own list does not
  name a code for it).
- :func:`set_fabric` sets a GPU's probe state, status, cluster UUID and clique (a fabric not yet probed,
  a registration that failed, GPUs of several simulated nodes in one NVLink domain, or the all-zero cluster
  UUID of an NVLink system that is not a multi-node one).

Assumptions, stated (nvml.h says nothing of them): by default every NVSwitch GPU is taken as registered in a
multi-node fabric, whose cluster is its simulated node (a single-node NVSwitch baseboard answers the all-zero
cluster UUID instead: :func:`set_fabric` with :data:`ZERO_CLUSTER_UUID`); a structure is filled with the
cluster UUID and clique only once the probe state is ``COMPLETED`` (zeros before); the health fields of the
versioned structures are 0 (``..._NOT_SUPPORTED``); NVLink state does not depend on MIG mode; the clique id
of 1 is arbitrary.
"""

from __future__ import annotations

import ctypes
import types
import uuid
from dataclasses import dataclass, field
from typing import Any

from pynvml import (
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_FEATURE_DISABLED,
    NVML_FEATURE_ENABLED,
    NVML_GPU_FABRIC_STATE_COMPLETED,
    NVML_GPU_FABRIC_STATE_NOT_SUPPORTED,
    NVML_GPU_FABRIC_UUID_LEN,
    NVML_SUCCESS,
    NVMLError,
    nvmlGpuFabricInfo_v2,
    nvmlGpuFabricInfo_v3,
)

from dynamig.backends.simmode import gpu_model
from dynamig.geometry.generation import Generation, generation
from dynamig.geometry.model import GpuModel

# NVLink links of each catalog model with NVLink (see the module docstring for the figures' source).
NVLINK_LINKS: dict[str, int] = {
    "A100-40GB": 12,
    "A100-80GB": 12,
    "A30-24GB": 4,
    "H100-80GB": 18,
    "H100-94GB": 12,
    "H100-96GB": 18,
    "H200-141GB": 18,
    "H20-96GB": 18,
    "B200-180GB": 18,
    "GB200-186GB": 18,
}

# Models whose GPUs sit on an NVSwitch baseboard or in an NVLink domain, registered with the Fabric Manager.
NVSWITCH_MODELS: frozenset[str] = frozenset(
    {"H100-80GB", "H100-96GB", "H200-141GB", "H20-96GB", "B200-180GB", "GB200-186GB"}
)

# Generations nvml.h documents the fabric query for: "For Hopper &tm; or newer fully supported devices."
_FABRIC_GENERATIONS = frozenset({Generation.HOPPER, Generation.BLACKWELL})

DEFAULT_CLIQUE_ID = 1
ZERO_CLUSTER_UUID = str(uuid.UUID(int=0))  # an NVLink system that is not part of a multi-node fabric
_VERSIONS = (nvmlGpuFabricInfo_v2, nvmlGpuFabricInfo_v3)
_CLUSTER_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_DNS, "fabric.simnvml.dynamig.io")


def _error(code: int) -> Exception:
    err: Exception = NVMLError(code)  # pynvml maps the code to its NVMLError_* subclass
    return err


@dataclass(kw_only=True)
class FabricState:
    """A simulated GPU's NVLink and fabric settings, kept in simnvml's GPU records (and so in its state
    file). The defaults are the model's: every link active, the fabric probed and registered."""

    nvlink_inactive: list[int] = field(default_factory=list)  # links taken down with set_nvlink_active
    fabric_state: int = NVML_GPU_FABRIC_STATE_COMPLETED
    fabric_status: int = NVML_SUCCESS
    fabric_cluster_uuid: str | None = None  # None: the simulated node's own (node_cluster_uuid)
    fabric_clique_id: int = DEFAULT_CLIQUE_ID


def nvlink_links(model: GpuModel) -> int:
    """How many NVLink links a model has (0: no NVLink). Pure."""
    return NVLINK_LINKS.get(model.key, 0)


def fabric_supported(model: GpuModel) -> bool:
    """Whether the model answers the fabric query (Hopper or later on an NVSwitch system). Pure."""
    return model.key in NVSWITCH_MODELS and generation(model.key) in _FABRIC_GENERATIONS


def node_cluster_uuid(gpu_uuids: list[str]) -> str:
    """The cluster UUID of a simulated node: one per node, derived from its first GPU's UUID (so from the
    node's seed). Pure."""
    return str(uuid.uuid5(_CLUSTER_NAMESPACE, gpu_uuids[0] if gpu_uuids else ""))


# Every function below that reads or changes the simulated machine takes the simulator module ``nv`` that
# calls it (as simmode's do), so a separate copy of simnvml reads its own GPUs.


def nvlink_state(nv: types.ModuleType, device: Any, link: int) -> int:
    """``nvmlDeviceGetNvLinkState`` of simulator ``nv``: ``NVML_FEATURE_ENABLED`` or ``..._DISABLED``."""
    from dynamig.backends import simstate  # here, not at the top: simstate imports this module

    r = nv._read(device, simstate.KIND_GPU)
    links = nvlink_links(r.model)
    if not links:
        raise _error(NVML_ERROR_NOT_SUPPORTED)
    if not 0 <= int(link) < links:
        raise _error(NVML_ERROR_INVALID_ARGUMENT)
    return int(NVML_FEATURE_DISABLED if int(link) in r.gpu.nvlink_inactive else NVML_FEATURE_ENABLED)


def fabric_info(nv: types.ModuleType, device: Any, info_ref: Any, *, versioned: bool = False) -> int:
    """``nvmlDeviceGetGpuFabricInfo`` (``versioned``: ``...InfoV``) of simulator ``nv``: fills the structure
    ``info_ref`` points at (or is) and returns ``NVML_SUCCESS``, as ``pynvml``'s wrapper does."""
    from dynamig.backends import simstate  # here, not at the top: simstate imports this module

    r = nv._read(device, simstate.KIND_GPU)
    info = simstate.deref(info_ref)  # InvalidArgument for NULL
    if versioned and getattr(info, "version", None) not in _VERSIONS:
        raise _error(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    if not fabric_supported(r.model):
        raise _error(NVML_ERROR_NOT_SUPPORTED)
    gpu = r.gpu
    completed = gpu.fabric_state == NVML_GPU_FABRIC_STATE_COMPLETED
    cluster = gpu.fabric_cluster_uuid or node_cluster_uuid([g.uuid for g in r.state.gpus])
    raw = uuid.UUID(cluster).bytes if completed else bytes(NVML_GPU_FABRIC_UUID_LEN)
    ctypes.memmove(info.clusterUuid, raw, NVML_GPU_FABRIC_UUID_LEN)
    info.status = gpu.fabric_status
    info.cliqueId = gpu.fabric_clique_id if completed else 0
    info.state = gpu.fabric_state
    for health in ("healthMask", "healthSummary"):  # the versioned structures: no health information
        if hasattr(info, health):
            setattr(info, health, 0)
    return int(NVML_SUCCESS)


# --- simulation controls (not in pynvml) -----------------------------------------------------------------


def set_nvlink_active(nv: types.ModuleType, index: int, link: int, active: bool = True) -> None:
    """Take NVLink ``link`` of GPU ``index`` down (``active=False``: it answers ``NVML_FEATURE_DISABLED``)
    or bring it back up. ValueError if the model has no such link. Side effect: state."""
    sim = nv._sim()
    with sim.mutate() as st:
        gpu = st.gpus[index]
        links = nvlink_links(gpu_model(gpu.model))
        if not 0 <= link < links:
            raise ValueError(f"GPU {index} ({gpu.model}) has no NVLink link {link}: it has {links}")
        down = set(gpu.nvlink_inactive)
        if active:
            down.discard(link)
        else:
            down.add(link)
        gpu.nvlink_inactive = sorted(down)


def set_fabric(
    nv: types.ModuleType,
    index: int,
    *,
    state: int = NVML_GPU_FABRIC_STATE_COMPLETED,
    status: int = NVML_SUCCESS,
    cluster_uuid: str | None = None,
    clique_id: int = DEFAULT_CLIQUE_ID,
) -> None:
    """What the fabric query answers for GPU ``index`` from now on: probe ``state`` (an
    ``NVML_GPU_FABRIC_STATE_*``), ``status`` (an NVML return code), ``cluster_uuid`` (None: the simulated
    node's own; give several nodes one to put them in one NVLink domain) and ``clique_id``. The defaults
    restore the model's answer. ValueError for a model without the fabric query or a bad value. Side
    effect: state."""
    if not NVML_GPU_FABRIC_STATE_NOT_SUPPORTED <= state <= NVML_GPU_FABRIC_STATE_COMPLETED:
        raise ValueError(f"fabric state {state!r} is none of NVML_GPU_FABRIC_STATE_*")
    if not 0 <= clique_id < 2**32:
        raise ValueError(f"clique id {clique_id!r} is not an unsigned 32-bit integer")
    cluster = None if cluster_uuid is None else str(uuid.UUID(cluster_uuid))  # ValueError if not a UUID
    sim = nv._sim()
    with sim.mutate() as st:
        gpu = st.gpus[index]
        if not fabric_supported(gpu_model(gpu.model)):
            raise ValueError(f"GPU {index} ({gpu.model}) answers the fabric query NotSupported")
        gpu.fabric_state, gpu.fabric_status = int(state), int(status)
        gpu.fabric_cluster_uuid, gpu.fabric_clique_id = cluster, int(clique_id)
