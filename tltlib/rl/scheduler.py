"""The idle-time scheduler: the spot trainer that trains the drafter on workers whose rollout is over, the merge of
the workers' drafters, and the ``sched/*`` metrics of where the workers' time went.

W data-parallel workers (:class:`tltlib.rl.world.DistributedWorld`) each roll out their share of an RL step's GRPO
groups. A worker whose rollout is over goes BUSY -> IDLE -> TRAINING (:meth:`SpotTrainer.idle_window`):

1. it reports its rollout's end (a non-blocking arrival that completes when the last worker reports) and listens
   for the others for ``GRACE_S``: the last worker to finish knows it is last and never starts a micro-step;
2. it runs drafter micro-steps on its pair buffer until the *last* worker's rollout ends (preemption is checked
   between micro-steps, so training stops at most one micro-step after the last rollout; ``micro_step_pairs`` bounds
   a micro-step's length), at most ``max_micro_steps``;
3. **drafter sync** (:meth:`SpotTrainer.sync`): the workers' drafters (trainable tensors only, never the target's
   embedding or head) and their AdamW moments are averaged, weighted by the micro-steps each ran (one trainer: its
   weights are broadcast); every worker then holds the same drafter, whose ``version`` moves by one. With
   ``train_on: all`` the step's pairs of every worker are exchanged too.

:func:`schedule_metrics` turns every worker's :class:`SpotWindow` and wall-clock spans into ``sched/*``: idle share,
harvested share (training inside the idle window / idle time), preemption latency, sync time, the timeline.

Paper: TLT §5 (spot trainer on idle workers, BUSY -> IDLE -> TRAINING, preemptible; the drafter update reaches every
rollout worker). Reference: ``worker_manager.py`` (ZMQ coordinator; stops almost at once; replicas never synced).
Departures:
1. With W = 1 there is no idle worker: the drafter trains after the update (:meth:`tltlib.rl.trainer.GRPOTrainer.
   train_drafter`), as in one process.
2. The drafters of several trainers are merged by step-weighted averaging of weights and AdamW moments (local SGD),
   not gradient all-reduce: the trainers start and stop at different times, so they cannot step together.
3. A resumed run is bit-identical when the rollout does not use the drafter (``speculative: off``); with SD on,
   the number of spot micro-steps depends on timing, so the drafter, and through it the random draws, differ (the
   output distribution does not: SD is exact).
4. ``sched/*`` latencies compare wall clocks across workers, so several nodes need clocks synchronised well below
   them (NTP: about a millisecond).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import BadInput

TRAIN_ON = ("own", "all")
GRACE_S = 0.005
"""How long a worker whose rollout just ended listens for the others' arrivals before it starts training."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Data-parallel workers and their spot trainer."""

    spot_trainer: bool = True
    """Train the drafter on workers whose rollout is over, until the last one ends (False: after the update)."""
    max_micro_steps: int = 200
    """Most drafter micro-steps one worker runs in one idle window (the spot trainer's budget)."""
    train_on: str = "own"
    """The spot trainer's data: ``"own"`` (this worker's rollouts) or ``"all"`` (the step's pairs of every worker are
    exchanged after the rollout, so each buffer holds every worker's earlier steps plus its own current one)."""
    micro_step_pairs: int = 1024
    """Most (hidden, token) pairs in one spot-trainer micro-step (at least one sequence): bounds a micro-step's
    time and so the preemption latency (0 = the one-process batch, ``tlt.drafter_batch`` sequences)."""
    hang_timeout_s: float = 1800.0
    """A worker that has not finished its rollout (or reached the update) this long after the others is named in an
    error and the job stops (torchrun restarts it with ``--max-restarts``)."""

    def __post_init__(self):
        if self.train_on not in TRAIN_ON:
            raise BadInput(f"scheduler.train_on must be one of {TRAIN_ON}, got {self.train_on!r}")
        if self.spot_trainer and self.max_micro_steps < 1:
            raise BadInput(f"the spot trainer is on but its budget max_micro_steps is {self.max_micro_steps}: give "
                           "it >= 1 micro-step per idle window, or set spot_trainer: false")
        if self.micro_step_pairs < 0:
            raise BadInput(f"micro_step_pairs must be >= 0 (0 = no bound), got {self.micro_step_pairs}")
        if not self.hang_timeout_s > 0:
            raise BadInput(f"hang_timeout_s must be > 0 seconds, got {self.hang_timeout_s}")


@dataclass
class SpotWindow:
    """One worker's idle window in one RL step (wall-clock seconds from ``time.time()``)."""

    start: float
    """Its rollout's start."""
    end: float
    """Its rollout's end."""
    steps: int = 0
    """Spot micro-steps it ran."""
    train: float | None = None
    """When training started (None: it did not train)."""
    stop: float | None = None
    """When training stopped."""
    micro: list = field(default_factory=list)
    """Seconds of each micro-step."""
    sync_s: float = 0.0
    """Seconds of the drafter sync (and pair exchange)."""
    signal_s: float | None = None
    """Seconds from the last rollout's end until this worker saw it (only when it did not train)."""
    stats: dict = field(default_factory=dict)
    """``drafter/*`` statistics of its last micro-step."""
    version: int | None = None
    """The drafter's version before this window's sync (None: one worker, no sync), which moves it when any worker
    trained: what the step's drafter training is measured against (:func:`tltlib.rl.online.version_before`)."""

    def record(self, rank: int, spans: list) -> dict:
        """What :func:`schedule_metrics` reads of this worker."""
        return {"rank": rank, "start": self.start, "end": self.end, "steps": self.steps, "train": self.train,
                "stop": self.stop, "micro": self.micro, "sync_s": self.sync_s, "signal_s": self.signal_s,
                "events": spans}


class SpotTrainer:
    """The spot trainer of one worker and the drafter sync of all workers.

    Args:
        world: the workers (:class:`tltlib.rl.world.World`; one process: nothing to wait for, nothing to sync).
        config: :class:`SchedulerConfig`.
        drafter_trainer: the online drafter's :class:`tltlib.drafting.train.DrafterTrainer` (None: no drafter trains;
            the workers still meet at the end of the rollout).
        buffer: the :class:`tltlib.drafting.pairs.PairBuffer` it samples from.
        batch_sequences: sequences per micro-step (``tlt.drafter_batch``).
    """

    def __init__(self, world, config: SchedulerConfig, drafter_trainer, buffer, batch_sequences: int):
        self.world, self.config = world, config
        self.drafter_trainer, self.buffer, self.batch_sequences = drafter_trainer, buffer, batch_sequences

    @property
    def active(self) -> bool:
        """Whether the drafter trains in idle windows (several workers, ``spot_trainer`` on)."""
        return self.config.spot_trainer and self.world.size > 1

    def idle_window(self, rl_step: int, clock) -> SpotWindow:
        """From the end of this worker's rollout (the last ``rollout`` span of ``clock``) until the last worker's:
        with the spot trainer on, train the drafter, then merge the drafters (off: only wait); with ``train_on:
        all``, exchange the step's pairs. Adds the ``training`` and ``sync`` spans to ``clock``. One worker: an
        empty window at once."""
        window = SpotWindow(*clock.last("rollout"))
        end = window.end
        if self.world.size == 1:
            return window
        arrival = self.world.arrive(end)
        drafter = self.drafter_trainer.drafter if self.drafter_trainer is not None else None
        version = window.version = getattr(drafter, "version", 0)
        # the last worker to finish must not start a micro-step: it knows it is last when every other worker's
        # arrival has reached it (messages posted before this worker listened take a few ms to land)
        grace = time.time() + GRACE_S
        while arrival.missing() and not arrival.done() and time.time() < grace:
            time.sleep(0.0002)
        if self.active and self.drafter_trainer is not None and arrival.missing() and not arrival.done() \
                and self.buffer.sequences():
            self._train_until_done(arrival, window, clock)
        ends = arrival.wait("finished their rollout")
        if not window.steps:
            window.signal_s = time.time() - float(ends.max())
        t0 = time.time()
        if self.config.spot_trainer:
            self.sync(window.steps, version)
        if self.config.train_on == "all" and self.buffer is not None:
            self._exchange_pairs(rl_step)
        window.sync_s = time.time() - t0
        clock.span("sync", t0)
        return window

    def _train_until_done(self, arrival, window: SpotWindow, clock) -> None:
        """Micro-steps until every worker has arrived (checked between micro-steps) or the budget is spent."""
        window.train = time.time()
        while not arrival.done() and window.steps < self.config.max_micro_steps:
            t0 = time.perf_counter()
            window.stats = self.drafter_trainer.micro_step(self.buffer.sample(self.batch_sequences,
                                                                              self.config.micro_step_pairs))
            window.micro.append(time.perf_counter() - t0)
            window.steps += 1
            arrival.check("finished their rollout")
        window.stop = time.time()
        clock.span("training", window.train, window.stop)

    def sync(self, steps: int, version: int) -> None:
        """Average the drafters (trainable tensors and AdamW moments) over the workers, weighted by the ``steps``
        each trained; the drafter's version becomes ``version + 1`` (nothing changes when no worker trained)."""
        if self.drafter_trainer is None:
            return
        drafter, opt = self.drafter_trainer.drafter, self.drafter_trainer.opt
        params = opt.master_weights()              # float32 masters of a bf16 drafter: merged, then rounded into it
        weight = torch.tensor([float(steps), float(self.drafter_trainer.steps_done)], dtype=torch.float64)
        self.world.all_reduce(weight[:1])
        self.world.all_reduce(weight[1:], op="max")
        total, steps_done = float(weight[0]), int(weight[1])
        if total == 0:
            return
        share = steps / total
        moments = []
        for p in params:
            st = opt.state[p]
            if "exp_avg" not in st:
                st.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            moments += [st["exp_avg"], st["exp_avg_sq"]]
        tensors = [p.data for p in params] + moments
        for t in tensors:
            t.mul_(share)
        self.world.all_reduce_flat(tensors)
        for p in params:
            opt.state[p]["step"].fill_(float(steps_done))
        opt.push()
        self.drafter_trainer.steps_done = steps_done
        drafter.version = version + 1

    def _exchange_pairs(self, rl_step: int) -> None:
        """Give every worker the pairs the others streamed in this RL step (``train_on: all``)."""
        parts = self.world.gather_objects(self.buffer.export_step(rl_step))
        for r, part in enumerate(parts):
            if r != self.world.rank:
                self.buffer.ingest(part)

    def metrics(self, window: SpotWindow, clock) -> dict:
        """``sched/*`` of the step from every worker's window and spans (an ``update`` span is added first: from the
        end of the rollout, training and sync until now)."""
        after = max(b for name, a, b in clock.spans if name in ("rollout", "training", "sync"))
        spans = [("update", after, time.time()), *clock.spans]
        return schedule_metrics(self.world.gather_objects(window.record(self.world.rank, spans)))


def schedule_metrics(workers: list[dict]) -> dict:
    """``sched/*`` metrics of one step from every worker's record (``start``, ``end``: its rollout;
    ``train``/``stop``: its training window or None; ``micro``: micro-step seconds; ``sync_s``; ``events``: (phase,
    t0, t1) wall-clock spans). Times in the timeline are relative to the earliest rollout start."""
    last = max(w["end"] for w in workers)
    t0 = min(w["start"] for w in workers)
    busy = sum(w["end"] - w["start"] for w in workers)
    idle = sum(last - w["end"] for w in workers)
    trained = sum(max(0.0, min(w["stop"], last) - max(w["train"], w["end"])) for w in workers if w.get("train"))
    preempt = [max(0.0, w["stop"] - last) for w in workers if w.get("train") and w["steps"]]
    # the micro-step that was running when the last rollout ended: the preemption latency is measured in it
    cut = [max(0.0, w["stop"] - last) / w["micro"][-1] for w in workers if w.get("train") and w["steps"]]
    signal = [w["signal_s"] for w in workers if w.get("signal_s") is not None]
    micro = [x for w in workers for x in w["micro"]]
    sync = max(w["sync_s"] for w in workers)
    # what the spot trainer adds to the critical path: from the last rollout's end until every worker has the merged
    # drafter (signal, the interrupted micro-step, the sync); without it the workers would go on at the last end
    synced = [b for w in workers for name, a, b in w["events"] if name == "sync"]
    overhead = max(0.0, max(synced) - last) if synced else 0.0
    return {"sched/workers": float(len(workers)), "sched/rollout_worker_s": busy + idle,
            "sched/idle_s": idle, "sched/idle_frac": idle / max(busy + idle, 1e-9),
            "sched/train_s": trained, "sched/harvested": trained / idle if idle > 0 else float("nan"),
            "sched/micro_steps": float(sum(w["steps"] for w in workers)),
            "sched/micro_step_s": float(np.median(micro)) if micro else float("nan"),
            "sched/preempt_s": max(preempt) if preempt else 0.0,
            "sched/preempt_micro_steps": max(cut) if cut else 0.0,
            "sched/signal_s": max(signal) if signal else float("nan"), "sched/sync_s": sync,
            "sched/overhead_s": overhead,
            "sched/timeline": [[(name, a - t0, b - t0) for name, a, b in w["events"]] for w in workers]}
