"""The dynamig operator: turns pending MIG claims into GpuPartition layouts, one GpuPartitionPolicy at a time.

Modules, from the edge inwards:

- ``handlers`` — Kopf wiring (an explicit registry: one daemon per policy runs its loop; watch events on pods,
  claims, slices, GpuPartitions, nodes and policies wake the loops) and :func:`run_operator`, which builds
  every dependency and runs Kopf in the current event loop::

      from dynamig.operator.handlers import run_operator
      from dynamig.operator.settings import OperatorSettings

      settings = OperatorSettings(kubeconfig=path, standalone=True)
      stop, ready = asyncio.Event(), asyncio.Event()
      task = asyncio.create_task(run_operator(settings, stop, ready))
      await ready.wait()   # watching; set ``stop`` to shut down

- ``reconciler`` — per policy: read a snapshot, decide a round, write layouts, offered profiles and MIG mode
  switches, policy status, Events, metrics.
- ``kubeio`` — the API calls (kubernetes-asyncio, retried with tenacity).
- ``decide`` (pure) — mode, cooldown and disruption budget over the planner's answer; the profiles offered on
  GPUs with the partitionable inventory (booked by the scheduler, never re-cut ahead); the "why pending?"
  verdict of every claim (Event reasons ``ReshapeScheduled``, ``ReshapeInProgress``, ``WaitingForScheduler``,
  ``WaitingForCooldown``, ``WaitingForDisruptionBudget``, ``NoCapacity``, ``ProfileNotAllowed``,
  ``NoMatchingProfile``, ``NoEligibleNode``, ``ReshapeDisabled``, ``WouldReshape``, ``PolicyInvalid``,
  ``WaitingForWholeGpu``, ``WaitingForMigModeSwitch``).
- ``modes`` (pure) — MIG mode on demand under ``spec.migMode.policy: Dynamic``: which GPU's ``spec.migMode``
  to write for the round's claims (an idle MIG GPU off for a claim of whole GPUs, a free whole GPU on for MIG
  claims with no room), within floors, cooldown, ``allowReset``, one switch per round and the disruption
  budget; the verdicts it changes; GPUs whose agent answered ``ResetRequired``.
- ``demand`` (pure) — pending claims and the profiles each request accepts, by real CEL evaluation
  (``dynamig.kube.cel``) of the request's and its DeviceClass's selectors against ``MigDevice`` (and
  ``WholeGpuDevice``: whole-GPU demand, kept out of the MIG planner).
- ``inventory`` (pure) — GpuPartitions as planner input (busy, in-flight, unusable GPUs).
- ``settings``, ``metrics`` — one settings dataclass; Prometheus metrics in their own registry.

Policy validation is split: the API server refuses what the CRD schema and its CEL rules see (profile-name
syntax, ranges, conflicting fields); what needs the MIG geometry (a baseline layout the model cannot hold, a
profile no governed model has, an unknown product) is found by
``dynamig.kube.policy.check_spec_against_catalog`` and reported as condition ``Valid=False`` (reason
``InvalidSpec``) plus a Warning Event naming the field; such a policy changes nothing.

Policies carry Kopf's finalizer ``operator.dynamig.io/finalizer`` (Kopf stops a policy's daemon before the
policy goes): with no operator running, a policy deletion waits until one runs, or until that finalizer is
removed by hand.
"""
