"""Memory of a long export: resident and peak RSS, handing freed pages back to the OS (garbage
cycles, glibc's free heap pages, memory-mapped checkpoint pages a stage replaced), and Python's
cycle collector tuned for the run. What needs Linux (/proc, madvise) or glibc (malloc_trim) does
nothing elsewhere."""

from __future__ import annotations

import contextlib
import functools
import gc
import resource
import sys
from pathlib import Path


def peak_rss_mb() -> float:
    """The process's peak resident set since it started its program: Linux's VmHWM. Not
    getrusage's ru_maxrss, which Linux carries across exec, so that an export started by a
    process that once held more (a bench, a sweep, a notebook) would report the parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return round(peak / (2**20 if sys.platform == "darwin" else 1024), 1)


def rss_mb() -> float:
    """The process's resident set now (its peak where /proc is not there to say)."""
    try:
        with open("/proc/self/statm") as f:
            return round(int(f.read().split()[1]) * resource.getpagesize() / 2**20, 1)
    except OSError:
        return peak_rss_mb()


def available_bytes() -> int | None:
    """Memory the system can give without swapping (Linux's MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


_MAPPED: set[str] = set()  # checkpoint files this process memory-mapped (note_mapped)


def note_mapped(paths) -> None:
    """Record checkpoint files whose tensors are memory-mapped, for `release_memory`."""
    _MAPPED.update(str(Path(p).resolve()) for p in paths)


def release_memory() -> None:
    """Collect garbage, hand freed heap pages back to the OS (glibc keeps them otherwise, so
    the next stage would stack its peak on the previous stage's) and drop the resident pages of
    memory-mapped checkpoints (`drop_checkpoint_pages`)."""
    gc.collect()
    drop_checkpoint_pages()


YOUNG_COLLECTION_EVERY = 10_000  # allocations; Python's default is 700


@contextlib.contextmanager
def long_run_collector(young: int = YOUNG_COLLECTION_EVERY):
    """Python's cycle collector set for one long export, and put back as it was after.

    Importing torch, ExecuTorch, transformers and coremltools leaves hundreds of thousands of
    objects that live as long as the process, and an export makes many more (graph nodes, fake
    tensors, MIL ops). With the defaults (a young collection every 700 allocations, a full one
    whenever the survivors grow by a quarter) the collector traverses them again and again.
    Here the objects alive on entry move to the permanent generation (`gc.freeze`: collections
    skip them, reference counting still frees them) and young collections wait for `young`
    allocations. Cycles a stage drops are still freed: `release_memory` collects between
    stages. A process that froze objects of its own before keeps its freeze (an unfreeze here
    would undo it)."""
    threshold, ours = gc.get_threshold(), gc.get_freeze_count() == 0  # ours: we freeze, we thaw
    if ours:
        gc.freeze()
    gc.set_threshold(young, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if ours:
            gc.unfreeze()


def drop_checkpoint_pages() -> int:
    """`drop_mapped_pages` for every checkpoint noted by `note_mapped`, and glibc's free heap
    pages handed back. It reads /proc/self/smaps: call it between stages, or every tens of MB of
    weights replaced (quantize.apply), not per weight."""
    lib = libc()
    if hasattr(lib, "malloc_trim"):  # glibc's; other C libraries hand pages back themselves
        lib.malloc_trim(0)
    return drop_mapped_pages(_MAPPED)


@functools.cache
def libc():
    """The C library this process runs on (ctypes), with `madvise`'s argument types set."""
    import ctypes

    lib = ctypes.CDLL(None, use_errno=True)
    lib.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return lib


MADV_DONTNEED = 4  # Linux


def drop_mapped_pages(paths) -> int:
    """Drop this process's resident pages of the memory-mapped files `paths` (a checkpoint), so
    that weights a stage replaced (folded, fused, quantized) stop counting in its memory; a read
    of a page still in use faults it back from the page cache. A mapping with any page written
    (a private mapping's written pages live only in this process) is left alone. Linux only
    (elsewhere a no-op). Returns the MB dropped."""
    names = {str(Path(p).resolve()) for p in paths}
    if not names:
        return 0
    try:
        smaps = open("/proc/self/smaps").read().splitlines()
    except OSError:  # not Linux
        return 0
    regions, current = [], None
    for line in smaps:
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            current = {"range": (lo, hi), "path": fields[5] if len(fields) > 5 else "",
                       "rss": 0, "written": 0}
            regions.append(current)
        elif current is not None and fields[0] in ("Rss:", "Anonymous:"):
            current["rss" if fields[0] == "Rss:" else "written"] = int(fields[1])
    dropped = 0
    for r in regions:
        if r["path"] in names and r["rss"] and not r["written"]:
            lo, hi = r["range"]
            if libc().madvise(lo, hi - lo, MADV_DONTNEED) == 0:
                dropped += r["rss"]
    return dropped >> 10
