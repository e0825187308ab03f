"""Where one RL step's time goes on this worker: :class:`StepClock`, the phase durations (``time/<phase>_s``) and
wall-clock spans (``sched/timeline``) of :meth:`tltlib.rl.trainer.GRPOTrainer.step`.

On a GPU the clock synchronises the device at each phase boundary (its kernels run after their launches return).

Departures: none (bookkeeping).
"""
from __future__ import annotations

import contextlib
import time

from ..machine import device_sync


class StepClock:
    """Where one RL step's time went on this worker: phase durations (``time/<phase>_s``, from
    ``time.perf_counter``) and wall-clock spans (``time.time``: comparable across workers, for ``sched/timeline``).

    ``device``: where the step's work runs; on a GPU every phase boundary (and a span ending now) waits for the work
    queued so far (``torch.cuda.synchronize``), so a phase is charged its own kernels, not the launches of them
    (:func:`tltlib.machine.device_sync`). None or a CPU: no synchronisation."""

    def __init__(self, device=None):
        self.sync = device_sync(device)
        self.sync()
        self.t0 = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.spans: list[tuple[str, float, float]] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the enclosed block as phase ``name`` (the device's work queued before it is not charged to it)."""
        self.sync()
        t = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.phases[name] = time.perf_counter() - t

    def span(self, name: str, start: float, end: float | None = None) -> None:
        """Record the wall-clock span ``start``-``end`` (default: now, once the device's queued work is done) as
        ``name``."""
        if end is None:
            self.sync()
        self.spans.append((name, start, time.time() if end is None else end))

    def last(self, name: str) -> tuple[float, float]:
        """(start, end) of the last span called ``name``."""
        return next((a, b) for n, a, b in reversed(self.spans) if n == name)

    def metrics(self) -> dict[str, float]:
        """``time/<phase>_s`` of every phase and ``time/step_s`` (since the clock started)."""
        return {**{f"time/{k}_s": v for k, v in self.phases.items()}, "time/step_s": time.perf_counter() - self.t0}
