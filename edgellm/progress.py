"""Stages of long work: each prints one line with its wall time and the process's peak RSS when it
ends, and the same figures go into the report."""

from __future__ import annotations

import contextlib
import functools
import gc
import resource
import sys
import time
from pathlib import Path


def peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def rss_mb() -> float:
    """The process's resident set now."""
    with open("/proc/self/statm") as f:
        return round(int(f.read().split()[1]) * resource.getpagesize() / 2**20, 1)


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


_MAPPED: set[str] = set()  # checkpoint files this process memory-mapped (note_mapped)


def note_mapped(paths) -> None:
    """Record checkpoint files whose tensors are memory-mapped, for `release_memory`."""
    _MAPPED.update(str(Path(p).resolve()) for p in paths)


def release_memory() -> None:
    """Collect garbage, hand freed heap pages back to the OS (glibc keeps them otherwise, so
    the next stage would stack its peak on the previous stage's) and drop the resident pages of
    memory-mapped checkpoints (`drop_mapped_pages`)."""
    gc.collect()
    drop_checkpoint_pages()


YOUNG_COLLECTION_EVERY = 10_000  # allocations; Python's default is 700


@contextlib.contextmanager
def long_run_collector(young: int = YOUNG_COLLECTION_EVERY):
    """Python's cycle collector set for one long export, and put back as it was after.

    Importing torch, ExecuTorch, transformers and coremltools leaves about 530 000 objects that
    live as long as the process, and an export makes many more (graph nodes, fake tensors, MIL
    ops). With the defaults (a young collection every 700 allocations, a full one whenever the
    survivors grow by a quarter) the collector traversed them again and again: 4.1 s of a 25 s
    Core ML export of LFM2.5-350M, 2.3 s of it in automatic collections. Here the objects alive
    on entry move to the permanent generation (`gc.freeze`: collections skip them, reference
    counting still frees them) and young collections wait for `young` allocations.
    Cycles a stage drops are still freed: `release_memory` collects between stages. A process
    that froze objects of its own before keeps its freeze (an unfreeze here would undo it)."""
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
    pages handed back. About 20 ms (it reads /proc/self/smaps): between stages, or every tens of
    MB of weights replaced (quantize.DROP_PAGES_EVERY), not per weight."""
    _trim()
    return drop_mapped_pages(_MAPPED)


@functools.cache
def _libc():
    """glibc, or None elsewhere (then there is nothing to trim or drop)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.malloc_trim  # noqa: B018 (glibc has it; other libcs may not)
        return libc
    except (OSError, AttributeError):
        return None


def _trim() -> None:
    if _libc() is not None:
        _libc().malloc_trim(0)


MADV_DONTNEED = 4  # Linux


def drop_mapped_pages(paths) -> int:
    """Drop this process's resident pages of the memory-mapped files `paths` (a checkpoint), so
    that weights a stage replaced (folded, fused, quantized) stop counting in its memory; a read
    of a page still in use faults it back from the page cache. A mapping with any page written
    (a private mapping's written pages live only in this process) is left alone. Linux only
    (elsewhere a no-op). Returns the MB dropped."""
    names = {str(Path(p).resolve()) for p in paths}
    libc = _libc()
    if not names or libc is None:
        return 0
    try:
        smaps = open("/proc/self/smaps").read().splitlines()
    except OSError:
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
            if libc.madvise(lo, hi - lo, MADV_DONTNEED) == 0:
                dropped += r["rss"]
    return dropped >> 10


class Stages:
    """Times named stages. Each prints one line when it ends; on a terminal, a live line
    (elapsed time and resident memory, redrawn every `tick` seconds) shows while it runs."""

    def __init__(self, quiet: bool = False, stream=None, tick: float = 0.5):
        self.quiet, self.stream, self.tick = quiet, stream or sys.stderr, tick
        self.records: list[dict] = []
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def stage(self, name: str):
        t0 = time.perf_counter()
        live = self._live(name, t0) if not self.quiet and _is_tty(self.stream) else None
        try:
            yield
        finally:
            if live:
                live.set()
                live.thread.join()
                self.stream.write("\r\033[K")  # clear the live line
        rec = {"name": name, "wall_s": round(time.perf_counter() - t0, 3),
               "peak_rss_mb": peak_rss_mb()}
        self.records.append(rec)
        if not self.quiet:
            print(f"[edgellm] {name:<10} {rec['wall_s']:8.1f} s   peak RSS {rec['peak_rss_mb']:8.0f} MB",
                  file=self.stream, flush=True)

    def _live(self, name: str, t0: float):
        import threading

        done = threading.Event()

        def draw():
            spin = "|/-\\"
            i = 0
            while not done.wait(self.tick):
                self.stream.write(f"\r[edgellm] {name:<10} {time.perf_counter() - t0:8.1f} s   "
                                  f"RSS {rss_mb():8.0f} MB {spin[i % 4]}")
                self.stream.flush()
                i += 1

        done.thread = threading.Thread(target=draw, daemon=True)
        done.thread.start()
        return done

    @property
    def wall_s(self) -> float:
        return round(time.perf_counter() - self.started, 3)
