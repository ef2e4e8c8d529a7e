"""The largest numbers the ``npattn`` command's flags take (a larger one is a usage error)."""

from __future__ import annotations

__all__ = ["MAX_SIZE", "MAX_THREADS"]

#: The largest size of a shape or of ``--gemm``: BLAS takes 32-bit sizes.
MAX_SIZE = 2**31 - 1
#: The most threads a flag takes (a larger count overflowed the C int of the BLAS call).
MAX_THREADS = 4096
