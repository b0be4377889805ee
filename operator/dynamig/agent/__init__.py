"""The node agent, one per GPU node: owns NVML, the node's ResourceSlices, GpuPartition status, DRA plugin.

Packages and modules, one concern each:

- ``nvml`` — discovery, adoption, create (explicit placement + full-GI CI) and destroy through the NVML API
  (``nvml.device``), over real ``pynvml`` or the simulated ``dynamig.backends.simnvml`` (the module is a
  parameter); the profile table NVML reports (``nvml.catalog``), NVLink facts (``nvml.fabric``), the
  simulated driver's files;
- ``layout`` — the reshape protocol for one GPU as a pure function (``layout.reconcile``: observed + desired
  -> plan), carried out through NVML (``layout.reshape``), the device lifecycle, retries;
- ``bindings`` — the answer to each allocation waiting on binding conditions (``bindings.decide``, pure;
  ``bindings.allocations``), the holds kept for claims, bookings not answered yet, stranded pods;
- ``modes`` — MIG mode switches on request (``modes.switch``) and GPUs served whole (``modes.whole``);
- ``health`` — XID errors (``health.xid``) as DRA device taints or withdrawn devices (``health.devices``);
- ``publishing`` — the node's ResourceSlices (``publishing.publisher``; pure builder in
  ``dynamig.kube.slices``), GpuPartition status and Events, which inventory the API takes, who owns a GPU;
- ``kube`` — the API calls, transient errors retried with backoff (``kube.api``), and the watched copies the
  rounds read;
- ``controller`` — the loop: observe NVML and the API, carry out plans, publish, write status;
- ``devices_service`` — MIG instances on demand for the kubelet plugin (``plugin/``); ``prepared`` — the
  devices it prepared; ``metrics`` — Prometheus metrics on a passed registry; ``endpoints`` — /metrics,
  /healthz, /readyz; ``main`` — wiring for ``dynamig agent``.
"""
