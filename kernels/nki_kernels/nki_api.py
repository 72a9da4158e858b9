"""The single place kernels get NKI from.

`nki`, `nl` (nki.language) and `nisa` (nki.isa) are AWS's NKI (0.3 or later, installed from the Neuron
repository) when it is importable, and onnx-nmm's NumPy emulator otherwise, so the same kernel source runs
on Trainium and on a CPU. PyPI's `nki` 0.0.1 is a placeholder without the API and counts as absent.
Set ONNX_NMM_NKI=emulator to use the emulator even where NKI is installed (to run the CPU tests there).
"""

from __future__ import annotations

import inspect
import os


def _installed_nki():
    if os.environ.get("ONNX_NMM_NKI") == "emulator":
        return None
    try:
        import nki
        import nki.isa
        import nki.language
    except ImportError:
        return None
    try:  # NKI 0.3 introduced nc_matmul(..., accumulate=...) and the dst-first ISA signatures
        if "accumulate" not in inspect.signature(nki.isa.nc_matmul).parameters:
            return None
    except (AttributeError, TypeError, ValueError):
        return None
    return nki


if _installed_nki() is not None:
    import nki
    import nki.isa as nisa
    import nki.language as nl

    USING_EMULATOR = False
else:
    from onnx_nmm.kernels import emulator as nki

    nl = nki.language
    nisa = nki.isa
    USING_EMULATOR = True

__all__ = ["USING_EMULATOR", "nisa", "nki", "nl"]
