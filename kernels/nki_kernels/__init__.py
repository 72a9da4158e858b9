"""The NKI kernels themselves, and the one module they get NKI from (nki_api): AWS's NKI on Trainium, the emulator
on a CPU, the same source either way."""
