"""The simulated NVML's MIG mode (``dynamig.backends.simmode``) against nvml.h, behaviour by behaviour.

As in ``test_simnvml_fidelity.py``: each case names the C function ``pynvml`` calls, quotes the sentence of
``tests/data/nvml/nvml.h`` (verbatim from NVIDIA/go-nvml) that states the behaviour, checks that the quote is
in that function's documentation block, then checks what the simulator does. Behaviours nvml.h does not
state (the per-generation switch, a GPU with no MIG model, the stated assumptions) are plain tests below,
each naming its source.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml
import pytest
from nvml_doc import doc_block, member_doc, squash

from dynamig.backends import simmode
from dynamig.backends import simnvml as nv

ENABLE, DISABLE = pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_DISABLE
SUCCESS, IN_USE = pynvml.NVML_SUCCESS, pynvml.NVML_ERROR_IN_USE
RESET_REQUIRED = pynvml.NVML_ERROR_RESET_REQUIRED


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    nv.reset()
    yield
    nv.reset()


def _gpus(*keys: str, **options: Any) -> list[Any]:
    nv.configure(list(keys), **options)
    nv.nvmlInit()
    return [nv.nvmlDeviceGetHandleByIndex(i) for i in range(len(keys))]


def _placement(start: int, size: int) -> Any:
    pl = pynvml.c_nvmlGpuInstancePlacement_t()
    pl.start, pl.size = start, size
    return pl


def _create_gi(h: Any) -> Any:
    return nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, ctypes.byref(_placement(0, 1)))  # 1g@0


# --- the cases -----------------------------------------------------------------------------------------


def hopper_switches_without_a_reset() -> None:
    # Hopper and later switch without a GPU reset (simmode docstring): done when the call returns.
    (h,) = _gpus("H100-80GB", mig_enabled=False)
    assert nv.nvmlDeviceSetMigMode(h, ENABLE) == SUCCESS
    assert nv.nvmlDeviceGetMigMode(h) == [ENABLE, ENABLE]
    assert nv.nvmlDeviceGetMaxMigDeviceCount(h) == 7
    _create_gi(h)  # GI creation is what MIG mode "determines"


def ampere_mode_is_pending_until_the_switch() -> None:
    # The requested mode is pending, not current, until the GPU has switched (switch_latency_s later).
    (h,) = _gpus("A100-80GB", mig_enabled=False, switch_latency_s=0.3)
    assert nv.nvmlDeviceSetMigMode(h, ENABLE) == SUCCESS
    assert nv.nvmlDeviceGetMigMode(h) == [DISABLE, ENABLE]
    with pytest.raises(pynvml.NVMLError_NotSupported):  # not in MIG mode yet: no GPU instance
        _create_gi(h)
    assert nv.nvmlDeviceSetMigMode(h, ENABLE) == SUCCESS  # asked again meanwhile: the same switch
    time.sleep(0.35)
    assert nv.nvmlDeviceGetMigMode(h) == [ENABLE, ENABLE]
    _create_gi(h)


def vm_without_reset_needs_a_reboot() -> None:
    (h,) = _gpus("A100-40GB", mig_enabled=False, vm=True, switch_latency_s=0.0)
    assert nv.nvmlDeviceSetMigMode(h, ENABLE) == RESET_REQUIRED
    time.sleep(0.05)
    assert nv.nvmlDeviceGetMigMode(h) == [DISABLE, ENABLE]  # current stays: no reset happened
    assert nv.nvmlDeviceSetMigMode(h, ENABLE) == RESET_REQUIRED  # asking again changes nothing
    nv.reset_gpu(0)  # the VM reboots
    assert nv.nvmlDeviceGetMigMode(h) == [ENABLE, ENABLE]
    assert nv.nvmlDeviceSetMigMode(h, DISABLE) == RESET_REQUIRED  # and back: another reboot
    assert nv.nvmlDeviceGetMigMode(h) == [ENABLE, DISABLE]
    assert [e.kind for e in nv.history()] == ["set-mig-mode", "set-mig-mode", "gpu-reset", "set-mig-mode"]


def busy_gpu_is_left_pending_until_idle_and_asked_again() -> None:
    (h,) = _gpus("H100-80GB", mig_enabled=False)
    uuid = nv.nvmlDeviceGetUUID(h)
    nv.attach_process(uuid, 4242)  # a CUDA process on the whole GPU
    assert nv.nvmlDeviceSetMigMode(h, ENABLE) == IN_USE  # the call itself succeeds: no exception
    assert nv.nvmlDeviceGetMigMode(h) == [DISABLE, ENABLE]
    nv.detach_process(uuid, 4242)
    assert nv.nvmlDeviceGetMigMode(h) == [DISABLE, ENABLE]  # idle alone does not activate it
    assert nv.nvmlDeviceSetMigMode(h, ENABLE) == SUCCESS  # "retry setting the mode"
    assert nv.nvmlDeviceGetMigMode(h) == [ENABLE, ENABLE]


def minor_number_may_change() -> None:
    h0, h1 = _gpus("H100-80GB", "H100-80GB", mig_enabled=False)
    assert nv.nvmlDeviceSetMigMode(h0, ENABLE) == SUCCESS
    assert nv.nvmlDeviceGetMinorNumber(h0) == 0  # off by default: the minor stays
    nv.set_minor_renumbering()
    assert nv.nvmlDeviceSetMigMode(h1, ENABLE) == SUCCESS
    assert nv.nvmlDeviceGetMinorNumber(h1) == 2  # a new minor, above every one in use
    assert nv.nvmlDeviceSetMigMode(h0, DISABLE) == SUCCESS
    assert nv.nvmlDeviceGetMinorNumber(h0) == 3
    assert nv.nvmlDeviceGetIndex(h0) == 0 and nv.nvmlDeviceGetUUID(h0).startswith("GPU-")  # same GPU


def minor_number_changes_when_the_switch_completes() -> None:
    (h,) = _gpus("A30-24GB", "A30-24GB", mig_enabled=False, switch_latency_s=0.3)[:1]
    nv.set_minor_renumbering()
    nv.nvmlDeviceSetMigMode(h, ENABLE)
    assert nv.nvmlDeviceGetMinorNumber(h) == 0  # not yet: the reset has not happened
    time.sleep(0.35)
    assert nv.nvmlDeviceGetMinorNumber(h) == 2


def invalid_mode_or_device() -> None:
    (h,) = _gpus("H100-80GB")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceSetMigMode(h, 2)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceSetMigMode(None, ENABLE)
    gi = _create_gi(h)
    nv.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # a MIG device is not a device to set
        nv.nvmlDeviceSetMigMode(nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 0), ENABLE)
    assert nv.nvmlDeviceGetMigMode(h) == [ENABLE, ENABLE]


def set_not_supported_without_mig() -> None:
    (h,) = _gpus("L4-24GB")
    for mode in (ENABLE, DISABLE):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            nv.nvmlDeviceSetMigMode(h, mode)


def get_not_supported_without_mig() -> None:
    (h,) = _gpus("L4-24GB")
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetMigMode(h)


def placements_not_supported_without_mig() -> None:
    (h,) = _gpus("L4-24GB")
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, 19, None, ctypes.byref(ctypes.c_uint(0)))


def whole_gpu_processes_have_no_instance_ids() -> None:
    (h,) = _gpus("L4-24GB")
    nv.attach_process(nv.nvmlDeviceGetUUID(h), 99, used_memory_mib=1024)
    (p,) = nv.nvmlDeviceGetComputeRunningProcesses(h)
    assert (p.pid, p.gpuInstanceId, p.computeInstanceId) == (99, 0xFFFFFFFF, 0xFFFFFFFF)
    assert nv.nvmlDeviceGetMemoryInfo(h).used == 1024 * 2**20


@dataclass(frozen=True)
class Case:
    c_function: str  # what pynvml calls in the library; "struct:name:member" for a structure member
    quote: str  # the documenting sentence, verbatim (whitespace aside)
    check: Callable[[], None]


SET, GET = "nvmlDeviceSetMigMode", "nvmlDeviceGetMigMode"
CASES = [
    Case(SET, "This API may unbind or reset the device to activate the requested mode.",
         hopper_switches_without_a_reset),
    Case(SET, "This mode determines whether a GPU instance can be created.", hopper_switches_without_a_reset),
    Case(GET, 'Changing MIG modes may require device unbind or reset. The "pending" MIG mode refers to the '
         "target mode following the next activation trigger.", ampere_mode_is_pending_until_the_switch),
    Case(GET, "pendingMode Returns the pending mode, NVML_DEVICE_MIG_DISABLE or NVML_DEVICE_MIG_ENABLE",
         ampere_mode_is_pending_until_the_switch),
    Case(SET, "On certain platforms like pass-through virtualization, where reset functionality may not be "
         "exposed directly, VM reboot is required. activationStatus would return NVML_ERROR_RESET_REQUIRED "
         "for such cases.", vm_without_reset_needs_a_reboot),
    Case(SET, "activationStatus would return the appropriate error code upon unsuccessful activation. For "
         "example, if device unbind fails because the device isn't idle, NVML_ERROR_IN_USE would be "
         "returned. The caller of this API is expected to idle the device and retry setting the mode.",
         busy_gpu_is_left_pending_until_idle_and_asked_again),
    Case(SET, "Thus, the attributes associated with the device, such as minor number, might change. The "
         "caller of this API is expected to query such attributes again.", minor_number_may_change),
    Case(SET, "such as minor number, might change", minor_number_changes_when_the_switch_completes),
    Case(SET, "NVML_ERROR_INVALID_ARGUMENT If device,mode or activationStatus are invalid",  # sic
         invalid_mode_or_device),
    Case(SET, "NVML_ERROR_NOT_SUPPORTED If device doesn't support MIG mode", set_not_supported_without_mig),
    Case(GET, "NVML_ERROR_NOT_SUPPORTED If device doesn't support MIG mode", get_not_supported_without_mig),
    Case("nvmlDeviceGetGpuInstancePossiblePlacements_v2",
         "NVML_ERROR_NOT_SUPPORTED If device doesn't support MIG or profileId isn't supported",
         placements_not_supported_without_mig),
    Case("struct:nvmlProcessInfo_v2_st:gpuInstanceId",
         "If MIG is enabled, stores a valid GPU instance ID. gpuInstanceId is set to 0xFFFFFFFF otherwise.",
         whole_gpu_processes_have_no_instance_ids),
]  # fmt: skip


def _documented(case: Case) -> str:
    if case.c_function.startswith("struct:"):
        _, struct, member = case.c_function.split(":")
        return member_doc(struct, member)
    return doc_block(case.c_function)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.c_function}:{c.check.__name__}")
def test_simulator_does_what_nvml_h_documents(case: Case) -> None:
    doc = _documented(case)
    assert squash(case.quote) in doc.replace("\\ref ", "").replace("\\a ", ""), (
        f"nvml.h does not say {case.quote!r} for {case.c_function}"
    )
    case.check()


def test_a_misquoted_behaviour_is_caught() -> None:
    """The quote check can fail: what nvml.h says of one function is not found in another's block."""
    assert "NVML_ERROR_RESET_REQUIRED" not in doc_block(GET)
    assert "VM reboot is required" in doc_block(SET)


# --- per generation, and the stated assumptions (not in nvml.h) --------------------------------------------


def test_default_switch_latency_by_generation() -> None:
    """NVIDIA MIG user guide, Deployment Considerations: "Setting MIG mode on the A100/A30 requires a GPU
    reset" (the driver performs it: the switch takes a while); from Hopper on the driver switches MIG mode
    without one (simmode docstring), at once."""
    h100, a100, a30 = _gpus("H100-80GB", "A100-80GB", "A30-24GB", mig_enabled=False)
    before = time.time()
    for h in (h100, a100, a30):
        assert nv.nvmlDeviceSetMigMode(h, ENABLE) == SUCCESS
    assert [nv.nvmlDeviceGetMigMode(h) for h in (h100, a100, a30)] == [[1, 1], [0, 1], [0, 1]]
    gpus = nv.snapshot()["gpus"]
    assert [g["switch_latency_s"] for g in gpus] == [0.0, 2.0, 2.0]
    assert all(before + 2.0 <= g["switch_at"] <= time.time() + 2.0 for g in gpus[1:])
    assert simmode.DEFAULT_SWITCH_LATENCY_S[pynvml.NVML_DEVICE_ARCH_AMPERE] == 2.0


def test_a_vm_matters_only_where_the_switch_needs_a_reset() -> None:
    """Hopper needs no reset to switch, so no VM reboot either (simmode docstring); an A100 in the same VM
    does."""
    h100, a100 = _gpus("H100-80GB", "A100-80GB", mig_enabled=False, vm=True)
    assert nv.nvmlDeviceSetMigMode(h100, ENABLE) == SUCCESS
    assert nv.nvmlDeviceSetMigMode(a100, ENABLE) == RESET_REQUIRED
    assert nv.nvmlDeviceGetMigMode(h100) == [1, 1] and nv.nvmlDeviceGetMigMode(a100) == [0, 1]


def test_disabling_with_gpu_instances_fails_and_changes_nothing() -> None:
    """Stated assumption (simmode docstring; nvml.h is silent): the call raises InUse, the mode stays."""
    (h,) = _gpus("H100-80GB")
    gi = _create_gi(h)
    with pytest.raises(pynvml.NVMLError_InUse):
        nv.nvmlDeviceSetMigMode(h, DISABLE)
    assert nv.nvmlDeviceGetMigMode(h) == [ENABLE, ENABLE]
    assert "set-mig-mode" not in [e.kind for e in nv.history()]
    nv.nvmlGpuInstanceDestroy(gi)
    assert nv.nvmlDeviceSetMigMode(h, DISABLE) == SUCCESS
    assert nv.nvmlDeviceGetMigMode(h) == [DISABLE, DISABLE]


def test_a_pending_switch_can_be_withdrawn() -> None:
    (h,) = _gpus("A100-80GB", mig_enabled=False, switch_latency_s=0.2)
    nv.nvmlDeviceSetMigMode(h, ENABLE)
    assert nv.nvmlDeviceGetMigMode(h) == [0, 1]
    assert nv.nvmlDeviceSetMigMode(h, DISABLE) == SUCCESS  # the current mode again: nothing to activate
    time.sleep(0.25)
    assert nv.nvmlDeviceGetMigMode(h) == [0, 0]


def test_reset_gpu_takes_processes_and_instances_with_it() -> None:
    """A GPU reset keeps no MIG device (mig-parted's systemd service re-applies them after every reboot) and
    no process; with nothing pending the mode stays."""
    (h,) = _gpus("A100-40GB")
    gi = _create_gi(h)
    nv.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
    nv.attach_process(nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)), 5)
    nv.reset_gpu(0)
    assert nv.nvmlDeviceGetMigMode(h) == [1, 1]
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19) == 7
    assert nv.nvmlDeviceGetComputeRunningProcesses(h) == []


def test_whole_gpu_processes_only_with_mig_off() -> None:
    (h,) = _gpus("H100-80GB", mig_enabled=False, switch_latency_s=0.0)
    uuid = nv.nvmlDeviceGetUUID(h)
    nv.nvmlDeviceSetMigMode(h, ENABLE)
    with pytest.raises(ValueError, match="MIG mode is on or switching"):
        nv.attach_process(uuid, 1)
    with pytest.raises(KeyError):
        nv.attach_process("GPU-00000000-0000-0000-0000-000000000000", 1)
    nv.reset()
    (h,) = _gpus("A30-24GB", mig_enabled=False, switch_latency_s=5.0)
    nv.nvmlDeviceSetMigMode(h, ENABLE)
    with pytest.raises(ValueError, match="switching"):  # not while the switch is under way either
        nv.attach_process(nv.nvmlDeviceGetUUID(h), 1)


def test_a_gpu_without_mig_answers_whole_gpu_queries() -> None:
    """An L4 (no MIG): name, UUID, memory, architecture and minor as for any GPU; MIG queries say it has none
    (nvml.h, nvmlDeviceGetMaxMigDeviceCount: "Returns zero if MIG is not supported or enabled.")."""
    l4, h100 = _gpus("L4-24GB", "H100-80GB")
    assert nv.nvmlDeviceGetName(l4) == "NVIDIA L4"
    uuid = nv.nvmlDeviceGetUUID(l4)
    assert uuid.startswith("GPU-") and uuid != nv.nvmlDeviceGetUUID(h100)
    assert nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByUUID(uuid)) == uuid
    assert nv.nvmlDeviceGetMemoryInfo(l4).total == 23034 * 2**20
    assert nv.nvmlDeviceGetArchitecture(l4) == pynvml.NVML_DEVICE_ARCH_ADA
    assert nv.nvmlDeviceGetCudaComputeCapability(l4) == (8, 9)
    assert nv.nvmlDeviceGetPciInfo(l4).pciDeviceId == (0x27B8 << 16) | 0x10DE
    assert (nv.nvmlDeviceGetMinorNumber(l4), nv.nvmlDeviceGetMinorNumber(h100)) == (0, 1)
    assert nv.nvmlDeviceGetMaxMigDeviceCount(l4) == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetGpuInstanceProfileInfo(l4, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE, version=1)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        _create_gi(l4)
    assert nv.nvmlDeviceGetMigMode(h100) == [1, 1]  # mig_enabled=True (the default) is moot for the L4


def test_per_gpu_options_are_checked() -> None:
    with pytest.raises(ValueError, match="vm: 1 values for 2 GPUs"):
        nv.configure(["H100-80GB", "A100-80GB"], vm=[True])
    with pytest.raises(ValueError, match="switch_latency_s"):
        nv.configure(["A100-80GB"], switch_latency_s=-1)
    with pytest.raises(KeyError, match="L5"):
        nv.configure(["L5-24GB"])


_CHILD = textwrap.dedent(
    """
    import sys, json
    from dynamig.backends import simnvml as nv
    nv.configure([], state_file=sys.argv[1])
    nv.nvmlInit()
    hs = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
    status = nv.nvmlDeviceSetMigMode(hs[int(sys.argv[2])], nv.NVML_DEVICE_MIG_ENABLE)
    print(json.dumps([status, [nv.nvmlDeviceGetMigMode(h) for h in hs]]))
    """
)


def test_mode_and_per_gpu_options_persist_in_the_state_file(tmp_path: Path) -> None:
    """Another process attaching to the state file sees the same GPUs: MIG off or on, in a VM or not, the
    switch latency, and a switch under way."""
    state = tmp_path / "nvml.json"
    _gpus(
        "A100-80GB", "A100-80GB", "H100-80GB", state_file=state,
        mig_enabled=[False, False, True], vm=[True, False, False], switch_latency_s=[0, 1.5, None],
    )  # fmt: skip
    doc = json.loads(state.read_text())["gpus"]
    assert [(g["mig_current"], g["vm"], g["switch_latency_s"]) for g in doc] == [
        (0, True, 0.0), (0, False, 1.5), (1, False, 0.0)
    ]  # fmt: skip

    def child(index: int) -> list[Any]:
        run = [sys.executable, "-c", _CHILD, str(state), str(index)]
        out = subprocess.run(run, capture_output=True, text=True, timeout=60, check=True)
        result: list[Any] = json.loads(out.stdout)
        return result

    assert child(0) == [RESET_REQUIRED, [[0, 1], [0, 0], [1, 1]]]  # the VM flag came with the file
    assert child(1) == [SUCCESS, [[0, 1], [0, 1], [1, 1]]]  # the switch under way, seen there ...
    assert nv.nvmlDeviceGetMigMode(nv.nvmlDeviceGetHandleByIndex(1)) == [0, 1]  # ... and here
    time.sleep(max(0.0, nv.snapshot()["gpus"][1]["switch_at"] - time.time()) + 0.05)
    assert nv.nvmlDeviceGetMigMode(nv.nvmlDeviceGetHandleByIndex(1)) == [1, 1]
    nv.reset_gpu(0)
    nv.reset()
    nv.configure([], state_file=state)  # attach afresh: what the file says now
    nv.nvmlInit()
    assert [nv.nvmlDeviceGetMigMode(nv.nvmlDeviceGetHandleByIndex(i)) for i in range(3)] == [[1, 1]] * 3
    assert [e.kind for e in nv.history()] == ["set-mig-mode", "set-mig-mode", "gpu-reset"]


def test_a_separate_copy_of_the_simulator_switches_its_own_gpus() -> None:
    """Several simulated nodes in one process (``fresh_simulated_nvml``): a MIG mode switch on one copy's GPU
    changes that copy alone."""
    from dynamig.backends.nvml import fresh_simulated_nvml

    one, two = fresh_simulated_nvml(), fresh_simulated_nvml()
    for copy in (one, two):
        copy.configure(["H100-80GB"], mig_enabled=False)
        copy.nvmlInit()
    try:
        assert one.nvmlDeviceSetMigMode(one.nvmlDeviceGetHandleByIndex(0), one.NVML_DEVICE_MIG_ENABLE) == 0
        assert list(one.nvmlDeviceGetMigMode(one.nvmlDeviceGetHandleByIndex(0))) == [1, 1]
        assert list(two.nvmlDeviceGetMigMode(two.nvmlDeviceGetHandleByIndex(0))) == [0, 0]
        two.reset_gpu(0)
        assert list(one.nvmlDeviceGetMigMode(one.nvmlDeviceGetHandleByIndex(0))) == [1, 1]
    finally:
        one.reset()
        two.reset()
