"""The kernel module the engine calls: the compiled one, or (APPLIANCE_KERNELS=numpy) its numpy twin.

The one place that decides: everything numeric in the engine goes through `dispatch.kernels`
(GEMMs, attention, the sparse probes and block choice, the KV cache writes), so swapping paths
never touches model code, and under APPLIANCE_KERNELS=numpy nothing compiled is imported.
"""
from __future__ import annotations

import os

from appliance.errors import ApplianceError


def _load():
    if os.environ.get("APPLIANCE_KERNELS") == "numpy":
        from appliance.kernels import reference
        return reference
    try:
        from appliance.kernels import _kernels
    except ImportError as e:
        raise ApplianceError(f"the compiled kernels are not built ({e}); run `make build`") from None
    if not _kernels.cpu_supported():
        raise ApplianceError(
            f"this CPU lacks the instructions the kernels were built for (path {_kernels.kernel_path()}, "
            f"CPU features: {_kernels.cpu_features() or 'none found'}); rebuild on this machine "
            f"(`make build`, or APPLIANCE_PORTABLE=1 for the portable path)")
    return _kernels


kernels = _load()
COMPILED = kernels.__name__ != "appliance.kernels.reference"   # False: the numpy twin runs
