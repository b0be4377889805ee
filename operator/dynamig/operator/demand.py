"""Pending demand: which ResourceClaims wait for a MIG device, and which profiles would satisfy them. Pure.

A claim is *pending demand* when

1. it has no ``status.allocation``,
2. a pod that uses it is unschedulable (``PodScheduled=False``, reason ``Unschedulable``; or reason
   ``SchedulerError``, where the scheduler failed on the claim itself, which is reported and never planned
   for: see :attr:`PendingClaim.scheduler_error`), and
3. one of its requests targets a DeviceClass whose selectors select driver ``mig.dynamig.io``.

For each request, and each ``firstAvailable`` alternative in order, the profiles it accepts are found by
evaluating the alternative's CEL selectors *and* its DeviceClass's selectors (``dynamig.kube.cel``) against
the device each catalog profile would be published as (``MigDevice``). Within one alternative the smallest
profiles come first, so the planner cuts no more than asked for.

Selectors on per-GPU attributes (``gpuIndex``, ``parentUUID``, ``placementStart``) are evaluated on a
representative device (GPU 0, the profile's first placement): the planner cannot pin a claim to one GPU.

A claim with several MIG requests becomes one planner demand per request (named ``ns/claim/request``); the
planner then keeps each request's devices on one node, not all requests together.

A pod that asks for an extended resource a DeviceClass serves (``nvidia.com/mig-1g.10gb: 1``, the device
plugin's name, mapped by the class's ``extendedResourceName``; DRAExtendedResource) has no claim until the
scheduler allocates one, so while it is unschedulable its request is demand of its own: one
:class:`PendingClaim` whose :class:`ClaimRef` is the pod (``kind`` ``Pod``), with one request per resource.

Whole GPUs. A GPU with MIG mode off is published whole (``gpu<index>``, profile ``whole``,
:class:`WholeGpuDevice`) under the same driver, so each alternative's selectors are also evaluated against a
representative whole GPU of each model (:attr:`ProfileMatch.whole`). A request that no alternative can serve
with a MIG profile but some alternative can serve with a whole GPU (``profile == "whole"``, the class
``gpu.dynamig.io``, a pod asking ``nvidia.com/gpu`` served by that class) is *whole-GPU demand*: it is kept
in :attr:`PendingClaim.whole`, out of :attr:`PendingClaim.requests`, so the MIG planner never cuts for it, and
the claim is still reported (it waits for a GPU with MIG mode off). A request whose alternatives accept both
keeps the MIG profiles of its MIG alternatives, in ``firstAvailable`` order, and is MIG demand.

A whole GPU's NVLink facts (``nvlinkActiveLinks``, ``fabricClusterUuid``, ``fabricCliqueId``) are the GPU's
own, not its model's: the representative whole GPU of a model is evaluated with each distinct set of facts
its GPUs report (``nvlink``, model key -> facts; the agent reports them whatever the MIG mode), so a claim
selecting on them accepts the model when some GPU of it can serve; which GPU can is
:meth:`PendingClaim.accepts_whole_gpu`'s answer, for that GPU's own facts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from dynamig.geometry.model import GpuModel, Profile
from dynamig.kube.cel import DeviceView, device_view, device_view_from_api, evaluate_selector
from dynamig.kube.devices import MIB, MigDevice, NvlinkFacts, WholeGpuDevice, whole_device_class
from dynamig.kube.names import ATTRIBUTE_DOMAIN, WHOLE_CLASS_NAME
from dynamig.planner.model import ClaimDemand

DRIVER = ATTRIBUTE_DOMAIN
NvlinkByModel = Mapping[str, Sequence[NvlinkFacts]]  # model key -> the distinct facts its GPUs report
_NO_FACTS = (NvlinkFacts(),)  # a model none of whose GPUs reported any: its whole GPU as the catalog has it


# ------------------------------------------------------------------------------------------ parsed inputs


@dataclass(frozen=True, slots=True)
class DeviceClass:
    name: str
    selectors: tuple[str, ...]
    extended_resource_name: str = ""  # spec.extendedResourceName
    created: str = ""  # creationTimestamp (RFC 3339: compares as text)
    labels: Mapping[str, str] = field(default_factory=dict)


def parse_device_classes(objs: Iterable[Mapping[str, Any]]) -> dict[str, DeviceClass]:
    """DeviceClass name -> its CEL selectors and extended resource name (resource.k8s.io/v1). Pure."""
    out: dict[str, DeviceClass] = {}
    for obj in objs:
        meta = obj["metadata"]
        spec = obj.get("spec") or {}
        exprs = tuple(s["cel"]["expression"] for s in spec.get("selectors") or [] if "cel" in s)
        out[meta["name"]] = DeviceClass(
            meta["name"],
            exprs,
            str(spec.get("extendedResourceName") or ""),
            str(meta.get("creationTimestamp") or ""),
            dict(meta.get("labels") or {}),
        )
    return out


IMPLICIT_RESOURCE_PREFIX = "deviceclass.resource.kubernetes.io/"


def resource_classes(classes: Mapping[str, DeviceClass]) -> dict[str, str]:
    """Extended resource name -> the DeviceClass kube-scheduler serves it from: each class's
    ``extendedResourceName`` (where several name one, the newest class, then the first by name) and its
    implicit ``deviceclass.resource.kubernetes.io/<class>`` (k8s.io/dynamic-resource-allocation v0.37.2,
    deviceclass/extendedresourcecache, updateResourceName2class). Pure."""
    out: dict[str, str] = {}
    chosen: dict[str, DeviceClass] = {}
    for c in sorted(classes.values(), key=lambda c: c.name):  # a tie keeps the first by name
        out[IMPLICIT_RESOURCE_PREFIX + c.name] = c.name
        if not c.extended_resource_name:
            continue
        have = chosen.get(c.extended_resource_name)
        if have is None or c.created > have.created:
            chosen[c.extended_resource_name] = c
    out.update({name: c.name for name, c in chosen.items()})
    return out


@dataclass(frozen=True, slots=True)
class SubRequest:
    """One way to satisfy a request: an ``exactly`` request, or one ``firstAvailable`` alternative."""

    name: str  # "gpu" or "gpu/small"
    device_class: str
    selectors: tuple[str, ...]
    count: int
    all_devices: bool  # allocationMode All


@dataclass(frozen=True, slots=True)
class Request:
    name: str
    alternatives: tuple[SubRequest, ...]


def _sub_request(name: str, body: Mapping[str, Any]) -> SubRequest:
    exprs = tuple(s["cel"]["expression"] for s in body.get("selectors") or [] if "cel" in s)
    mode = body.get("allocationMode") or "ExactCount"
    return SubRequest(
        name=name,
        device_class=str(body.get("deviceClassName", "")),
        selectors=exprs,
        count=int(body.get("count") or 1),
        all_devices=mode == "All",
    )


def parse_requests(claim: Mapping[str, Any]) -> tuple[Request, ...]:
    """The claim's device requests (``exactly`` or ``firstAvailable``; the pre-v1 flat form too). Pure."""
    out: list[Request] = []
    for req in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []:
        name = str(req["name"])
        if req.get("firstAvailable"):
            subs = tuple(_sub_request(f"{name}/{s['name']}", s) for s in req["firstAvailable"])
        elif req.get("exactly"):
            subs = (_sub_request(name, req["exactly"]),)
        else:
            subs = (_sub_request(name, req),)
        out.append(Request(name, subs))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class PodRef:
    namespace: str
    name: str
    uid: str
    unschedulable: bool
    node_selector: Mapping[str, str]
    required_terms: tuple[Mapping[str, Any], ...]  # nodeSelectorTerms of required node affinity (ORed)
    scheduling_message: str = ""
    # PodScheduled=False/SchedulerError: the scheduler failed on the pod (a CEL runtime error in a claim's
    # selector, a request over the API's limits), not for want of a device.
    scheduler_error: bool = False


def parse_pod(pod: Mapping[str, Any]) -> PodRef:
    """The scheduling facts of a pod that matter here. Pure."""
    meta = pod["metadata"]
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    unschedulable = scheduler_error = False
    message = ""
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            unschedulable = cond.get("reason") == "Unschedulable"
            scheduler_error = cond.get("reason") == "SchedulerError"
            message = str(cond.get("message") or "")
    return PodRef(
        namespace=str(meta.get("namespace", "")),
        name=str(meta["name"]),
        uid=str(meta.get("uid", "")),
        unschedulable=unschedulable and not spec.get("nodeName"),
        node_selector=dict(spec.get("nodeSelector") or {}),
        required_terms=required_terms(spec),
        scheduling_message=message,
        scheduler_error=scheduler_error and not spec.get("nodeName"),
    )


def quantity(value: Any) -> int:
    """An extended resource's quantity (whole numbers only: the API refuses fractions of them)."""
    try:
        return int(str(value))
    except ValueError:
        return 0


def spec_requests(spec: Mapping[str, Any], wanted: Callable[[str], bool]) -> dict[str, int]:
    """A pod spec's requests for the extended resources ``wanted`` accepts: its containers' requests summed,
    or an init container's when larger (init containers run one at a time, before the others), as the
    scheduler counts a pod's requests. Pure."""

    def requests(container: Mapping[str, Any]) -> dict[str, int]:
        res = container.get("resources") or {}
        asked = {**(res.get("limits") or {}), **(res.get("requests") or {})}  # requests default to limits
        return {name: quantity(q) for name, q in asked.items() if wanted(name)}

    total: dict[str, int] = {}
    for c in spec.get("containers") or []:
        for name, n in requests(c).items():
            total[name] = total.get(name, 0) + n
    for c in spec.get("initContainers") or []:
        for name, n in requests(c).items():
            total[name] = max(total.get(name, 0), n)
    return {name: n for name, n in total.items() if n > 0}


def pod_extended_requests(pod: Mapping[str, Any], served: Mapping[str, str]) -> dict[str, int]:
    """The pod's requests for the extended resources in ``served`` (resource -> DeviceClass), as
    :func:`spec_requests` counts them. Pure."""
    return spec_requests(pod.get("spec") or {}, served.__contains__)


def pod_claim_names(pod: Mapping[str, Any]) -> tuple[str, ...]:
    """Names of the ResourceClaims a pod uses (direct, and generated from templates via its status). Pure."""
    names: list[str] = []
    generated = {
        s.get("name"): s.get("resourceClaimName")
        for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
    }
    for ref in (pod.get("spec") or {}).get("resourceClaims") or []:
        if ref.get("resourceClaimName"):
            names.append(str(ref["resourceClaimName"]))
        elif generated.get(ref.get("name")):
            names.append(str(generated[ref.get("name")]))
    return tuple(names)


# ------------------------------------------------------------------------------------------ node constraints


def _expr_matches(expr: Mapping[str, Any], labels: Mapping[str, str], node_name: str, field: bool) -> bool:
    key = str(expr.get("key", ""))
    op = expr.get("operator")
    values = [str(v) for v in expr.get("values") or []]
    if field:
        value: str | None = node_name if key == "metadata.name" else None
    else:
        value = labels.get(key)
    if op == "In":
        return value is not None and value in values
    if op == "NotIn":
        return value is None or value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt") and value is not None and values:
        try:
            lhs, rhs = int(value), int(values[0])
        except ValueError:
            return False
        return lhs > rhs if op == "Gt" else lhs < rhs
    return False


def pod_fits_node(pod: PodRef, node_name: str, labels: Mapping[str, str]) -> bool:
    """The pod's nodeSelector and required node affinity against one node. Pure."""
    return fits_node(pod.node_selector, pod.required_terms, node_name, labels)


def required_terms(spec: Mapping[str, Any]) -> tuple[Mapping[str, Any], ...]:
    """The ``nodeSelectorTerms`` of a pod spec's required node affinity (empty: none). Pure."""
    affinity = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    return tuple(affinity.get("nodeSelectorTerms") or ())


def fits_node(
    node_selector: Mapping[str, str],
    terms: Sequence[Mapping[str, Any]],
    node_name: str,
    labels: Mapping[str, str],
) -> bool:
    """A nodeSelector and the terms of a required node affinity (any term, all of its expressions) against
    one node, as kube-scheduler's NodeAffinity filter reads them. Pure."""
    if any(labels.get(k) != v for k, v in node_selector.items()):
        return False
    if not terms:
        return True
    for term in terms:
        exprs = term.get("matchExpressions") or []
        fields = term.get("matchFields") or []
        if not exprs and not fields:
            continue  # an empty term matches nothing
        if all(_expr_matches(e, labels, node_name, False) for e in exprs) and all(
            _expr_matches(f, labels, node_name, True) for f in fields
        ):
            return True
    return False


# ------------------------------------------------------------------------------------------ profile matching


@dataclass(frozen=True, slots=True)
class ProfileMatch:
    """Which profiles one sub-request accepts on each model, the models whose whole GPU (MIG mode off) it
    accepts, and selector errors met on the MIG devices on the way."""

    sub_request: SubRequest
    accepts: Mapping[str, tuple[str, ...]]  # model key -> profiles, smallest first
    errors: tuple[str, ...] = ()
    whole: tuple[str, ...] = ()  # model keys whose whole GPU (with some GPU's NVLink facts) passes
    selectors: tuple[str, ...] = ()  # the DeviceClass's and the request's, as evaluated

    @property
    def any(self) -> bool:
        return any(self.accepts.values())

    def whole_accepts(self, model: GpuModel, product_name: str, nvlink: NvlinkFacts) -> bool:
        """Whether the whole GPU of one GPU (its model, product name and NVLink facts) passes. Pure."""
        return model.key in self.whole and _whole_passes(self.selectors, model, product_name or None, nvlink)


def _candidate_device(model: GpuModel, profile: Profile, product_name: str | None) -> DeviceView:
    device = MigDevice(
        gpu_index=0,
        profile=profile,
        placement_start=profile.placement_starts[0],
        product_name=product_name or model.product_name,
        parent_uuid="",
    )
    return device_view(device, DRIVER)


def _candidate_whole(
    model: GpuModel, product_name: str | None, nvlink: NvlinkFacts = _NO_FACTS[0]
) -> DeviceView:
    """The whole GPU of ``model`` as the agent publishes it with MIG mode off (GPU 0, the catalog's memory,
    ``nvlink``: a GPU's NVLink facts), as the scheduler sees it. Pure."""
    device = WholeGpuDevice(
        gpu_index=0,
        product_name=product_name or model.product_name,
        uuid="",
        memory_bytes=model.memory_mib * MIB,
    )
    return device_view_from_api(DRIVER, device.with_nvlink(nvlink).to_api())


@lru_cache(maxsize=4096)
def _whole_passes(
    selectors: tuple[str, ...], model: GpuModel, product_name: str | None, nvlink: NvlinkFacts
) -> bool:
    return _passes(selectors, _candidate_whole(model, product_name, nvlink))


def _some_whole_passes(
    selectors: tuple[str, ...], model: GpuModel, product_name: str | None, nvlink: tuple[NvlinkFacts, ...]
) -> bool:
    """Whether the whole GPU of ``model`` passes with one of the NVLink facts its GPUs report. Pure."""
    return any(_whole_passes(selectors, model, product_name, facts) for facts in nvlink or _NO_FACTS)


def _facts_key(nvlink: NvlinkByModel | None) -> tuple[tuple[str, tuple[NvlinkFacts, ...]], ...]:
    """``nvlink`` in a hashable form, for the caches below."""
    return tuple(sorted((key, tuple(facts)) for key, facts in (nvlink or {}).items()))


def _size_key(p: Profile) -> tuple[int, int, int, str]:
    return (p.placement_size, p.compute_slices, p.memory_mib, p.name)


def match_sub_request(
    sub: SubRequest,
    device_classes: Mapping[str, DeviceClass],
    models: Sequence[GpuModel],
    product_names: Mapping[str, str] | None = None,
    nvlink: NvlinkByModel | None = None,
) -> ProfileMatch:
    """Profiles of each model whose device passes the DeviceClass's and the request's selectors, and the
    models whose whole GPU does with one of the NVLink facts ``nvlink`` lists for it. Pure."""
    dclass = device_classes.get(sub.device_class)
    if dclass is None:
        return ProfileMatch(sub, {}, (f"DeviceClass {sub.device_class!r} does not exist",))
    products = tuple(sorted((product_names or {}).items()))
    selectors = dclass.selectors + sub.selectors
    accepts, errors, whole = _accepting_profiles(selectors, tuple(models), products, _facts_key(nvlink))
    return ProfileMatch(sub, dict(accepts), errors, whole, selectors)


def _passes(selectors: tuple[str, ...], view: DeviceView) -> bool:
    return all(evaluate_selector(e, view).matched for e in selectors)


@lru_cache(maxsize=4096)
def _accepting_profiles(
    selectors: tuple[str, ...],
    models: tuple[GpuModel, ...],
    products: tuple[tuple[str, str], ...],
    nvlink: tuple[tuple[str, tuple[NvlinkFacts, ...]], ...] = (),
) -> tuple[tuple[tuple[str, tuple[str, ...]], ...], tuple[str, ...], tuple[str, ...]]:
    """(model key -> accepted profiles, errors, models whose whole GPU is accepted) for a list of
    selectors. Errors are those met on MIG devices (a selector written for MIG attributes fails on a whole
    GPU, which lacks them, and says nothing about MIG). Pure; cached because claims made from one template
    share their selectors and celpy evaluation is not cheap."""
    product_of, facts_of = dict(products), dict(nvlink)
    accepts: list[tuple[str, tuple[str, ...]]] = []
    errors: list[str] = []
    whole: list[str] = []
    for model in models:
        if _some_whole_passes(selectors, model, product_of.get(model.key), facts_of.get(model.key, ())):
            whole.append(model.key)
        ok: list[str] = []
        for profile in sorted(model.profiles, key=_size_key):
            view = _candidate_device(model, profile, product_of.get(model.key))
            matched = True
            for expr in selectors:
                result = evaluate_selector(expr, view)
                if result.error and result.error not in errors:
                    errors.append(result.error)
                if not result.matched:
                    matched = False
                    break
            if matched:
                ok.append(profile.name)
        accepts.append((model.key, tuple(ok)))
    return tuple(accepts), tuple(errors), tuple(whole)


def class_targets_driver(
    dclass: DeviceClass | None, models: Sequence[GpuModel], nvlink: NvlinkByModel | None = None
) -> bool:
    """Whether a DeviceClass's selectors select devices of driver ``mig.dynamig.io`` at all: a MIG device or
    a whole GPU of some model (with one of the NVLink facts ``nvlink`` lists for it). Pure."""
    if dclass is None:
        return False
    return _targets_driver(dclass.selectors, tuple(models), _facts_key(nvlink))


@lru_cache(maxsize=256)
def _targets_driver(
    selectors: tuple[str, ...],
    models: tuple[GpuModel, ...],
    nvlink: tuple[tuple[str, tuple[NvlinkFacts, ...]], ...] = (),
) -> bool:
    facts_of = dict(nvlink)
    for model in models:
        if _some_whole_passes(selectors, model, None, facts_of.get(model.key, ())):
            return True
        for profile in model.profiles:
            if _passes(selectors, _candidate_device(model, profile, None)):
                return True
    return False


# ------------------------------------------------------------------------------------------ claims


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A pending claim, or a pod whose extended resources stand for the claim it does not have yet."""

    namespace: str
    name: str
    uid: str
    kind: str = "ResourceClaim"  # or "Pod"

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}" if self.kind != "Pod" else f"{self.namespace}/pod/{self.name}"

    @property
    def is_pod(self) -> bool:
        return self.kind == "Pod"


@dataclass(frozen=True, slots=True)
class RequestDemand:
    """One MIG request of a pending claim, with what each alternative accepts."""

    demand_name: str  # the name the planner sees
    request: str
    matches: tuple[ProfileMatch, ...]

    def alternatives(
        self, allowed: frozenset[str] | None = None, models: frozenset[str] | None = None
    ) -> tuple[str, ...]:
        """Profile names in preference order (deduplicated) over ``models`` (catalog keys; None: all),
        keeping only ``allowed`` ones when given. Pure."""
        return tuple(self._counts(allowed, models))

    def alternative_counts(
        self, allowed: frozenset[str] | None = None, models: frozenset[str] | None = None
    ) -> tuple[int, ...]:
        """The device count of each of :meth:`alternatives` (the first ``firstAvailable`` entry that
        accepts the profile decides it). Pure."""
        return tuple(self._counts(allowed, models).values())

    def _counts(self, allowed: frozenset[str] | None, models: frozenset[str] | None) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.matches:
            for model, profiles in m.accepts.items():
                if models is not None and model not in models:
                    continue
                for p in profiles:
                    if p not in out and (allowed is None or p in allowed):
                        out[p] = m.sub_request.count
        return out

    def count_for(self, profile: str) -> int:
        """Devices the request needs when served with ``profile`` (its first alternative's count when no
        alternative accepts it). Pure."""
        return self._counts(None, None).get(profile, self.count)

    @property
    def count(self) -> int:
        """The count of the first (preferred) alternative."""
        return self.matches[0].sub_request.count if self.matches else 1

    @property
    def min_count(self) -> int:
        """The fewest devices any alternative is satisfied with."""
        return min((m.sub_request.count for m in self.matches), default=1)

    @property
    def errors(self) -> tuple[str, ...]:
        return tuple(e for m in self.matches for e in m.errors)

    def whole_models(self, models: frozenset[str] | None = None) -> tuple[str, ...]:
        """Models (of ``models``; None: all) whose whole GPU some alternative accepts, in the order the
        alternatives name them. Pure."""
        out: list[str] = []
        for m in self.matches:
            out.extend(k for k in m.whole if k not in out and (models is None or k in models))
        return tuple(out)

    def whole_accepts(self, model: GpuModel, product_name: str, nvlink: NvlinkFacts) -> bool:
        """Whether an alternative accepts one GPU's whole device (its model, product, NVLink facts). Pure."""
        return any(m.whole_accepts(model, product_name, nvlink) for m in self.matches)

    def whole_count(self, model: str | None = None) -> int:
        """Whole GPUs the request needs when served whole (on ``model``; None: any): the count of the first
        alternative that accepts the whole GPU; 0 when none does. Pure."""
        for m in self.matches:
            if m.whole and (model is None or model in m.whole):
                return m.sub_request.count
        return 0

    @property
    def whole_only(self) -> bool:
        """Only a whole GPU serves it: some alternative accepts the whole GPU, none a MIG profile."""
        return bool(self.whole_models()) and not any(m.any for m in self.matches)


@dataclass(frozen=True, slots=True)
class PendingClaim:
    claim: ClaimRef
    pods: tuple[PodRef, ...]
    requests: tuple[RequestDemand, ...]
    nodes: frozenset[str] | None  # nodes every pod of the claim may run on; None: no constraint
    created: str = ""  # claim creationTimestamp
    # Requests only a whole GPU (MIG mode off) serves: never planned for MIG (see the module's docstring).
    whole: tuple[RequestDemand, ...] = ()

    @property
    def whole_gpus(self) -> int:
        """Whole GPUs the claim waits for (its whole-GPU requests' counts); 0 when it is MIG demand only."""
        return sum(r.whole_count() for r in self.whole)

    def whole_by_model(self, models: frozenset[str] | None = None) -> dict[str, int]:
        """Model -> whole GPUs of that model the claim waits for, for the models (of ``models``; None: all)
        whose whole GPU serves every whole-GPU request. Empty when it has none. Pure."""
        if not self.whole:
            return {}
        keys = [
            k for k in self.whole[0].whole_models(models) if all(k in r.whole_models() for r in self.whole)
        ]
        return {k: sum(r.whole_count(k) for r in self.whole) for k in keys}

    def accepts_whole_gpu(self, model: GpuModel, product_name: str, nvlink: NvlinkFacts) -> bool:
        """Whether one GPU's whole device (its model, product name and NVLink facts) serves every whole-GPU
        request of the claim: what a GPU must pass to be switched off, or counted, for it. Pure."""
        return bool(self.whole) and all(r.whole_accepts(model, product_name, nvlink) for r in self.whole)

    @property
    def scheduler_error(self) -> str:
        """The scheduler's error message when it fails on the claim's pods (and none is merely
        unschedulable): no layout helps until the claim is fixed. Empty otherwise."""
        if any(p.unschedulable for p in self.pods):
            return ""
        return next((p.scheduling_message or "SchedulerError" for p in self.pods if p.scheduler_error), "")

    def planner_demands(
        self, allowed: frozenset[str] | None = None, models: frozenset[str] | None = None
    ) -> tuple[ClaimDemand, ...]:
        """The planner's view: one ClaimDemand per MIG request that accepts some allowed profile of
        ``models``. Pure."""
        out: list[ClaimDemand] = []
        for r in self.requests:
            alts = r.alternatives(allowed, models)
            if alts:
                counts = r.alternative_counts(allowed, models)
                out.append(
                    ClaimDemand(
                        name=r.demand_name,
                        alternatives=alts,
                        count=counts[0],
                        nodes=self.nodes,
                        alt_counts=counts if len(set(counts)) > 1 else (),
                    )
                )
        return tuple(out)


@dataclass(frozen=True, slots=True)
class DemandSnapshot:
    pending: tuple[PendingClaim, ...]
    allocated: frozenset[str] = field(default_factory=frozenset)  # claim UIDs with an allocation


def claim_is_allocated(claim: Mapping[str, Any]) -> bool:
    return bool((claim.get("status") or {}).get("allocation"))


def _split_whole(
    requests: Sequence[RequestDemand],
) -> tuple[tuple[RequestDemand, ...], tuple[RequestDemand, ...]]:
    """(MIG requests, whole-GPU requests): a request only a whole GPU serves is kept out of the MIG ones;
    one that matches nothing stays with them (and is reported as such). Pure."""
    return tuple(r for r in requests if not r.whole_only), tuple(r for r in requests if r.whole_only)


_WHOLE_CLASS = parse_device_classes([whole_device_class()])[WHOLE_CLASS_NAME]


def with_whole_class(device_classes: Mapping[str, DeviceClass]) -> Mapping[str, DeviceClass]:
    """``device_classes``, with the class ``gpu.dynamig.io`` as the operator would make it when it does not
    exist: the operator makes it only while some governed GPU has MIG mode off, and a claim naming it before
    then is whole-GPU demand all the same (it waits for a GPU with MIG mode off). Pure."""
    if WHOLE_CLASS_NAME in device_classes:
        return device_classes
    return {**device_classes, WHOLE_CLASS_NAME: _WHOLE_CLASS}


def extract_demand(
    claims: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    device_classes: Mapping[str, DeviceClass],
    models: Sequence[GpuModel],
    nodes: Mapping[str, Mapping[str, str]],
    product_names: Mapping[str, str] | None = None,
    nvlink: NvlinkByModel | None = None,
) -> DemandSnapshot:
    """Pending MIG claims from raw API dicts. ``models``: the GPU models to match against; ``nodes``: the
    candidate nodes (name -> labels) used to resolve pod node constraints; ``nvlink``: the NVLink facts the
    GPUs of each model report (module docstring). Pure."""
    users: dict[tuple[str, str], list[PodRef]] = {}
    pods = tuple(pods)
    for pod in pods:
        ref = parse_pod(pod)
        for cname in pod_claim_names(pod):
            users.setdefault((ref.namespace, cname), []).append(ref)
    targets: dict[str, bool] = {}
    pending: list[PendingClaim] = []
    allocated: set[str] = set()
    claim_classes = with_whole_class(device_classes)
    for claim in claims:
        meta = claim["metadata"]
        cref = ClaimRef(str(meta.get("namespace", "")), str(meta["name"]), str(meta.get("uid", "")))
        if claim_is_allocated(claim):
            allocated.add(cref.uid)
            continue
        claim_pods = tuple(users.get((cref.namespace, cref.name), ()))
        if not any(p.unschedulable or p.scheduler_error for p in claim_pods):
            continue
        req_demands: list[RequestDemand] = []
        requests = parse_requests(claim)
        for req in requests:
            subs = req.alternatives
            if not any(
                targets.setdefault(
                    s.device_class, class_targets_driver(claim_classes.get(s.device_class), models, nvlink)
                )
                for s in subs
            ):
                continue
            matches = tuple(match_sub_request(s, claim_classes, models, product_names, nvlink) for s in subs)
            name = cref.key if len(requests) == 1 else f"{cref.key}/{req.name}"
            req_demands.append(RequestDemand(demand_name=name, request=req.name, matches=matches))
        if not req_demands:
            continue
        mig, whole = _split_whole(req_demands)
        allowed_nodes = frozenset(
            n for n, labels in nodes.items() if all(pod_fits_node(p, n, labels) for p in claim_pods)
        )
        constrained = any(p.node_selector or p.required_terms for p in claim_pods)
        pending.append(
            PendingClaim(
                claim=cref,
                pods=claim_pods,
                requests=mig,
                nodes=allowed_nodes if constrained else None,
                created=str(meta.get("creationTimestamp", "")),
                whole=whole,
            )
        )
    pending += extended_resource_demand(pods, device_classes, models, nodes, product_names, targets, nvlink)
    pending.sort(key=lambda p: (p.created, p.claim.key))
    return DemandSnapshot(tuple(pending), frozenset(allocated))


def extended_resource_demand(
    pods: Iterable[Mapping[str, Any]],
    device_classes: Mapping[str, DeviceClass],
    models: Sequence[GpuModel],
    nodes: Mapping[str, Mapping[str, str]],
    product_names: Mapping[str, str] | None = None,
    targets: dict[str, bool] | None = None,
    nvlink: NvlinkByModel | None = None,
) -> list[PendingClaim]:
    """Unschedulable pods asking for extended resources that DeviceClasses of this driver serve, each as a
    :class:`PendingClaim` of kind ``Pod`` (one request per resource, named after it). A pod the scheduler
    already made its claim for (``status.extendedResourceClaimStatus``) is left to that claim. Pure."""
    served = resource_classes(device_classes)
    targets = {} if targets is None else targets
    out: list[PendingClaim] = []
    for pod in pods:
        ref = parse_pod(pod)
        if not (ref.unschedulable or ref.scheduler_error):
            continue
        if ((pod.get("status") or {}).get("extendedResourceClaimStatus") or {}).get("resourceClaimName"):
            continue
        asked = pod_extended_requests(pod, served)
        req_demands: list[RequestDemand] = []
        key = ClaimRef(ref.namespace, ref.name, ref.uid, kind="Pod").key
        for resource, count in sorted(asked.items()):
            dclass = served[resource]
            targeted = class_targets_driver(device_classes.get(dclass), models, nvlink)
            if not targets.setdefault(dclass, targeted):
                continue
            sub = SubRequest(resource, dclass, (), count, False)
            match = match_sub_request(sub, device_classes, models, product_names, nvlink)
            name = key if len(asked) == 1 else f"{key}/{resource}"
            req_demands.append(RequestDemand(demand_name=name, request=resource, matches=(match,)))
        if not req_demands:
            continue
        mig, whole = _split_whole(req_demands)
        constrained = bool(ref.node_selector or ref.required_terms)
        out.append(
            PendingClaim(
                claim=ClaimRef(ref.namespace, ref.name, ref.uid, kind="Pod"),
                pods=(ref,),
                requests=mig,
                whole=whole,
                nodes=frozenset(n for n, labels in nodes.items() if pod_fits_node(ref, n, labels))
                if constrained
                else None,
                created=str((pod.get("metadata") or {}).get("creationTimestamp", "")),
            )
        )
    return out
