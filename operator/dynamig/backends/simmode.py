"""The simulated GPUs' MIG mode: ``nvmlDeviceSetMigMode`` and ``nvmlDeviceGetMigMode`` as nvml.h documents
them, per GPU generation, the simulation controls that drive them, and GPUs with no MIG at all.

Part of :mod:`dynamig.backends.simnvml`, which re-exports the NVML functions, the controls and the tables
here (it stays the drop-in for ``pynvml``); the state (current and pending mode, the switch under way) lives
in simnvml's GPU records and so in its JSON state file. ``tests/unit/test_simnvml_migmode.py`` checks each
behaviour below against the sentence it rests on. What it models (nvml.h is ``tests/data/nvml/nvml.h``):

- The return value is ``activationStatus``, as ``pynvml``'s wrapper returns ``c_activationStatus.value``
  (it raises only for the call's own return code).
- nvml.h: "This API may unbind or reset the device to activate the requested mode." The requested mode
  becomes *pending* ("The "pending" MIG mode refers to the target mode following the next activation
  trigger", ``nvmlDeviceGetMigMode``) and *current* once the GPU has switched, ``switch_latency_s`` later (a
  per-GPU setting; :data:`DEFAULT_SWITCH_LATENCY_S` by generation). Meanwhile ``nvmlDeviceGetMigMode``
  answers ``[current, pending]``.

  Which models switch through a GPU reset is one fact, kept in :mod:`dynamig.geometry.generation` (with its
  sources) and shared with the operator's policy:

  * Ampere (A100, A30) switches through a GPU reset the driver performs: "Setting MIG mode on the A100/A30
    requires a GPU reset" (NVIDIA MIG user guide, Deployment Considerations). Default 2 s: an order of
    magnitude for a reset and re-initialisation of the GPU, not a measurement; long enough to be seen.
  * Hopper and later switch without a reset, at once by default.
- nvml.h: "On certain platforms like pass-through virtualization, where reset functionality may not be
  exposed directly, VM reboot is required. activationStatus would return NVML_ERROR_RESET_REQUIRED for such
  cases." A GPU configured ``vm=True`` whose switch needs a reset (Ampere) keeps its current mode, the
  requested one pending, until :func:`reset_gpu` (the VM's reboot). On Hopper and later ``vm`` changes
  nothing: no reset is needed.
- nvml.h: "if device unbind fails because the device isn't idle, NVML_ERROR_IN_USE would be returned. The
  caller of this API is expected to idle the device and retry setting the mode." With processes on the GPU
  (or on one of its MIG devices, though those come with GPU instances, which stop a disable first) the call
  succeeds, the mode stays pending and ``activationStatus`` is ``NVML_ERROR_IN_USE``; a call made once the
  GPU is idle switches it. (nvidia-smi words the same outcome
  "MIG mode is in pending enable state for GPU ...: In use by another client".)
- nvml.h: "Thus, the attributes associated with the device, such as minor number, might change." With
  :func:`set_minor_renumbering` on, a switch gives the GPU a new minor number (off by default).
- nvml.h: "NVML_ERROR_INVALID_ARGUMENT If device,mode or activationStatus are invalid" (sic) and
  "NVML_ERROR_NOT_SUPPORTED If device doesn't support MIG mode": a GPU with no MIG model
  (:data:`NON_MIG_PRODUCTS`, e.g. ``L4-24GB``) answers the whole-GPU queries and NotSupported to MIG mode.

Assumptions, stated (nvml.h says nothing of them): disabling MIG while GPU instances exist fails with
``InUse`` from the call itself and changes nothing (NVIDIA's mig-parted clears a GPU's MIG configuration
before it changes the mode, ``cmd/nvidia-mig-parted/apply/mode.go``); the real call performs the reset before
it returns, here it returns at once and the pending window is what another process (the agent) sees
meanwhile; a switch to disabled, and :func:`reset_gpu`, leave no GPU or compute instances, and a reset no
processes (MIG devices do not outlive a reset: mig-parted's systemd service re-applies them after each
reboot, ``deployments/systemd/README.md``).
"""

from __future__ import annotations

import time
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pynvml import (
    NVML_DEVICE_ARCH_ADA,
    NVML_DEVICE_ARCH_AMPERE,
    NVML_DEVICE_ARCH_BLACKWELL,
    NVML_DEVICE_ARCH_HOPPER,
    NVML_DEVICE_MIG_DISABLE,
    NVML_DEVICE_MIG_ENABLE,
    NVML_ERROR_IN_USE,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_RESET_REQUIRED,
    NVML_SUCCESS,
    NVMLError,
)

from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.generation import RESET_SWITCHED, Generation, generation
from dynamig.geometry.model import GpuModel

if TYPE_CHECKING:
    from dynamig.backends.simstate import Gpu as _Gpu

# Seconds a MIG mode switch takes, by NVML architecture (see the module docstring).
DEFAULT_SWITCH_LATENCY_S: dict[int, float] = {
    NVML_DEVICE_ARCH_AMPERE: 2.0,
    NVML_DEVICE_ARCH_HOPPER: 0.0,
    NVML_DEVICE_ARCH_BLACKWELL: 0.0,
}

# GPUs without MIG, as catalog-like models with no profile: product name, PCI device id, memory (what
# nvidia-smi reports for an L4: "NVIDIA L4", 10de:27b8, 23034 MiB). Catalog keys and these are disjoint.
NON_MIG_PRODUCTS: dict[str, GpuModel] = {
    "L4-24GB": GpuModel(
        key="L4-24GB",
        product_names=("NVIDIA L4",),
        pci_device_ids=(0x27B8,),
        memory_slices=0,
        compute_slices=0,
        memory_mib=23034,
        profiles=(),
    ),
}


# Every function here that reads or changes the simulated machine takes the simulator module ``nv`` that
# calls it: simnvml wraps each one with itself, so a separate copy of simnvml
# (``dynamig.backends.nvml.fresh_simulated_nvml``, several simulated nodes in one process) switches its own
# GPUs, never the first copy's.


def _error(code: int) -> Exception:
    err: Exception = NVMLError(code)  # pynvml maps the code to its NVMLError_* subclass
    return err


# --- the GPUs: models, generation, configuration ----------------------------------------------------------


@dataclass(kw_only=True)
class MigModeState:
    """A simulated GPU's MIG mode, kept in simnvml's GPU records (and so in its state file)."""

    mig_current: int
    mig_pending: int
    vm: bool = False  # GPU reset not exposed (pass-through VM): a switch that needs one waits for reset_gpu
    switch_latency_s: float = 0.0  # how long a switch takes
    switch_at: float = 0.0  # wall-clock time the switch under way completes (0: none)
    minor: int | None = None  # the minor number (None: the GPU's index)
    minor_after_switch: int | None = None  # the minor number once the switch under way completes


def gpu_model(key: str) -> GpuModel:
    """The model of a simulated GPU: a catalog key or a :data:`NON_MIG_PRODUCTS` key (KeyError naming the
    catalog's keys if neither). Reads the catalog."""
    model = NON_MIG_PRODUCTS.get(key)
    return model if model is not None else load_catalog().model(key)


def mig_capable(model: GpuModel) -> bool:
    return bool(model.profiles)


def switch_needs_reset(model: GpuModel) -> bool:
    """Whether a MIG mode switch of this model goes through a GPU reset (Ampere), so ``vm`` matters. Pure."""
    return mig_capable(model) and generation(model.key) in RESET_SWITCHED


def architecture(model: GpuModel) -> tuple[int, tuple[int, int]]:
    """(NVML architecture, CUDA compute capability) of a simulated GPU's model (generation by catalog key,
    :func:`dynamig.geometry.generation.generation`; an unknown one is taken as Blackwell). Pure."""
    gen = generation(model.key)
    if gen is Generation.AMPERE:
        return NVML_DEVICE_ARCH_AMPERE, (8, 0)
    if gen is Generation.HOPPER:
        return NVML_DEVICE_ARCH_HOPPER, (9, 0)
    if gen is Generation.ADA:
        return NVML_DEVICE_ARCH_ADA, (8, 9)
    if model.key.startswith("RTXPRO"):
        return NVML_DEVICE_ARCH_BLACKWELL, (12, 0)
    return NVML_DEVICE_ARCH_BLACKWELL, (10, 0)


def _per_gpu(name: str, value: Any, count: int) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name}: {len(value)} values for {count} GPUs")
        return list(value)
    return [value] * count


def gpu_fields(keys: Sequence[str], mig_enabled: Any, vm: Any, switch_latency_s: Any) -> list[dict[str, Any]]:
    """The MIG-mode fields of each new GPU record from simnvml ``configure``'s per-GPU options (each one value
    for every GPU or a sequence with one per GPU; a latency of None: the generation's default). A GPU with no
    MIG starts (and stays) with MIG disabled. ValueError / KeyError naming what is wrong. Reads the catalog.
    """
    out = []
    for key, enabled, in_vm, latency in zip(
        keys,
        _per_gpu("mig_enabled", mig_enabled, len(keys)),
        _per_gpu("vm", vm, len(keys)),
        _per_gpu("switch_latency_s", switch_latency_s, len(keys)),
        strict=True,
    ):
        model = gpu_model(key)
        arch = architecture(model)[0]
        seconds = DEFAULT_SWITCH_LATENCY_S.get(arch, 0.0) if latency is None else float(latency)
        if not seconds >= 0:
            raise ValueError(f"switch_latency_s: {latency!r} is not a number of seconds of at least 0")
        mode = NVML_DEVICE_MIG_ENABLE if enabled and mig_capable(model) else NVML_DEVICE_MIG_DISABLE
        out.append({"mig_current": mode, "mig_pending": mode, "vm": bool(in_vm), "switch_latency_s": seconds})
    return out


# --- the state machine -----------------------------------------------------------------------------------


def require_mig(gpu: _Gpu) -> None:
    """NotSupported unless MIG is (currently) enabled on ``gpu``."""
    if gpu.mig_current != NVML_DEVICE_MIG_ENABLE:
        raise _error(NVML_ERROR_NOT_SUPPORTED)


def _busy(gpu: _Gpu) -> bool:
    return bool(gpu.processes) or any(ci.processes for gi in gpu.gpu_instances for ci in gi.compute_instances)


def _next_minor(gpus: Sequence[_Gpu]) -> int:
    taken = [g.index if g.minor is None else g.minor for g in gpus]
    taken += [g.minor_after_switch for g in gpus if g.minor_after_switch is not None]
    return max(taken) + 1


def _activate(gpu: _Gpu) -> None:
    """The pending mode becomes current (the switch, or the reset, has taken place)."""
    gpu.mig_current, gpu.switch_at = gpu.mig_pending, 0.0
    if gpu.minor_after_switch is not None:
        gpu.minor, gpu.minor_after_switch = gpu.minor_after_switch, None
    if gpu.mig_current == NVML_DEVICE_MIG_DISABLE:
        gpu.gpu_instances = []  # none can be left once MIG is off (a reset does not keep them)


def settle(gpus: Sequence[_Gpu], now: float | None = None) -> None:
    """Complete every switch whose time has come. Every process that reads the state computes the same, so
    the simulator applies it on each read; it is saved with the next change. Side effect: ``gpus``."""
    now = time.time() if now is None else now
    for gpu in gpus:
        if gpu.switch_at and gpu.switch_at <= now:
            _activate(gpu)


def get_mig_mode(nv: types.ModuleType, device: Any) -> list[int]:
    """``nvmlDeviceGetMigMode`` of simulator ``nv``: ``[current, pending]``."""
    from dynamig.backends import simstate  # here, not at the top: simstate imports this module

    r = nv._read(device, simstate.KIND_GPU, simstate.KIND_MIG)
    if r.gi is not None or not mig_capable(r.model):
        raise _error(NVML_ERROR_NOT_SUPPORTED)
    return [r.gpu.mig_current, r.gpu.mig_pending]


def set_mig_mode(nv: types.ModuleType, device: Any, mode: int) -> int:
    """``nvmlDeviceSetMigMode`` of simulator ``nv``. Returns ``activationStatus``: ``NVML_SUCCESS``,
    ``NVML_ERROR_IN_USE`` or ``NVML_ERROR_RESET_REQUIRED``; raises for the call's own errors. See the module
    docstring."""
    from dynamig.backends import simstate  # here, not at the top: simstate imports this module

    sim = nv._initialized()
    if mode not in (NVML_DEVICE_MIG_DISABLE, NVML_DEVICE_MIG_ENABLE):
        raise _error(NVML_ERROR_INVALID_ARGUMENT)
    with sim.mutate() as state:
        r = simstate.resolve(state, device, simstate.KIND_GPU)
        gpu = r.gpu
        if not mig_capable(r.model):
            raise _error(NVML_ERROR_NOT_SUPPORTED)
        if mode == NVML_DEVICE_MIG_DISABLE and gpu.gpu_instances:
            raise _error(NVML_ERROR_IN_USE)  # stated assumption: the call itself fails, nothing changes
        if gpu.mig_pending == mode and (gpu.mig_current == mode or gpu.switch_at):
            return int(NVML_SUCCESS)  # nothing to do, or this very switch is under way
        gpu.mig_pending, gpu.switch_at, gpu.minor_after_switch = mode, 0.0, None
        sim.record(state, "set-mig-mode", gpu, value=mode)
        if gpu.mig_current == mode:
            return int(NVML_SUCCESS)  # a pending switch withdrawn: nothing to activate
        if _busy(gpu):
            return int(NVML_ERROR_IN_USE)  # left pending: idle the GPU and call again
        if gpu.vm and switch_needs_reset(r.model):
            return int(NVML_ERROR_RESET_REQUIRED)  # left pending until reset_gpu (the VM's reboot)
        if sim.renumber_minor:
            gpu.minor_after_switch = _next_minor(state.gpus)
        if gpu.switch_latency_s > 0:
            gpu.switch_at = time.time() + gpu.switch_latency_s
        else:
            _activate(gpu)
    return int(NVML_SUCCESS)


# --- simulation controls (not in pynvml) -----------------------------------------------------------------


def reset_gpu(nv: types.ModuleType, index: int) -> None:
    """Reset GPU ``index`` of simulator ``nv``, as a pass-through VM's reboot does: its pending MIG mode
    becomes current, and its processes and GPU and compute instances are gone. Side effect: state."""
    sim = nv._sim()
    with sim.mutate() as state:
        gpu = state.gpus[index]
        if sim.renumber_minor and gpu.mig_pending != gpu.mig_current:
            gpu.minor_after_switch = _next_minor(state.gpus)
        gpu.processes, gpu.gpu_instances = [], []
        _activate(gpu)
        sim.record(state, "gpu-reset", gpu, value=gpu.mig_current)


def set_minor_renumbering(nv: types.ModuleType, enabled: bool = True) -> None:
    """MIG mode switches requested from now on give the GPU a new minor number (the lowest above every minor
    in use) when they take effect, as nvml.h allows ("the attributes associated with the device, such as minor
    number, might change"). This process's setting; off by default. Side effect: module state."""
    nv._sim().renumber_minor = bool(enabled)
