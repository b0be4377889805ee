"""``dynamig doctor``: check a GPU node's MIG profiles against the geometry catalog, through NVML.

Read-only by default: for every GPU NVML reports, the profile table NVML gives (ids, instance caps, memory,
SMs, engines, placements) is compared with the catalog model of that GPU; each difference is printed, or
"matches". With ``--mutate`` it also creates and destroys one instance of every profile, at the profile's
first placement, on each MIG-enabled GPU that has no GPU instance at all, and checks the MIG device each one
becomes: a MIG UUID of its own (``MIG-...``, not the parent's), its memory, its SMs; each step is timed.
A GPU that has any GPU instance is refused (its instances may be someone's workload), and MIG mode is never
changed. The exit status is 1 when any check fails, 2 when the doctor cannot run.

Examples::

    dynamig doctor                                            # this node, real NVML, read-only
    dynamig doctor --mutate -o json                           # drained node: create/destroy every profile
    dynamig doctor --nvml simulated --simulate-gpus A100-80GB:1,H100-80GB:2 --mutate
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

from dynamig.agent.nvml.catalog import (
    ProfileDifference,
    count_gpu_instances,
    diff_profiles,
    read_nvml_profiles,
    show,
)
from dynamig.agent.nvml.device import GpuInfo, MigInstance, NvmlDevices
from dynamig.cli import add_output_argument, plain, render
from dynamig.cli.args import simulated_gpus
from dynamig.cli.errors import EXIT_USAGE, CommandError
from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.model import PlacedInstance, Profile
from dynamig.textable import align

# A MIG device's framebuffer is the memory slices of its GPU instance, which NVML reports for the profile as
# memorySizeMB; the same driver answers both, so they agree up to what the driver keeps back per instance.
# 1% is far below the nearest wrong answer: the parent GPU's memory, or another profile's, is at least twice
# (or half) a profile's memory, so a handle mix-up cannot pass.
MEMORY_TOLERANCE = 0.01
MIB = 1024 * 1024


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this node's MIG profiles against the catalog through NVML (read-only unless --mutate)",
        description=plain(__doc__.split("\n\n")[1] if __doc__ else None),
    )
    p.add_argument(
        "--nvml",
        choices=("real", "simulated"),
        default="real",
        help="NVML library: the real one (pynvml), or the simulated one (no GPU needed)",
    )
    p.add_argument(
        "--simulate-gpus",
        type=simulated_gpus,
        default=None,
        help="with --nvml simulated: GPUs as catalog-key:count, comma separated (default H100-80GB:1, "
        "or the GPUs of an existing --state file)",
    )
    p.add_argument(
        "--state",
        type=Path,
        default=None,
        help="with --nvml simulated: the simulated GPUs' state file (e.g. the one a simulated agent uses)",
    )
    p.add_argument(
        "--mutate",
        action="store_true",
        help="also create and destroy one instance of every profile on each idle MIG-enabled GPU",
    )
    add_output_argument(p)
    p.set_defaults(func=run)


# --- results -------------------------------------------------------------------------------------------


@dataclass
class GpuCheck:
    """The read-only comparison of one GPU: its differences, or why it was not compared."""

    index: int
    uuid: str
    product: str
    model: str | None
    differences: list[ProfileDifference]
    note: str = ""  # "matches", or why nothing was compared
    failed: bool = False  # a problem that is not a profile difference (e.g. no catalog model)

    @property
    def ok(self) -> bool:
        return not self.differences and not self.failed


@dataclass
class InstanceCheck:
    """One profile created and destroyed on one GPU (``profile`` None when the GPU was refused)."""

    gpu: int
    parent_uuid: str
    product: str
    profile: str | None
    start: int | None = None
    mig_uuid: str | None = None
    memory_bytes: int | None = None
    expected_memory_mib: int | None = None
    multiprocessors: int | None = None
    create_s: float | None = None
    destroy_s: float | None = None
    errors: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.errors

    def record(self) -> dict[str, Any]:
        return {
            "check": "create-destroy",
            "gpu": self.gpu,
            "product": self.product,
            "parent_uuid": self.parent_uuid,
            "profile": self.profile,
            "start": self.start,
            "mig_uuid": self.mig_uuid,
            "memory_bytes": self.memory_bytes,
            "expected_memory_mib": self.expected_memory_mib,
            "multiprocessors": self.multiprocessors,
            "create_s": None if self.create_s is None else round(self.create_s, 6),
            "destroy_s": None if self.destroy_s is None else round(self.destroy_s, 6),
            "ok": self.ok,
            "error": "; ".join(self.errors) or None,
        }


def _json_value(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def gpu_records(check: GpuCheck) -> list[dict[str, Any]]:
    """JSON records of a read-only check: one per difference, or one for the GPU when there is none."""
    base = {"check": "catalog", "gpu": check.index, "uuid": check.uuid, "product": check.product}
    base["model"] = check.model
    if not check.differences:
        return [{**base, "ok": check.ok, "result": check.note}]
    return [
        {
            **base,
            "ok": False,
            "kind": d.kind,
            "profile": d.profile,
            "nvml_enum": d.nvml_enum,
            "field": d.field,
            "catalog": _json_value(d.catalog),
            "nvml": _json_value(d.nvml),
            "result": d.describe(),
        }
        for d in check.differences
    ]


# --- checks --------------------------------------------------------------------------------------------


def check_catalog(nvml: ModuleType, devices: NvmlDevices, gpu: GpuInfo) -> GpuCheck:
    """Compare one GPU's NVML profile table with its catalog model. Reads NVML only."""
    base = devices.catalog.for_product(gpu.product, gpu.pci_device_id)
    check = GpuCheck(gpu.index, gpu.uuid, gpu.product, base.key if base else None, [])
    handle = nvml.nvmlDeviceGetHandleByIndex(gpu.index)
    reported = read_nvml_profiles(nvml, handle, version=2 if gpu.mig_enabled else 1)
    if base is None:
        if reported:
            check.failed = True
            check.note = (
                f"not in the catalog (PCI device 0x{gpu.pci_device_id:04x}), "
                f"yet NVML offers {len(reported)} MIG profiles"
            )
        else:
            check.note = "no MIG profiles (not a MIG GPU); not compared"
        return check
    if not reported and not gpu.mig_enabled:
        check.note = "MIG disabled and NVML lists no profiles without it; not compared"
        return check
    check.differences = diff_profiles(base, reported)
    check.note = "matches" if not check.differences else f"{len(check.differences)} differences"
    return check


def _idle_refusal(nvml: ModuleType, gpu: GpuInfo) -> str | None:
    """Why ``gpu`` may not be mutated, or None. Reads NVML only."""
    if gpu.model is None:
        return "refused: the GPU is not in the catalog"
    if not gpu.mig_enabled:
        return "refused: MIG mode is disabled (the doctor never changes MIG mode)"
    if gpu.mig_pending != gpu.mig_current:
        return "refused: a MIG mode change is pending"
    handle = nvml.nvmlDeviceGetHandleByIndex(gpu.index)
    existing = count_gpu_instances(nvml, handle, read_nvml_profiles(nvml, handle))
    if existing:
        return (
            f"refused: the GPU has {existing} GPU instance(s); the doctor only creates and destroys "
            "instances on a GPU that has none (drain it first)"
        )
    return None


def check_create_destroy(devices: NvmlDevices, gpu: GpuInfo) -> list[InstanceCheck]:
    """Create and destroy every profile of ``gpu`` once, at its first placement. Side effect: NVML changes,
    undone before returning (a profile whose create fails is cleaned up as far as NVML allows)."""
    nvml = devices.nvml
    refusal = _idle_refusal(nvml, gpu)
    if refusal is not None or gpu.model is None:
        reason = refusal or "refused: the GPU is not in the catalog"
        return [InstanceCheck(gpu.index, gpu.uuid, gpu.product, None, errors=(reason,))]
    out: list[InstanceCheck] = []
    seen: dict[str, str] = {}
    for profile in gpu.model.profiles:
        placed = PlacedInstance(profile.placement_starts[0], profile.name)
        check = InstanceCheck(
            gpu.index, gpu.uuid, gpu.product, profile.name, start=placed.start,
            expected_memory_mib=profile.memory_mib,
        )  # fmt: skip
        errors: list[str] = []
        made: MigInstance | None
        t0 = time.perf_counter()
        try:
            made = devices.create(gpu, placed)
        except (nvml.NVMLError, ValueError) as exc:
            check.create_s = time.perf_counter() - t0
            errors.append(f"create failed: {type(exc).__name__.removeprefix('NVMLError_')}: {exc}")
            made = None
        else:
            check.create_s = time.perf_counter() - t0
            check.mig_uuid, check.memory_bytes = made.mig_uuid, made.memory_bytes
            check.multiprocessors = made.multiprocessors
            errors.extend(_instance_problems(gpu, profile, placed, made, seen))
        t1 = time.perf_counter()
        try:
            gone = devices.destroy(gpu, placed)
            if made is not None and not gone:
                errors.append("destroy found no instance at the placement just created")
        except (nvml.NVMLError, ValueError) as exc:
            errors.append(f"destroy failed: {type(exc).__name__.removeprefix('NVMLError_')}: {exc}")
        if made is not None:
            check.destroy_s = time.perf_counter() - t1
        left = devices.instances(gpu)
        if left:
            errors.append(f"{len(left)} instance(s) left on the GPU after destroy")
        check.errors = tuple(errors)
        out.append(check)
        if left:
            break  # the GPU is no longer idle: stop rather than create on top of what remains
    return out


def _instance_problems(
    gpu: GpuInfo, profile: Profile, placed: PlacedInstance, made: MigInstance, seen: dict[str, str]
) -> list[str]:
    """What is wrong with the MIG device ``made`` (empty when nothing is). Pure."""
    problems: list[str] = []
    uuid = made.mig_uuid or ""
    if not uuid.startswith("MIG-"):
        problems.append(f"MIG UUID {uuid!r} does not start with 'MIG-'")
    if uuid == gpu.uuid:
        problems.append("MIG UUID is the parent GPU's UUID (a parent handle was used, not the MIG device's)")
    if uuid and uuid in seen:
        problems.append(f"MIG UUID {uuid} was already reported for {seen[uuid]}")
    seen.setdefault(uuid, profile.name)
    if made.ci_id is None:
        problems.append("no compute instance on the new GPU instance")
    if (made.start, made.size) != (placed.start, profile.placement_size):
        problems.append(
            f"placed at {made.start}:{made.size}, asked for {placed.start}:{profile.placement_size}"
        )
    if made.memory_bytes is None:
        problems.append("NVML reported no memory for the MIG device")
    else:
        got = made.memory_bytes / MIB
        if abs(got - profile.memory_mib) > MEMORY_TOLERANCE * profile.memory_mib:
            problems.append(
                f"memory {got:.0f} MiB, profile {profile.memory_mib} MiB (more than "
                f"{MEMORY_TOLERANCE:.0%} apart)"
            )
    if made.multiprocessors is not None and made.multiprocessors != profile.multiprocessors:
        problems.append(f"{made.multiprocessors} SMs, profile {profile.multiprocessors}")
    return problems


# --- output --------------------------------------------------------------------------------------------


def _table(rows: Sequence[Sequence[str]], out: TextIO) -> None:
    out.writelines(f"{line}\n" for line in align(rows))


def _print_catalog_table(checks: Sequence[GpuCheck], out: TextIO) -> None:
    rows = [["GPU", "PRODUCT", "PROFILE", "FIELD", "CATALOG", "NVML"]]
    for c in checks:
        if not c.differences:
            rows.append([str(c.index), c.product, "-", "-", c.model or "-", c.note])
            continue
        for d in c.differences:
            if d.kind == "mismatch":
                field, mine, theirs = d.field or "", show(d.catalog), show(d.nvml)
            elif d.kind == "missing":
                field, mine, theirs = "profile", "offered", "not offered"
            elif d.kind == "extra":
                field, mine, theirs = "profile", "absent", "offered"
            else:
                field, mine, theirs = d.field or "", "-", f"unreadable: {show(d.nvml)}"
            rows.append([str(c.index), c.product, d.profile, field, mine, theirs])
    _table(rows, out)


def _print_instance_table(checks: Sequence[InstanceCheck], out: TextIO) -> None:
    rows = [["GPU", "PROFILE", "START", "MIG UUID", "MEMORY MiB", "CREATE s", "DESTROY s", "RESULT"]]
    for c in checks:
        rows.append([
            str(c.gpu), c.profile or "-", "-" if c.start is None else str(c.start), c.mig_uuid or "-",
            "-" if c.memory_bytes is None else str(c.memory_bytes // MIB),
            "-" if c.create_s is None else f"{c.create_s:.3f}",
            "-" if c.destroy_s is None else f"{c.destroy_s:.3f}",
            "ok" if c.ok else "FAILED: " + "; ".join(c.errors),
        ])  # fmt: skip
    _table(rows, out)


# --- command -------------------------------------------------------------------------------------------


def load_nvml_for(args: argparse.Namespace) -> ModuleType:
    """The NVML module the flags ask for; the simulated one configured in memory (or on ``--state``)."""
    from dynamig.backends.nvml import load_nvml

    module = load_nvml(args.nvml)
    if args.nvml == "simulated":
        from dynamig.agent.main import parse_simulated_gpus

        spec = args.simulate_gpus
        if spec is None:
            spec = "" if args.state is not None and args.state.exists() else "H100-80GB:1"
        gpus = parse_simulated_gpus(spec)
        if not gpus and args.state is None:
            raise ValueError("--simulate-gpus names no GPU")
        module.configure(gpus=list(gpus), state_file=args.state)
    return module


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the checks and print them. Side effects: NVML (changes only with ``--mutate``), output."""
    out = out or sys.stdout
    if args.nvml == "real" and (args.simulate_gpus is not None or args.state is not None):
        raise CommandError("--simulate-gpus and --state need --nvml simulated", EXIT_USAGE)
    try:
        nvml = load_nvml_for(args)
    except (ValueError, KeyError, ImportError) as exc:
        raise CommandError(f"--nvml {args.nvml}: {exc.args[0] if exc.args else exc}", EXIT_USAGE) from None
    devices = NvmlDevices(nvml, load_catalog())
    try:
        devices.init()
    except nvml.NVMLError as exc:
        print(f"error: NVML is not available: {exc}", file=sys.stderr)
        return 2
    try:
        gpus, lost = devices.discover()
        checks = [_guarded_catalog_check(nvml, devices, gpu) for gpu in gpus]
        made: list[InstanceCheck] = []
        if args.mutate:
            for gpu in gpus:
                made.extend(_guarded_create_destroy(devices, gpu))
    finally:
        devices.shutdown()
    ok = bool(gpus) and not lost and all(c.ok for c in checks) and all(m.ok for m in made)
    if args.output != "table":
        records = [r for c in checks for r in gpu_records(c)]
        records += [
            {"check": "discover", "gpu": index, "ok": False, "error": error} for index, error in lost.items()
        ]
        records += [m.record() for m in made]
        out.write(render(records, args.output) + "\n")
    else:
        if checks:
            _print_catalog_table(checks, out)
        for index, error in sorted(lost.items()):
            out.write(f"GPU {index}: NVML cannot read it: {error}\n")
        if args.mutate and made:
            out.write("\n")
            _print_instance_table(made, out)
        if gpus or lost:
            out.write("\nall checks passed\n" if ok else "\nsome checks FAILED\n")
    if not gpus and not lost:
        print("error: NVML reports no GPU", file=sys.stderr)
    return 0 if ok else 1


def _guarded_catalog_check(nvml: ModuleType, devices: NvmlDevices, gpu: GpuInfo) -> GpuCheck:
    """:func:`check_catalog`, with an NVML error reported as the GPU's failure instead of raised."""
    try:
        return check_catalog(nvml, devices, gpu)
    except nvml.NVMLError as exc:
        model = devices.catalog.for_product(gpu.product, gpu.pci_device_id)
        note = f"NVML error: {type(exc).__name__.removeprefix('NVMLError_')}: {exc}"
        return GpuCheck(gpu.index, gpu.uuid, gpu.product, model.key if model else None, [], note, True)


def _guarded_create_destroy(devices: NvmlDevices, gpu: GpuInfo) -> list[InstanceCheck]:
    """:func:`check_create_destroy`, with an NVML error outside a create/destroy step reported, not raised."""
    try:
        return check_create_destroy(devices, gpu)
    except devices.nvml.NVMLError as exc:
        error = f"NVML error: {type(exc).__name__.removeprefix('NVMLError_')}: {exc}"
        return [InstanceCheck(gpu.index, gpu.uuid, gpu.product, None, errors=(error,))]
