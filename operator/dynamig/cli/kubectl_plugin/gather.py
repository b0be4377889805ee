"""``kubectl dynamig must-gather``: what a bug report needs, in one ``.tar.gz``.

Every item is fetched on its own; one that fails (no RBAC, a pod without a running container, a proxy that
cannot reach the pod) is listed in ``summary.txt`` with the API's answer, and the rest is still written.
Objects are stored as YAML lists without ``managedFields``. The one Secret read is Helm's record of the
deployed dynamig release (found by the ``app.kubernetes.io/instance`` label of dynamig's pods); only its
user-supplied values and the chart's name and version are written, never its manifest, its chart files or
any other Secret. The workloads' pods are written reduced to what support reads (no container env, command
or volumes): their claims, node, phase, conditions and container states.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import io
import json
import tarfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamig import API_GROUP, DRIVER_NAME, __version__
from dynamig.cli.kubectl_plugin.report import verify_report, verify_table
from dynamig.kube.names import GPU_PARTITION_PLURAL, GROUP, NODE_LABEL, POLICY_PLURAL, VERSION

RESOURCE = ("resource.k8s.io", "v1")
ADMISSION = ("admissionregistration.k8s.io", "v1")
PART_OF = "app.kubernetes.io/part-of=dynamig"  # the chart's label on its admission policies and bindings
RELEASE_LABEL = "app.kubernetes.io/instance"  # the chart's pods: the Helm release that made them
TIMEOUT_S = 20  # per request: one unreachable pod must not hold up the archive


def default_archive_name(now: float) -> Path:
    return Path(f"dynamig-must-gather-{_stamp(now)}.tar.gz")


def _stamp(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).strftime("%Y%m%dT%H%M%SZ")


def _why(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        try:
            message = json.loads(exc.body or "{}").get("message", "")
        except (TypeError, ValueError, AttributeError):
            message = str(exc.body or "")
        return f"{exc.status} {exc.reason}: {' '.join(str(message).split())}".rstrip(": ")
    return f"{type(exc).__name__}: {exc}"


def _tidy(obj: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(obj)
    meta = dict(out.get("metadata") or {})
    meta.pop("managedFields", None)
    out["metadata"] = meta
    return out


def dynamig_labelled(node: Mapping[str, Any]) -> bool:
    """Whether a Node carries any ``dynamig.io/`` label (managed, product, …). Pure."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    return any(k.startswith(f"{API_GROUP}/") for k in labels)


def dynamig_claim(claim: Mapping[str, Any]) -> bool:
    """Whether a ResourceClaim is dynamig's: allocated a device of the driver, or asking a DeviceClass of
    dynamig (``mig.dynamig.io``, the profile classes ``*.dynamig.io``) in any request or alternative. Pure."""
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get(
        "results"
    ) or []
    if any(r.get("driver") == DRIVER_NAME for r in results):
        return True
    for request in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []:
        for ask in [request.get("exactly") or {}, *(request.get("firstAvailable") or [])]:
            if str(ask.get("deviceClassName", "")).endswith(f".{API_GROUP}"):
                return True
    return False


def workload_pods(pods: list[dict[str, Any]], claims: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pods using ``claims`` (named in a claim's ``reservedFor``, or naming the claim in their status or
    spec), reduced to what says why a workload waits or runs: no env, command or volumes. Pure."""
    by_ns = {(c["metadata"]["namespace"], c["metadata"]["name"]) for c in claims}
    reserved = {
        (c["metadata"]["namespace"], r.get("name"))
        for c in claims
        for r in (c.get("status") or {}).get("reservedFor") or []
        if r.get("resource") == "pods"
    }
    out = []
    for pod in pods:
        meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        ns = meta.get("namespace")
        named = {s.get("resourceClaimName") for s in status.get("resourceClaimStatuses") or []}
        named |= {c.get("resourceClaimName") for c in spec.get("resourceClaims") or []}
        if (ns, meta.get("name")) not in reserved and not any((ns, n) in by_ns for n in named if n):
            continue
        out.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    k: meta[k]
                    for k in (
                        "name",
                        "namespace",
                        "uid",
                        "creationTimestamp",
                        "deletionTimestamp",
                        "ownerReferences",
                    )
                    if k in meta
                },
                "spec": {
                    "nodeName": spec.get("nodeName"),
                    "schedulerName": spec.get("schedulerName"),
                    "resourceClaims": spec.get("resourceClaims"),
                    "containers": [
                        {
                            "name": c.get("name"),
                            "resources": {"claims": (c.get("resources") or {}).get("claims")},
                        }
                        for c in spec.get("containers") or []
                    ],
                },
                "status": {
                    k: status[k]
                    for k in (
                        "phase",
                        "reason",
                        "message",
                        "conditions",
                        "resourceClaimStatuses",
                        "containerStatuses",
                    )
                    if k in status
                },
            }
        )
    return out


def release_values(secret: Mapping[str, Any]) -> dict[str, Any]:
    """Helm's release Secret (``helm.sh/release.v1``: ``data.release`` is base64 of base64 of gzip of the
    release's JSON) reduced to the release's name, revision, status, chart and user-supplied values, as
    ``helm get values`` shows them; the manifest, the chart's files and hooks are dropped. Pure."""
    raw = base64.b64decode(base64.b64decode((secret.get("data") or {})["release"]))
    release = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    chart = (release.get("chart") or {}).get("metadata") or {}
    return {
        "release": release.get("name"),
        "namespace": release.get("namespace"),
        "revision": release.get("version"),
        "status": (release.get("info") or {}).get("status"),
        "chart": f"{chart.get('name')}-{chart.get('version')}",
        "appVersion": chart.get("appVersion"),
        "values": release.get("config") or {},
    }


@dataclass
class _Archive:
    """Files gathered so far (archive path -> bytes) and a line per item for the summary."""

    files: dict[str, bytes] = field(default_factory=dict)
    gathered: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def objects(self, name: str, items: list[dict[str, Any]]) -> None:
        doc = {"apiVersion": "v1", "kind": "List", "items": [_tidy(i) for i in items]}
        self.files[name] = yaml.safe_dump(doc, sort_keys=False).encode()
        self.gathered.append(f"{name}: {len(items)} object(s)")

    def text(self, name: str, data: str, what: str) -> None:
        self.files[name] = data.encode()
        self.gathered.append(f"{name}: {what}")

    def failed(self, what: str, exc: BaseException) -> None:
        self.missing.append(f"{what}: {_why(exc)}")


_FAILURES = (ApiException, aiohttp.ClientError, TimeoutError, OSError, ValueError)


async def read_body(response: Awaitable[Any]) -> bytes:
    """The body of a response asked for with ``_preload_content=False``; kubernetes-asyncio raises for an
    error status only when it preloads, so the status is checked here."""
    resp = await response
    data: bytes = await resp.read()
    if not 200 <= resp.status <= 299:
        exc = ApiException(status=resp.status, reason=resp.reason)
        exc.body = data
        raise exc
    return data


async def _read_json(call: Callable[[], Awaitable[Any]]) -> Any:
    return json.loads(await read_body(call()))


async def gather(
    api: client.ApiClient, path: Path, namespace: str | None, pod_selector: str, log_lines: int
) -> str:
    """Fetch everything, write the archive at ``path``; returns a one-line account."""
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    archive = _Archive()
    raw = {"_preload_content": False, "_request_timeout": TIMEOUT_S}

    def cluster_list(group: str, version: str, plural: str, **kw: Any) -> Callable[[], Awaitable[Any]]:
        return lambda: custom.list_cluster_custom_object(group, version, plural, **raw, **kw)

    claims = (
        cluster_list(*RESOURCE, "resourceclaims")
        if namespace is None
        else lambda: custom.list_namespaced_custom_object(*RESOURCE, namespace, "resourceclaims", **raw)
    )
    events = (
        (lambda: core.list_event_for_all_namespaces(**raw))
        if namespace is None
        else (lambda: core.list_namespaced_event(namespace, **raw))
    )
    pods_of_workloads = (
        (lambda: core.list_pod_for_all_namespaces(**raw))
        if namespace is None
        else (lambda: core.list_namespaced_pod(namespace, **raw))
    )
    lists: dict[str, tuple[Callable[[], Awaitable[Any]], Callable[[dict[str, Any]], bool]]] = {
        "gpupartitionpolicies.yaml": (cluster_list(GROUP, VERSION, POLICY_PLURAL), lambda _: True),
        "gpupartitions.yaml": (cluster_list(GROUP, VERSION, GPU_PARTITION_PLURAL), lambda _: True),
        "resourceslices.yaml": (
            cluster_list(*RESOURCE, "resourceslices", field_selector=f"spec.driver={DRIVER_NAME}"),
            lambda _: True,
        ),
        "resourceclaims.yaml": (claims, lambda _: True),
        "deviceclasses.yaml": (cluster_list(*RESOURCE, "deviceclasses"), lambda _: True),
        "events.yaml": (events, lambda _: True),
        "nodes.yaml": (lambda: core.list_node(**raw), dynamig_labelled),
        "pods.yaml": (
            lambda: core.list_pod_for_all_namespaces(label_selector=pod_selector, **raw),
            lambda _: True,
        ),
        "leases.yaml": (
            lambda: client.CoordinationV1Api(api).list_lease_for_all_namespaces(
                label_selector=NODE_LABEL, **raw
            ),
            lambda _: True,
        ),
        "validatingadmissionpolicies.yaml": (
            cluster_list(*ADMISSION, "validatingadmissionpolicies", label_selector=PART_OF),
            lambda _: True,
        ),
        "validatingadmissionpolicybindings.yaml": (
            cluster_list(*ADMISSION, "validatingadmissionpolicybindings", label_selector=PART_OF),
            lambda _: True,
        ),
        "workloads/pods": (pods_of_workloads, lambda _: True),  # reduced below, never written whole
    }
    results = await asyncio.gather(*(_read_json(call) for call, _ in lists.values()), return_exceptions=True)
    found: dict[str, list[dict[str, Any]]] = {}
    for (name, (_, keep)), result in zip(lists.items(), results, strict=True):
        if isinstance(result, BaseException):
            if not isinstance(result, _FAILURES):
                raise result
            archive.failed(name, result)
            continue
        found[name] = [i for i in result.get("items") or [] if keep(i)]
        if "/" not in name:
            archive.objects(name, found[name])
    if "resourceclaims.yaml" in found:
        ours = [c for c in found["resourceclaims.yaml"] if dynamig_claim(c)]
        archive.objects("workloads/resourceclaims.yaml", ours)
        if "workloads/pods" in found:
            archive.objects("workloads/pods.yaml", workload_pods(found["workloads/pods"], ours))
    if "workloads/pods" not in found:
        archive.missing.append("workloads/pods.yaml: the pods could not be listed (see above)")
    if "resourceclaims.yaml" not in found:
        archive.missing.append("workloads/: the ResourceClaims could not be listed (see above)")
    await _server_version(api, archive, raw)
    await _helm_values(core, found.get("pods.yaml", []), archive, raw)
    if "gpupartitions.yaml" in found:
        archive.text("verify.txt", verify_table(verify_report(found["gpupartitions.yaml"])) + "\n", "verify")
    await _pod_files(core, found.get("pods.yaml", []), archive, log_lines, raw)

    now = time.time()
    root = f"dynamig-must-gather-{_stamp(now)}"
    archive.files["summary.txt"] = _summary(archive, namespace, pod_selector, now).encode()
    with tarfile.open(path, "w:gz") as tar:
        for name, data in sorted(archive.files.items()):
            info = tarfile.TarInfo(f"{root}/{name}")
            info.size, info.mtime, info.mode = len(data), int(now), 0o644
            tar.addfile(info, io.BytesIO(data))
    return f"{len(archive.files)} file(s), {len(archive.missing)} item(s) could not be gathered (summary.txt)"


async def _server_version(api: client.ApiClient, archive: _Archive, raw: Mapping[str, Any]) -> None:
    try:
        version = await _read_json(lambda: client.VersionApi(api).get_code(**raw))
    except _FAILURES as exc:
        archive.failed("version.json", exc)
        return
    archive.text("version.json", json.dumps(version, indent=2) + "\n", f"server {version.get('gitVersion')}")


async def _helm_values(
    core: client.CoreV1Api, pods: list[dict[str, Any]], archive: _Archive, raw: Mapping[str, Any]
) -> None:
    """``helm/<namespace>/<release>.values.yaml`` for each release that dynamig's pods name: the deployed
    revision's Secret, listed by Helm's own labels, reduced to its values before anything is kept."""
    releases = sorted(
        {
            (p["metadata"]["namespace"], p["metadata"]["labels"][RELEASE_LABEL])
            for p in pods
            if RELEASE_LABEL in (p["metadata"].get("labels") or {})
        }
    )
    if not releases:
        archive.missing.append(
            "helm values: no dynamig pod names a Helm release (app.kubernetes.io/instance)"
        )
    for ns, release in releases:
        what = f"helm values of release {ns}/{release}"
        selector = f"owner=helm,name={release},status=deployed"
        try:
            listed = json.loads(
                await read_body(core.list_namespaced_secret(ns, label_selector=selector, **raw))
            )
            secrets = [s for s in listed.get("items") or [] if s.get("type") == "helm.sh/release.v1"]
            if not secrets:
                archive.missing.append(f"{what}: no Secret of type helm.sh/release.v1 labelled {selector}")
                continue
            latest = max(secrets, key=lambda s: int((s["metadata"].get("labels") or {}).get("version", "0")))
            values = release_values(latest)
            del listed, secrets, latest  # nothing of the Secrets but the values goes further
        except (*_FAILURES, KeyError, OSError, EOFError) as exc:
            archive.failed(what, exc)
            continue
        text = yaml.safe_dump(values, sort_keys=False)
        archive.text(f"helm/{ns}/{release}.values.yaml", text, f"{what}, revision {values['revision']}")


async def _pod_files(
    core: client.CoreV1Api,
    pods: list[dict[str, Any]],
    archive: _Archive,
    log_lines: int,
    raw: Mapping[str, Any],
) -> None:
    """Each container's log and each pod's /metrics (the container port named ``metrics``), via the API
    server (pods/log and the pods' proxy subresource), so no port needs to be reachable from here."""
    jobs: list[tuple[str, str, Awaitable[Any]]] = []
    for pod in pods:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        ns, name = str(meta["namespace"]), str(meta["name"])
        containers = spec.get("containers") or []
        for c in containers:
            call = core.read_namespaced_pod_log(name, ns, container=c["name"], tail_lines=log_lines, **raw)
            what = f"log of {ns}/{name} container {c['name']}"
            jobs.append((f"pods/{ns}/{name}/{c['name']}.log", what, call))
        ports = [p for c in containers for p in c.get("ports") or [] if p.get("name") == "metrics"]
        if ports:
            target = f"{name}:{ports[0]['containerPort']}"
            call = core.connect_get_namespaced_pod_proxy_with_path(target, ns, "metrics", **raw)
            jobs.append((f"pods/{ns}/{name}/metrics.txt", f"metrics of {ns}/{name}", call))
        else:
            archive.missing.append(f"metrics of {ns}/{name}: no container port named metrics")

    results = await asyncio.gather(*(read_body(call) for _, _, call in jobs), return_exceptions=True)
    for (file, what, _), result in zip(jobs, results, strict=True):
        if isinstance(result, BaseException):
            if not isinstance(result, _FAILURES):
                raise result
            archive.failed(what, result)
        else:
            archive.text(file, result.decode(errors="replace"), f"{what}, {len(result)} bytes")


def _summary(archive: _Archive, namespace: str | None, selector: str, now: float) -> str:
    lines = [
        f"kubectl-dynamig {__version__} must-gather, {datetime.fromtimestamp(now, UTC).isoformat()}",
        f"claims and Events: {'namespace ' + namespace if namespace else 'all namespaces'}",
        f"agent and operator pods: label selector {selector!r}, all namespaces",
        "",
        "gathered:",
        *(f"  {line}" for line in archive.gathered),
        "",
        "not gathered:" if archive.missing else "not gathered: nothing",
        *(f"  {line}" for line in archive.missing),
    ]
    return "\n".join(lines) + "\n"
