"""Keep freed CPU memory for reuse: glibc malloc's thresholds, tuned for meta-steps.

A meta-step allocates and frees the same large activations every step. glibc's default
malloc hands big blocks back to the kernel as soon as they are freed (``mmap``/``munmap``
above a threshold that adapts up to 32 MiB, and trimming the heap top beyond twice that),
so the next step's blocks are fresh pages and every 4 KiB page costs a minor page fault
when first written. On a vmapped conv4 meta-step at 15 query per class (2 CPU cores,
``scripts/bench_maml.py --malloc default``) that was 120k-280k faults per step, about a
quarter of its time; with `tune_malloc` it was under a dozen.

`tune_malloc` fixes the two thresholds (``mallopt(3)``), so blocks up to 32 MiB come from
the heap and freed memory stays in the process. It changes the whole process (every
library in it allocates through the same malloc), which is why it is a call you make, not
something importing metalearn does. The price: the process keeps up to ``trim_threshold``
bytes of freed heap instead of returning it, so its resident size stays near its peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from dataclasses import dataclass

__all__ = ["MallocTuning", "tune_malloc"]

# mallopt(3) parameter numbers, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MIB = 1 << 20
MAX_MMAP_THRESHOLD = 32 * MIB
"""glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (HEAP_MAX_SIZE / 2); above it mallopt fails."""


@dataclass(frozen=True)
class MallocTuning:
    """What `tune_malloc` did."""

    applied: bool
    """True when both thresholds were set."""
    mmap_threshold: int | None
    """Bytes: blocks at least this big are mmapped (None when nothing was set)."""
    trim_threshold: int | None
    """Bytes of free heap top kept before returning memory to the kernel (None: not set)."""
    reason: str
    """Why nothing was applied, or a one-line summary of what was."""


def tune_malloc(
    mmap_threshold: int = MAX_MMAP_THRESHOLD, trim_threshold: int = 1024 * MIB
) -> MallocTuning:
    """Make glibc malloc keep freed blocks for reuse instead of returning them to the kernel.

    Call it once, early (the experiments do; ``--no-tune-malloc`` turns it off). Elsewhere
    than Linux with glibc (macOS, Windows, musl) it does nothing and says so in ``reason``.

    Args:
        mmap_threshold: bytes; smaller blocks come from the heap and are reused. At most
            32 MiB, glibc's ceiling on 64-bit.
        trim_threshold: bytes of free memory at the heap's top kept before trimming it.

    Returns:
        A `MallocTuning` saying what was set.

    Raises:
        ValueError: a threshold out of range (negative, or ``mmap_threshold`` above 32 MiB).
    """
    if not 0 <= mmap_threshold <= MAX_MMAP_THRESHOLD:
        raise ValueError(
            f"mmap_threshold must be between 0 and {MAX_MMAP_THRESHOLD} bytes (glibc's "
            f"ceiling, 32 MiB), got {mmap_threshold}"
        )
    if trim_threshold < 0:
        raise ValueError(f"trim_threshold must be >= 0 bytes, got {trim_threshold}")
    libc_name, _ = platform.libc_ver()
    if platform.system() != "Linux" or libc_name != "glibc":
        where = f"{platform.system()} with {libc_name or 'an unknown libc'}"
        return MallocTuning(False, None, None, f"not glibc ({where}): nothing to tune")
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # mallopt takes an int: clamp the trim threshold to what fits (2 GiB - 1 is plenty).
    trim = min(trim_threshold, 2**31 - 1)
    ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) and libc.mallopt(_M_TRIM_THRESHOLD, trim)
    if not ok:
        return MallocTuning(False, None, None, "glibc's mallopt refused the thresholds")
    summary = f"glibc malloc: mmap threshold {mmap_threshold / MIB:g} MiB, trim {trim / MIB:g} MiB"
    return MallocTuning(True, mmap_threshold, trim, summary)
