"""Stages of long work: each prints one line with its wall time and the process's peak RSS when it
ends, and the same figures go into the report. On a terminal a live line shows while it runs."""

from __future__ import annotations

import contextlib
import sys
import time

from .memory import peak_rss_mb, rss_mb


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Stages:
    """Times named stages. Each prints one line when it ends; on a terminal, a live line
    (elapsed time and resident memory, redrawn every `tick` seconds) shows while it runs."""

    def __init__(self, quiet: bool = False, stream=None, tick: float = 0.5):
        self.quiet, self.stream, self.tick = quiet, stream or sys.stderr, tick
        self.records: list[dict] = []
        self.started = time.perf_counter()
        self.count = ""  # the running stage's "done/total", where it reports one (progress)
        self.tenth = 0  # and the last tenth of it printed off a terminal

    @contextlib.contextmanager
    def stage(self, name: str):
        t0 = time.perf_counter()
        live = self._live(name, t0) if not self.quiet and _is_tty(self.stream) else None
        self.count, self.tenth = "", 0
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
            print(f"[edgellm] {name:<10} {rec['wall_s']:8.1f} s   "
                  f"peak RSS {rec['peak_rss_mb']:8.0f} MB",
                  file=self.stream, flush=True)

    def _live(self, name: str, t0: float):
        import threading

        done = threading.Event()

        def draw():
            spin = "|/-\\"
            i = 0
            while not done.wait(self.tick):
                self.stream.write(f"\r[edgellm] {name:<10} {time.perf_counter() - t0:8.1f} s   "
                                  f"RSS {rss_mb():8.0f} MB {spin[i % 4]} {self.count}")
                self.stream.flush()
                i += 1

        done.thread = threading.Thread(target=draw, daemon=True)
        done.thread.start()
        return done

    def progress(self, done: int, total: int) -> None:
        """Items of the running stage done: on the live line, or off a terminal a line at each
        tenth of them."""
        tenth, self.count = done * 10 // total, f"{done}/{total}"
        if not self.quiet and not _is_tty(self.stream) and tenth > self.tenth:
            print(f"[edgellm]   {self.count}", file=self.stream, flush=True)
        self.tenth = max(self.tenth, tenth)

    @property
    def wall_s(self) -> float:
        return round(time.perf_counter() - self.started, 3)
