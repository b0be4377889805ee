"""GPU generations by catalog key, and the one fact about them that policy needs: whether switching a model's
MIG mode resets the GPU. Pure data, no I/O.

- Ampere (A100, A30) switches MIG mode through a GPU reset: "Setting MIG mode on the A100/A30 requires a GPU
  reset" (NVIDIA MIG user guide, Deployment Considerations). Where the platform does not expose the reset (a
  pass-through VM), NVML answers ``NVML_ERROR_RESET_REQUIRED`` and only a VM reboot applies the mode.
- Hopper and later switch without one: on H100 "the MIG enablement is controlled by driver" (an NVIDIA
  engineer, NVIDIA/gpu-admin-tools#2), and kubernetes-sigs/dra-driver-nvidia-gpu toggles MIG mode without a
  reset only on architectures from Hopper on (``supportsMIGModeToggle``).

The operator switches a model whose switch needs a reset only where the policy allows it
(``spec.migMode.allowReset``); the simulated NVML (``dynamig.backends.simmode``) models the reset from the
same table.
"""

from __future__ import annotations

from enum import StrEnum


class Generation(StrEnum):
    AMPERE = "Ampere"
    HOPPER = "Hopper"
    ADA = "Ada"  # no MIG (L4)
    BLACKWELL = "Blackwell"


# Catalog key prefix -> generation, longest prefixes first where one prefix starts another (H200 / H20).
_BY_PREFIX: tuple[tuple[str, Generation], ...] = (
    ("A100", Generation.AMPERE),
    ("A30", Generation.AMPERE),
    ("H100", Generation.HOPPER),
    ("H200", Generation.HOPPER),
    ("H20", Generation.HOPPER),
    ("L4", Generation.ADA),
    ("GB200", Generation.BLACKWELL),
    ("B200", Generation.BLACKWELL),
    ("RTXPRO", Generation.BLACKWELL),
)

# Generations whose MIG mode switch goes through a GPU reset.
RESET_SWITCHED: frozenset[Generation] = frozenset({Generation.AMPERE})


def generation(model_key: str) -> Generation | None:
    """The generation of a GPU model by its catalog key (``A100-80GB``: Ampere); None when unknown. Pure."""
    for prefix, gen in _BY_PREFIX:
        if model_key.startswith(prefix):
            return gen
    return None


def mode_switch_needs_reset(model_key: str) -> bool:
    """Whether switching MIG mode on this model resets the GPU (Ampere), see the module docstring. A model of
    unknown generation is taken as needing one: it is never switched unless a reset is allowed. Pure."""
    gen = generation(model_key)
    return gen is None or gen in RESET_SWITCHED
