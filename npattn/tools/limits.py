"""The largest numbers the ``npattn`` command's flags take (a larger one is a usage error).

Besides the fixed limits below, a run whose arrays cannot fit in this machine's
memory is refused before it starts (``memory_error``): each command estimates
a *lower bound* of the bytes its run holds at its peak (the arrays it must
allocate, such as the ``B * H * L * L`` attention probabilities that the dense
paths keep for the backward) and compares it with the memory available to
this process (``available_memory``). A lower bound refuses only runs that
could not finish here (they would be killed, or swap for hours), never one
that fits, and the message quotes the estimate. Swap is not counted as
available (Linux's ``MemAvailable`` leaves it out), and a container may report
less or more than it can hold: every command that makes the check takes
``SKIP_MEMORY_CHECK`` (``--skip-memory-check``), which skips it, and the
refusal names that flag.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from ..attention import auto_blocked

__all__ = ["MAX_SIZE", "MAX_THREADS", "available_memory", "cgroup_room", "memory_error",
           "SKIP_MEMORY_CHECK", "SKIP_MEMORY_CHECK_HELP", "format_bytes", "dense_probabilities",
           "gpt_training_bytes", "repeated_entry"]

def repeated_entry(items: Any) -> Any:
    """The first entry of a comma-separated option's ``items`` that an earlier one repeats, or
    None: each option's usage error names it (a head count or worker count given twice ran
    twice, a kernel option given twice was taken once)."""
    seen: list = []
    for item in items:
        if item in seen:
            return item
        seen.append(item)
    return None


#: The largest size of a shape or of ``--gemm``: BLAS takes 32-bit sizes.
MAX_SIZE = 2**31 - 1
#: The most threads a flag takes (a larger count overflowed the C int of the BLAS call).
MAX_THREADS = 4096


#: The flag, on every command that makes the memory check (``memory_error``), that skips it.
SKIP_MEMORY_CHECK = "--skip-memory-check"
#: Its help, the same on every command.
SKIP_MEMORY_CHECK_HELP = ("run even where the lower-bound estimate of the run's memory exceeds the "
                          "memory available (MemAvailable, swap not counted, or the cgroup's room): "
                          "the check is skipped")


def _meminfo_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


#: The cgroup files ``cgroup_room`` reads under its root: v2, then v1 (limit, usage, and the
#: keys of ``memory.stat`` that count the page cache charged to the cgroup).
CGROUP_FILES = (("memory.max", "memory.current", "memory.stat", ("active_file", "inactive_file")),
                ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
                 ("total_active_file", "total_inactive_file")))


def _page_cache(path: str, keys: tuple) -> int:
    """The sum of ``keys`` in a cgroup's ``memory.stat`` (0 where it cannot be read)."""
    try:
        with open(path) as f:
            stat = dict(line.split()[:2] for line in f if len(line.split()) >= 2)
        return sum(int(stat.get(k, 0)) for k in keys)
    except (OSError, ValueError):
        return 0


def cgroup_room(root: str = "/sys/fs/cgroup") -> Optional[int]:
    """What this process's cgroup still allows, or None without a limit (or without the files).

    Its limit less its use, where the use leaves out the page cache (``active_file`` and
    ``inactive_file`` of ``memory.stat``): the cgroup's usage counts the files it has read,
    which the kernel drops before it refuses memory, so a container that had read a few GiB
    of files would otherwise seem full and refuse runs that fit.
    """
    for limit_name, usage_name, stat_name, keys in CGROUP_FILES:
        try:
            with open(os.path.join(root, limit_name)) as f:
                text = f.read().strip()
            if text == "max":
                return None
            limit = int(text)
            with open(os.path.join(root, usage_name)) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit >= 2**60:  # cgroup v1's "no limit"
            return None
        held = max(usage - _page_cache(os.path.join(root, stat_name), keys), 0)
        return max(limit - held, 0)
    return None


def available_memory() -> Optional[int]:
    """Bytes this process can allocate without swapping, or None where that cannot be read.

    Linux's ``MemAvailable`` (``/proc/meminfo``; swap is not in it), lowered to what the
    process's cgroup still allows when it sets a limit (``cgroup_room``); elsewhere the physical
    memory (``os.sysconf``).
    """
    room = [b for b in (_meminfo_available(), cgroup_room()) if b is not None]
    if room:
        return min(room)
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def format_bytes(n: float) -> str:
    """``n`` bytes in GiB (or MiB below one GiB), one decimal; huge numbers in powers of ten."""
    if n >= 2**30 * 1e6:
        return f"{n / 2**30:.3g} GiB"
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:.1f} MiB"


def memory_error(option: str, received: str, need: float, what: str,
                 available: Optional[int] = None) -> Optional[str]:
    """The usage error of a run that needs at least ``need`` bytes, or None when it fits.

    ``option`` and ``received`` name the flag and the value given, ``what`` says
    which arrays the estimate counts; ``available`` defaults to ``available_memory()``
    (None there: no check). The message ends by naming ``SKIP_MEMORY_CHECK``; a command
    given that flag does not call this.
    """
    available = available_memory() if available is None else available
    if available is None or need <= available:
        return None
    return (f"{option}: expected sizes whose arrays fit in the {format_bytes(available)} of memory "
            f"available here, got {received}, which needs at least {format_bytes(need)} ({what}); "
            f"choose smaller sizes, or pass {SKIP_MEMORY_CHECK} to run anyway")


def dense_probabilities(B: int, H: int, Lq: int, Lk: int, impl: str = "auto") -> int:
    """Entries of the attention probabilities a dense path keeps for the backward: ``B * H * Lq * Lk``,
    or 0 on the blocked path. ``impl="auto"`` resolves as ``attention.select_impl`` does for
    NumPy arrays without weights requested."""
    n = B * H * Lq * Lk
    if impl == "blocked":
        return 0
    if impl == "auto" and auto_blocked(B * H, Lq, Lk):
        return 0
    return n


def gpt_training_bytes(batch: int, seq_len: int, block_size: int, d_model: int, n_layer: int,
                       n_head: int, vocab: int, itemsize: int, d_ff: Optional[int] = None) -> int:
    """A lower bound of the bytes of one ``npattn.gpt`` training step (``training_step``).

    Counts the weight matrices (token and position embeddings, and per block
    the four ``D x D`` projections and the two ``D x F`` of the feed-forward)
    four times (values, gradients, Adam's two moments), the logits and their
    gradient (``2 B L V``), and per block the activations its backward needs at
    least: its input, the attention output and the feed-forward hidden layer
    (``B L (2 D + F)``), with the attention probabilities on the dense path
    (``B H L L``, ``dense_probabilities``). Biases, norms and temporaries are left out.
    """
    D, F = d_model, 4 * d_model if d_ff is None else d_ff
    B, L = batch, seq_len
    weights = vocab * D + block_size * D + n_layer * (4 * D * D + 2 * D * F)
    per_block = B * L * (2 * D + F) + dense_probabilities(B, n_head, L, L)
    return itemsize * (4 * weights + 2 * B * L * vocab + n_layer * per_block)

