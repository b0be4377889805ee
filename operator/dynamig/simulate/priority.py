"""Priority classes of simulated jobs: where a job's priority comes from, and the class it is reported in.

Three classes, as the openb trace's ``qos`` column has them (a Kubernetes ``PriorityClass`` value each):

- ``LS`` (latency-sensitive), priority 1000; the trace's 6 ``Guaranteed`` GPU tasks join it;
- ``Burstable``, priority 500;
- ``BE`` (best-effort), priority 0; also any ``qos`` the trace leaves empty or names otherwise.

The synthetic traces have no ``qos``: a class in a trace file may name its ``priority`` (one of the class
names); otherwise a class of ``kind: inference`` is ``LS`` and every other kind (batch, training, mixed) is
``BE``: the serving pods that a platform team protects, against the jobs that can wait.

Pure.
"""

from __future__ import annotations

CLASSES: dict[str, int] = {"LS": 1000, "Burstable": 500, "BE": 0}  # name -> priority, highest first
_QOS = {"ls": "LS", "guaranteed": "LS", "burstable": "Burstable", "be": "BE"}


def qos_priority(qos: str) -> int:
    """The priority of an openb task of ``qos`` (``BE`` for an empty or unknown one). Pure."""
    return CLASSES[_QOS.get(qos.strip().lower(), "BE")]


def kind_priority(kind: str, named: str | None = None) -> int:
    """The priority of a synthetic job class: ``named`` (a class name) when given, else ``LS`` for
    ``inference`` and ``BE`` for every other kind. ValueError on an unknown name. Pure."""
    if named is not None:
        if named not in CLASSES:
            raise ValueError(f"priority must be one of {', '.join(CLASSES)}, not {named!r}")
        return CLASSES[named]
    return CLASSES["LS"] if kind == "inference" else CLASSES["BE"]


def class_of(priority: int) -> str:
    """The class a priority is reported in: the highest class at or below it (``BE`` below all). Pure."""
    for name, value in CLASSES.items():
        if priority >= value:
            return name
    return "BE"
