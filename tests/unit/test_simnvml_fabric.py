"""The simulated NVML's NVLink links and NVLink fabric (``dynamig.backends.simfabric``) against nvml.h.

As in ``test_simnvml_fidelity.py``: each case names the C function ``pynvml`` calls (or the structure member,
``#define`` or return code), quotes the sentence of ``tests/data/nvml/nvml.h`` (verbatim from NVIDIA/go-nvml)
that states the behaviour, checks that the quote is in that documentation, then checks what the simulator
does. What nvml.h does not state (links per model, which models sit on an NVSwitch, the controls) are plain
tests below, each naming its source. A last test makes sure every NVML call of the agent's NVLink and fabric
reader (``dynamig.agent.nvml.fabric``) has a case here.
"""

from __future__ import annotations

import ctypes
import json
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml
import pytest
from nvml_doc import define_doc, define_value, doc_block, enum_doc, plain, typedef_member_doc

from dynamig.backends import simfabric, simstate
from dynamig.backends import simnvml as nv
from dynamig.backends.nvml import fresh_simulated_nvml
from dynamig.geometry.catalog import load_catalog

AGENT_FABRIC = Path(__file__).resolve().parents[2] / "operator" / "dynamig" / "agent" / "nvml" / "fabric.py"
ENABLED, DISABLED = pynvml.NVML_FEATURE_ENABLED, pynvml.NVML_FEATURE_DISABLED
COMPLETED = pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
IN_PROGRESS = pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS
MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    nv.reset()
    yield
    nv.reset()


def _gpus(*keys: str, **options: Any) -> list[Any]:
    nv.configure(list(keys), mig_enabled=False, **options)
    nv.nvmlInit()
    return [nv.nvmlDeviceGetHandleByIndex(i) for i in range(len(keys))]


def _states(h: Any, module: Any = nv) -> list[int | str]:
    """Each link's answer: its state, or the name of the error."""
    out: list[int | str] = []
    for link in range(MAX_LINKS):
        try:
            out.append(module.nvmlDeviceGetNvLinkState(h, link))
        except pynvml.NVMLError as exc:
            out.append(type(exc).__name__.removeprefix("NVMLError_"))
    return out


def _fabric(h: Any, info: Any = None, module: Any = nv) -> Any:
    info = pynvml.c_nvmlGpuFabricInfoV_t() if info is None else info
    assert module.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info)) == pynvml.NVML_SUCCESS
    return info


def _cluster(info: Any) -> str:
    return str(uuid.UUID(bytes=bytes(info.clusterUuid)))


# --- the cases: NVLink ---------------------------------------------------------------------------------


def links_active_until_taken_down() -> None:
    (h,) = _gpus("H100-80GB")
    assert _states(h)[:18] == [ENABLED] * 18
    nv.set_nvlink_active(0, 3, False)
    states = _states(h)
    assert states[3] == DISABLED and states[:3] + states[4:18] == [ENABLED] * 17
    nv.set_nvlink_active(0, 3)
    assert _states(h)[3] == ENABLED


def a_link_the_gpu_lacks_is_invalid() -> None:
    a100, h100 = _gpus("A100-80GB", "H100-80GB")
    assert _states(a100) == [ENABLED] * 12 + ["InvalidArgument"] * (MAX_LINKS - 12)
    assert _states(h100) == [ENABLED] * 18 + ["InvalidArgument"] * (MAX_LINKS - 18)
    for link in (MAX_LINKS, 2**32 - 1):  # beyond NVML_NVLINK_MAX_LINKS
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            nv.nvmlDeviceGetNvLinkState(h100, link)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # no GPU 5: not a device
        nv.nvmlDeviceGetNvLinkState(simstate.gpu_handle(5), 0)


def no_nvlink_not_supported() -> None:
    l4, rtx = _gpus("L4-24GB", "RTXPRO6000-96GB")
    assert _states(l4) == _states(rtx) == ["NotSupported"] * MAX_LINKS
    with pytest.raises(pynvml.NVMLError_NotSupported):  # whatever the index
        nv.nvmlDeviceGetNvLinkState(l4, MAX_LINKS)


def nvlink_state_needs_init() -> None:
    (h,) = _gpus("H100-80GB")
    nv.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlDeviceGetNvLinkState(h, 0)


def no_model_has_more_links_than_the_maximum() -> None:
    assert define_value("NVML_NVLINK_MAX_LINKS") == MAX_LINKS
    assert max(simfabric.NVLINK_LINKS.values()) <= MAX_LINKS
    (h,) = _gpus("B200-180GB")
    assert _states(h)[:18] == [ENABLED] * 18


# --- the cases: the fabric -----------------------------------------------------------------------------


def hopper_and_later_only() -> None:
    hoppers = ("H100-80GB", "H200-141GB", "H20-96GB", "H100-96GB", "B200-180GB", "GB200-186GB")
    handles = _gpus("A100-80GB", "A30-24GB", *hoppers)
    for h in handles[:2]:  # Ampere
        with pytest.raises(pynvml.NVMLError_NotSupported):
            _fabric(h)
    assert all(_fabric(h).state == COMPLETED for h in handles[2:])


def registered_on_an_nvswitch_system() -> None:
    h100, h200 = _gpus("H100-80GB", "H200-141GB")
    for h in (h100, h200):
        info = _fabric(h)
        assert (info.state, info.status) == (COMPLETED, pynvml.NVML_SUCCESS)
        assert any(bytes(info.clusterUuid))
    legacy = pynvml.c_nvmlGpuFabricInfo_t()
    assert nv.nvmlDeviceGetGpuFabricInfo(h100, ctypes.byref(legacy)) == pynvml.NVML_SUCCESS
    assert (legacy.state, legacy.status, _cluster(legacy)) == (COMPLETED, 0, _cluster(_fabric(h100)))


def fabric_not_supported() -> None:
    for h in _gpus("L4-24GB", "A100-80GB", "H100-94GB", "RTXPRO6000-96GB"):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            nv.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(pynvml.c_nvmlGpuFabricInfo_t()))
        with pytest.raises(pynvml.NVMLError_NotSupported):
            _fabric(h)


def v2_or_later_structures() -> None:
    (h,) = _gpus("GB200-186GB")
    v2 = _fabric(h, pynvml.c_nvmlGpuFabricInfo_v2_t())
    v3 = _fabric(h, pynvml.c_nvmlGpuFabricInfo_v3_t())
    assert v2.version == pynvml.nvmlGpuFabricInfo_v2 and v3.version == pynvml.nvmlGpuFabricInfo_v3
    for info in (v2, v3):
        assert (info.state, info.status, info.cliqueId) == (COMPLETED, 0, simfabric.DEFAULT_CLIQUE_ID)
        assert _cluster(info) == _cluster(v2)
    assert (v2.healthMask, v3.healthMask, v3.healthSummary) == (0, 0, 0)  # each field: NOT_SUPPORTED


def version_must_be_set() -> None:
    (h,) = _gpus("H100-80GB")
    for version in (0, 1, pynvml.nvmlGpuFabricInfo_v3 + 1):
        info = pynvml.c_nvmlGpuFabricInfo_v2_t()
        info.version = version
        with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
            nv.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info))
        assert info.state == 0 and not any(bytes(info.clusterUuid))  # left as it was


def cluster_of_the_gpu() -> None:
    a, b = _gpus("H100-80GB", "H100-80GB", seed="node-a")
    assert _cluster(_fabric(a)) == _cluster(_fabric(b))  # one node, one NVLink domain
    other = fresh_simulated_nvml()
    try:
        other.configure(["H100-80GB"], seed="node-b", mig_enabled=False)
        other.nvmlInit()
        there = _fabric(other.nvmlDeviceGetHandleByIndex(0), module=other)
        assert _cluster(there) != _cluster(_fabric(a))  # another node: another cluster
        other.set_fabric(0, cluster_uuid=_cluster(_fabric(a)))  # one NVLink domain across both nodes
        assert _cluster(_fabric(other.nvmlDeviceGetHandleByIndex(0), module=other)) == _cluster(_fabric(a))
    finally:
        other.reset()


def clique_of_the_gpu() -> None:
    a, b = _gpus("GB200-186GB", "GB200-186GB")
    assert _fabric(a).cliqueId == _fabric(b).cliqueId == simfabric.DEFAULT_CLIQUE_ID
    nv.set_fabric(1, clique_id=7)
    assert (_fabric(a).cliqueId, _fabric(b).cliqueId) == (simfabric.DEFAULT_CLIQUE_ID, 7)


def status_of_a_completed_probe() -> None:
    (h,) = _gpus("H100-80GB")
    nv.set_fabric(0, status=pynvml.NVML_ERROR_UNKNOWN)
    info = _fabric(h)
    assert (info.state, info.status) == (COMPLETED, pynvml.NVML_ERROR_UNKNOWN)
    nv.set_fabric(0)  # the model's answer again
    assert _fabric(h).status == pynvml.NVML_SUCCESS


def state_while_probing() -> None:
    (h,) = _gpus("H100-80GB")
    for state in (pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED, IN_PROGRESS):
        nv.set_fabric(0, state=state)
        info = _fabric(h)
        assert info.state == state
        assert not any(bytes(info.clusterUuid)) and info.cliqueId == 0  # stated assumption: not yet known


def state_values_are_nvml_hs() -> None:
    for name in ("NOT_SUPPORTED", "NOT_STARTED", "IN_PROGRESS", "COMPLETED"):
        full = f"NVML_GPU_FABRIC_STATE_{name}"
        assert getattr(pynvml, full) == getattr(nv, full) == define_value(full)
    assert pynvml.NVML_GPU_FABRIC_UUID_LEN == define_value("NVML_GPU_FABRIC_UUID_LEN") == 16
    (h,) = _gpus("H100-80GB")
    assert _fabric(h).state == define_value("NVML_GPU_FABRIC_STATE_COMPLETED")


@dataclass(frozen=True)
class Case:
    pynvml_name: str  # the pynvml function the agent calls
    c_function: str  # the C function; "typedef:<name>:<member>", "define:<name>" or "enum:<name>" otherwise
    quote: str  # the documenting sentence, verbatim (whitespace aside)
    check: Callable[[], None]


STATE, INFO, INFO_V = "nvmlDeviceGetNvLinkState", "nvmlDeviceGetGpuFabricInfo", "nvmlDeviceGetGpuFabricInfoV"
FABRIC_T = "typedef:nvmlGpuFabricInfo_t"
CASES = [
    Case(STATE, STATE, "NVML_FEATURE_ENABLED indicates that the link is active and NVML_FEATURE_DISABLED "
         "indicates it is inactive", links_active_until_taken_down),
    Case(STATE, STATE, "NVML_ERROR_INVALID_ARGUMENT if device or link is invalid or isActive is NULL",
         a_link_the_gpu_lacks_is_invalid),
    Case(STATE, STATE, "NVML_ERROR_NOT_SUPPORTED if the device doesn't support this feature",
         no_nvlink_not_supported),
    Case(STATE, STATE, "NVML_ERROR_UNINITIALIZED if the library has not been successfully initialized",
         nvlink_state_needs_init),
    Case(STATE, "define:NVML_NVLINK_MAX_LINKS", "Maximum number of NVLink links supported.",
         no_model_has_more_links_than_the_maximum),
    Case(INFO, INFO, "For Hopper &tm; or newer fully supported devices.", hopper_and_later_only),
    Case(INFO, INFO, "On Hopper + NVSwitch systems, GPU is registered with the NVIDIA Fabric Manager Upon "
         "successful registration, the GPU is added to the NVLink fabric to enable peer-to-peer "
         "communication.", registered_on_an_nvswitch_system),
    Case(INFO, INFO, "NVML_ERROR_NOT_SUPPORTED If device doesn't support gpu fabric", fabric_not_supported),
    Case(INFO_V, INFO_V, "For Hopper &tm; or newer fully supported devices.", hopper_and_later_only),
    Case(INFO_V, INFO_V, "NVML_ERROR_NOT_SUPPORTED If device doesn't support gpu fabric",
         fabric_not_supported),
    Case(INFO_V, INFO_V, "Versioned wrapper around nvmlDeviceGetGpuFabricInfo that accepts a versioned "
         "nvmlGpuFabricInfo_v2_t or later output structure.", v2_or_later_structures),
    Case(INFO_V, INFO_V, "The caller must set the nvmlGpuFabricInfoV_t.version field to the appropriate "
         "version prior to calling this function.", version_must_be_set),
    Case(INFO_V, "enum:NVML_ERROR_ARGUMENT_VERSION_MISMATCH", "The provided version is invalid/unsupported",
         version_must_be_set),
    Case(INFO_V, f"{FABRIC_T}:clusterUuid", "Uuid of the cluster to which this GPU belongs",
         cluster_of_the_gpu),
    Case(INFO_V, f"{FABRIC_T}:cliqueId", "ID of the fabric clique to which this GPU belongs",
         clique_of_the_gpu),
    Case(INFO_V, f"{FABRIC_T}:status", 'Error status, if any. Must be checked only if state returns '
         '"complete".', status_of_a_completed_probe),
    Case(INFO_V, f"{FABRIC_T}:state",
         "Current state of GPU registration process. See NVML_GPU_FABRIC_STATE_*", state_while_probing),
    Case(INFO_V, "define:NVML_GPU_FABRIC_STATE_COMPLETED", "Fabric Probe State completed",
         state_values_are_nvml_hs),
    Case(INFO_V, "define:NVML_GPU_FABRIC_STATE_IN_PROGRESS", "Fabric Probe in progress", state_while_probing),
    Case(INFO_V, "define:NVML_GPU_FABRIC_STATE_NOT_STARTED", "Fabric Probe has not started",
         state_while_probing),
]  # fmt: skip


def _documented(case: Case) -> str:
    kind, _, rest = case.c_function.partition(":")
    if kind == "typedef":
        typedef, member = rest.split(":")
        return typedef_member_doc(typedef, member)
    if kind == "define":
        return define_doc(rest)
    if kind == "enum":
        return enum_doc(rest)
    return doc_block(case.c_function)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.c_function}:{c.check.__name__}")
def test_simulator_does_what_nvml_h_documents(case: Case) -> None:
    doc = plain(_documented(case))
    assert plain(case.quote) in doc, f"nvml.h does not say {case.quote!r} for {case.c_function}"
    case.check()


def test_a_misquoted_behaviour_is_caught() -> None:
    """The quote check can fail: what nvml.h says of one function or member is not found in another's."""
    assert "For Hopper" not in doc_block(STATE)
    assert "Pascal" in doc_block(STATE)
    assert "NVML_ERROR_INVALID_ARGUMENT" not in doc_block(INFO)
    uuid_doc = "Uuid of the cluster to which this GPU belongs"
    assert typedef_member_doc("nvmlGpuFabricInfo_t", "cliqueId") != uuid_doc
    assert define_doc("NVML_GPU_FABRIC_STATE_COMPLETED") != define_doc("NVML_GPU_FABRIC_STATE_IN_PROGRESS")


def test_every_nvml_call_of_the_fabric_reader_has_a_documented_case() -> None:
    called = set(re.findall(r"\bnv\.(nvml\w+)\(", AGENT_FABRIC.read_text()))
    assert {STATE, INFO, INFO_V} <= called
    covered = {c.pynvml_name for c in CASES}
    missing = sorted(called - covered)
    assert not missing, f"NVML calls of the fabric reader with no nvml.h case: {missing}"


# --- per model, the controls, the state file (not in nvml.h) -----------------------------------------------


def test_links_per_model() -> None:
    """Links from NVIDIA's datasheets (NVLink bandwidth / per-link bandwidth; simfabric's docstring): A100
    SXM4 12, A30 4 (bridge), H100 SXM5 18, H100 NVL 12 (bridges), H200 18, B200 18; L4 and RTX PRO 6000 have
    no NVLink."""
    keys = ["A100-40GB", "A100-80GB", "A30-24GB", "H100-80GB", "H100-94GB", "H200-141GB", "B200-180GB"]
    handles = _gpus(*keys, "L4-24GB", "RTXPRO6000-96GB")
    counts = [_states(h).count(ENABLED) for h in handles]
    assert counts == [12, 12, 4, 18, 12, 18, 18, 0, 0]
    assert nv.nvmlDeviceGetName(handles[0]) == "NVIDIA A100-SXM4-40GB"  # the model the key stands for
    assert nv.nvmlDeviceGetName(handles[4]) == "NVIDIA H100 NVL"


def test_the_tables_name_catalog_models() -> None:
    catalog = set(load_catalog().keys())
    assert set(simfabric.NVLINK_LINKS) <= catalog
    assert set(simfabric.NVLINK_LINKS) >= simfabric.NVSWITCH_MODELS  # an NVSwitch system has NVLink


def test_nvlink_state_does_not_follow_mig_mode() -> None:
    """Stated assumption: the links' state is the GPU's, MIG mode or not."""
    nv.configure(["A100-80GB"], mig_enabled=True)
    nv.nvmlInit()
    assert _states(nv.nvmlDeviceGetHandleByIndex(0)).count(ENABLED) == 12


def test_mig_device_handles_are_not_devices_here() -> None:
    """NVLink and the fabric belong to the GPU: a MIG device or GPU instance handle answers InvalidArgument,
    as every parent-only query of the simulator does (nvml.h does not say what these two answer for one)."""
    (h,) = _gpus("H100-80GB")
    nv.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE)
    gi = nv.nvmlDeviceCreateGpuInstance(h, 0)  # 7g.80gb
    nv.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE)
    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    for handle in (mig, gi):
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            nv.nvmlDeviceGetNvLinkState(handle, 0)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            _fabric(handle)
    assert _states(h).count(ENABLED) == 18


def test_a_lost_gpu_answers_gpu_is_lost() -> None:
    (h,) = _gpus("H100-80GB")
    nv.set_gpu_lost(0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nv.nvmlDeviceGetNvLinkState(h, 0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        _fabric(h)


def test_controls_refuse_what_the_model_lacks() -> None:
    _gpus("L4-24GB", "A100-80GB", "H100-80GB")
    with pytest.raises(ValueError, match="no NVLink link 0"):
        nv.set_nvlink_active(0, 0, False)
    with pytest.raises(ValueError, match="no NVLink link 12"):
        nv.set_nvlink_active(1, 12, False)
    with pytest.raises(ValueError, match="NotSupported"):
        nv.set_fabric(1)  # Ampere: no fabric query
    with pytest.raises(ValueError, match="none of NVML_GPU_FABRIC_STATE"):
        nv.set_fabric(2, state=4)
    with pytest.raises(ValueError):
        nv.set_fabric(2, cluster_uuid="not-a-uuid")
    with pytest.raises(ValueError, match="unsigned 32-bit"):
        nv.set_fabric(2, clique_id=-1)


def test_the_zero_cluster_uuid_of_a_single_node_system() -> None:
    """An NVLink system that is not a multi-node one registers with the all-zero cluster UUID (NVIDIA's DRA
    driver: "Expected for systems which are NVLink-capable, but not MNNVL-capable"): set_fabric models it."""
    (h,) = _gpus("H100-80GB")
    nv.set_fabric(0, cluster_uuid=simfabric.ZERO_CLUSTER_UUID, clique_id=0)
    info = _fabric(h)
    assert (info.state, info.status, info.cliqueId) == (COMPLETED, 0, 0) and not any(bytes(info.clusterUuid))


def test_settings_live_in_the_state_file(tmp_path: Path) -> None:
    """Another process attached to the same state file (here a separate copy of the simulator) sees a link
    taken down and a fabric answer set; a state file written before these settings existed loads with the
    models' defaults."""
    state = tmp_path / "gpus.json"
    (h,) = _gpus("H100-80GB", state_file=state)
    cluster = _cluster(_fabric(h))
    nv.set_nvlink_active(0, 17, False)
    nv.set_fabric(0, state=IN_PROGRESS)
    other = fresh_simulated_nvml()
    try:
        other.configure([], state_file=state)
        other.nvmlInit()
        there = other.nvmlDeviceGetHandleByIndex(0)
        assert _states(there, other)[17] == DISABLED
        assert _fabric(there, module=other).state == IN_PROGRESS
        doc = json.loads(state.read_text())
        for gpu in doc["gpus"]:
            for key in list(gpu):
                if key.startswith(("nvlink_", "fabric_")):
                    del gpu[key]
        state.write_text(json.dumps(doc))
        other.configure([], state_file=state)
        other.nvmlInit()
        there = other.nvmlDeviceGetHandleByIndex(0)
        assert _states(there, other).count(ENABLED) == 18
        assert _cluster(_fabric(there, module=other)) == cluster
    finally:
        other.reset()
