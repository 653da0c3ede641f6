"""Wall time and peak memory of one piece of work, measured in-process.

Peak resident memory is sampled from /proc/self/statm by a background thread (every `interval` seconds) while the
work runs, so each measured call gets its own peak, not the process's lifetime maximum; on CUDA the peak of
allocated device memory is reported too. Compare such numbers within one process only (see `grom bench`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_mb() -> float:
    """Current resident set size in MB (0 where /proc is unavailable)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * _PAGE / 2**20
    except OSError:
        return 0.0


@dataclass
class Measurement:
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    peak_cuda_mb: float | None = None


@contextmanager
def measure(interval: float = 0.02, *, cuda: bool | None = None) -> Iterator[Measurement]:
    """`with measure() as m: ...` then m.seconds and m.peak_rss_mb (and m.peak_cuda_mb on CUDA).

    `cuda` (default: where CUDA is available) resets and reads the device's peak-allocation counter, which is one
    per process: a measurement nested in another passes False, or the outer one's device peak is lost."""
    result = Measurement(peak_rss_mb=rss_mb())
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(interval):
            result.peak_rss_mb = max(result.peak_rss_mb, rss_mb())

    thread = threading.Thread(target=sample, daemon=True)
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()
        result.seconds = time.perf_counter() - start
        result.peak_rss_mb = max(result.peak_rss_mb, rss_mb())
        if cuda:
            result.peak_cuda_mb = torch.cuda.max_memory_allocated() / 2**20


class Timings:
    """Wall time (seconds) and peak resident memory (MB) per named stage, the one stage timer of grom:
    `with timings.stage("solve"): ...`.

    A stage entered twice adds up its seconds and keeps the larger peak; each finished stage is logged at INFO on
    `logger` when one is given, which is the per-stage progress a user watches in a long run. The peak is the
    process's resident memory while the stage ran (`measure`), so stages nested in it are inside it."""

    def __init__(self, logger=None, after_stage: Callable[[str], None] | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.peak_mb: dict[str, float] = {}
        self.started = time.perf_counter()
        self._log = logger
        self._after_stage = after_stage  # called with the name of each stage that finished without an error

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        used = Measurement()
        try:
            with measure(interval=0.05, cuda=False) as used:
                yield
        finally:  # a failed stage is timed and logged too
            self.seconds[name] = self.seconds.get(name, 0.0) + used.seconds
            self.peak_mb[name] = max(self.peak_mb.get(name, 0.0), used.peak_rss_mb)
            if self._log is not None:
                self._log.info("stage %-18s %7.2f s  peak %6.0f MB", name, self.seconds[name], self.peak_mb[name])
        if self._after_stage is not None:
            self._after_stage(name)

    def run(self, stage: str, fn, /, *args, **kwargs):
        """`fn(*args, **kwargs)` timed as stage `stage`."""
        with self.stage(stage):
            return fn(*args, **kwargs)

    def total(self) -> float:
        return time.perf_counter() - self.started

    def summary(self) -> str:
        """One line: each stage's seconds, in the order the stages first ran."""
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds.items())
