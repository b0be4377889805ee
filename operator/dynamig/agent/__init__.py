"""The node agent, one per GPU node: owns NVML, the node's ResourceSlices, GpuPartition status, DRA plugin.

Modules, one concern each:

- ``nvml_device`` — discovery, adoption, create (explicit placement + full-GI CI) and destroy through the NVML
  API, over real ``pynvml`` or the simulated ``dynamig.backends.simnvml`` (the module is a parameter);
- ``reconcile`` — the reshape protocol for one GPU as a pure function (observed + desired -> plan);
- ``controller`` — the loop: observe NVML and the API, carry out plans, publish, write status;
- ``publisher`` — keeps the node's pool of ResourceSlices equal to the devices plans offer
  (pure builder in ``dynamig.kube.slices``, devices from ``dynamig.kube.devices``);
- ``kubeapi`` — the API calls, transient errors retried with backoff; ``watch`` — wake-ups on changes;
- ``ownership`` — opt-in label and other MIG owners; ``metrics`` — Prometheus metrics on a passed registry;
- ``devices_service`` — MIG instances on demand for the kubelet plugin (``plugin/``);
- ``main`` — wiring for ``dynamig agent``.
"""
