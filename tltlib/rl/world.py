"""Where an RL step runs: one process (:class:`World`) or one of W data-parallel workers under torchrun
(:class:`DistributedWorld`). The trainer never branches on distribution; it asks its world.

What a world does for the trainer (one process: the identity):

* :meth:`~World.shard` — the contiguous prompts (whole GRPO groups) this worker rolls out;
* :meth:`~World.gather` — per-completion tensors of every worker, concatenated in rank order (one collective);
* :meth:`~World.sum_gradients` — the gradients summed over the workers (fp32 buckets);
* :meth:`~World.arrive` — a non-blocking report (e.g. "my rollout ended at t") that completes when every worker
  has reported, and names the missing ones after a timeout (the spot trainer polls it between micro-steps);
* :meth:`~World.gather_objects`, :meth:`~World.average`, :meth:`~World.barrier`, :meth:`~World.check_same`.

:class:`DistributedWorld` uses torch.distributed as torchrun starts it: data (gradients, drafter weights) over the
default group (gloo on CPU, nccl on CUDA: a GPU per worker, more workers than GPUs refused before any starts,
:func:`check_one_gpu_per_worker`), small control messages (arrivals, metrics, timelines) over a gloo group on CPU
tensors. A collective that a worker never reaches is reported by name: before each one the workers *meet*
(everyone arrives, each arrival also sent point to point), and a worker still missing ``timeout_s`` after the others
is named in a TimeoutError; the collectives themselves time out ``MARGIN_S`` later.

Paper: TLT §5 (rollout workers, data-parallel RL). Departures: none (plumbing; torch.distributed, no own transport).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import BadInput, Refused, TimedOut

MARGIN_S = 10.0
"""Collectives time out this long after the named arrival timeout (a failing rank exits after at most this)."""


def launched_by_torchrun() -> bool:
    """True inside a process started by torchrun (or any launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_command(workers: int, args: list[str], max_restarts: int = 0, python: str | None = None) -> list[str]:
    """The command that runs ``python -m tltlib ARGS`` as ``workers`` processes on this node under torchrun
    (``--standalone``: a local rendezvous; for several nodes call torchrun yourself with ``--nnodes`` and
    ``--rdzv-endpoint``)."""
    if workers < 1 or max_restarts < 0:
        raise BadInput(f"workers must be >= 1 and max_restarts >= 0, got {workers} and {max_restarts}")
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
            f"--max-restarts={max_restarts}", "-m", "tltlib", *args]


def check_one_gpu_per_worker(workers: int, device: str) -> None:
    """Refuse ``workers`` data-parallel workers on this node before any starts when ``device`` is CUDA (``cuda``,
    ``cuda:N``, or ``auto`` with a GPU here) and the node has fewer GPUs than workers: each worker takes a GPU of
    its own (nccl); two on one GPU would put CUDA tensors through gloo and share the GPU's time and memory."""
    cuda = str(device).startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if not cuda:
        return
    gpus = torch.cuda.device_count()
    if workers > gpus:
        s = "s" * (gpus != 1)
        raise BadInput(f"{workers} data-parallel workers on device {device!r} but this node has {gpus} GPU{s}: each "
                       f"worker needs a GPU of its own; give at most {gpus} worker{s} "
                       f"(WORKERS / --workers / --nproc-per-node <= {gpus}), or run the workers on the CPU "
                       "(device: cpu in the job, DEVICE: cpu in the notebooks' parameters, --device cpu)")


def shard(num_prompts: int, world: int, rank: int) -> slice:
    """The contiguous prompts (whole GRPO groups) of ``rank``; refuses a world that cannot split them evenly."""
    if world > num_prompts:
        raise BadInput(f"{world} workers but only {num_prompts} prompts per step: every worker needs at least one "
                       "prompt (a whole GRPO group); use fewer workers (--nproc-per-node) or raise "
                       "generation_batch_size")
    if num_prompts % world:
        ok = [w for w in range(1, num_prompts + 1) if num_prompts % w == 0]
        raise BadInput(f"world size {world} does not divide the {num_prompts} prompts (GRPO groups) of a step: "
                       f"each worker rolls out whole groups, equally many; use {ok} workers, or change "
                       "generation_batch_size / num_generations")
    k = num_prompts // world
    return slice(rank * k, (rank + 1) * k)


class World:
    """One process: rank 0 of 1. Gathers return their input, reductions do nothing, arrivals complete at once."""

    rank = 0
    size = 1
    distributed = False
    """False: the trainer reports no ``sched/*`` metrics (there are no other workers to wait for)."""

    def __init__(self, device: str = "cpu"):
        self.device = device

    def shard(self, num_prompts: int) -> slice:
        """This worker's prompts of a step (whole GRPO groups)."""
        return shard(num_prompts, self.size, self.rank)

    def gather(self, fields: dict[str, torch.Tensor], what: str = "") -> dict[str, torch.Tensor]:
        """``{name: [n, ...]}`` of this worker -> ``{name: [W n, ...]}`` in rank order (same dtypes)."""
        return fields

    def sum_gradients(self, params: list[torch.Tensor], what: str = "") -> None:
        """Sum the gradients of ``params`` over the workers, in place."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """``sum`` or ``max`` of a small CPU tensor over the workers, in place (control messages)."""

    def all_reduce_flat(self, tensors: list[torch.Tensor]) -> None:
        """Sum ``tensors`` (weights, optimizer moments, gradients) over the workers, in place."""

    def arrive(self, value: float) -> "Arrival":
        """Report ``value`` to every worker without waiting (see :class:`Arrival`)."""
        return Arrival(self, value)

    def gather_objects(self, obj) -> list:
        return [obj]

    def average(self, values: dict[str, float], weight: float) -> dict[str, float]:
        """The ``weight``-weighted mean of ``values`` over the workers."""
        return values

    def barrier(self) -> None:
        pass

    def check_same(self, what: str, value) -> None:
        """Refuse to start when workers were given different ``value``."""

    def close(self) -> None:
        pass


class Arrival:
    """Every worker reports ``value`` (e.g. its rollout end time); :meth:`done` polls whether all have, :meth:`wait`
    blocks until they have (or names the missing ones after the world's timeout) and returns the ``[W]`` values.
    One process: done at once."""

    def __init__(self, world: World, value: float):
        self.values = torch.tensor([value], dtype=torch.float64)

    def done(self) -> bool:
        return True

    def missing(self) -> list[int]:
        return []

    def check(self, what: str) -> None:
        pass

    def wait(self, what: str) -> torch.Tensor:
        return self.values


class DistributedWorld(World):
    """This process as one of the W workers torchrun started (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    Args:
        device: ``auto``/``cpu``/``cuda``: with CUDA each rank takes GPU ``LOCAL_RANK`` and nccl carries the data;
            fewer GPUs than local ranks is refused (:func:`check_one_gpu_per_worker`).
        timeout_s: how long a worker waits for the others at a meeting point before naming them in an error.
    """

    distributed = True

    def __init__(self, device: str = "auto", timeout_s: float = 1800.0):
        if not launched_by_torchrun():
            raise Refused("not launched by torchrun: start the job with torchrun --nproc-per-node W ... (or "
                          "python -m tltlib train-grpo --workers W)")
        self.rank, self.size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        check_one_gpu_per_worker(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), device)   # before any collective
        if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
            self.device, backend = f"cuda:{self.local_rank}", "nccl"      # a GPU of its own per rank
            torch.cuda.set_device(self.device)
        else:
            self.device, backend = "cpu", "gloo"
        if not dist.is_initialized():
            # torchrun's store outlives a restarted group (--max-restarts); the keys of each attempt go under a
            # prefix of their own, or the new ranks would read the dead ones' addresses
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                  int(os.environ.get("MASTER_PORT", 29500)), self.size,
                                  is_master=not agent and self.rank == 0,
                                  timeout=timedelta(seconds=timeout_s + MARGIN_S))
            # collectives time out MARGIN_S after the arrivals do, so a hang is reported by name (Arrival) first
            dist.init_process_group(backend, store=dist.PrefixStore(f"tltlib/attempt-{attempt}", store),
                                    rank=self.rank, world_size=self.size,
                                    timeout=timedelta(seconds=timeout_s + MARGIN_S),
                                    device_id=torch.device(self.device) if backend == "nccl" else None)
        self.ctrl = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s + MARGIN_S))
        self.timeout_s = timeout_s
        self._tag = 0                              # arrival tags: the same sequence on every rank

    # --------------------------------------------------------------------------------------------- collectives
    def gather(self, fields: dict[str, torch.Tensor], what: str = "reached the all-gather") -> dict[str, torch.Tensor]:
        """All fields in one all-gather of float64 columns (exact for the rewards, lengths and flags it carries),
        after the workers meet (a missing one is named)."""
        self.meet(what)
        cols = [t.detach().cpu().reshape(t.shape[0], -1).double() for t in fields.values()]
        rows = torch.cat(cols, 1).contiguous()
        parts = [torch.empty_like(rows) for _ in range(self.size)]
        dist.all_gather(parts, rows, group=self.ctrl)
        whole, out, c = torch.cat(parts), {}, 0
        for (name, t), col in zip(fields.items(), cols):
            out[name] = whole[:, c: c + col.shape[1]].reshape(-1, *t.shape[1:]).to(t.dtype)
            c += col.shape[1]
        return out

    def sum_gradients(self, params: list[torch.Tensor], what: str = "reached the gradient all-reduce") -> None:
        """A parameter this worker's batch did not reach contributes a zero gradient."""
        self.meet(what)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.all_reduce_flat([p.grad for p in params])

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=self.ctrl)

    def all_reduce_flat(self, tensors: list[torch.Tensor], bucket: int = 1 << 25) -> None:
        """Sum ``tensors`` over the ranks in place: flat fp32 buckets of at most ``bucket`` elements (few
        collectives, bounded extra memory, no bf16 rounding in the sum)."""
        buckets, size = [[]], 0
        for t in tensors:
            if buckets[-1] and size + t.numel() > bucket:
                buckets.append([])
                size = 0
            buckets[-1].append(t)
            size += t.numel()
        for group in buckets:
            if not group:
                continue
            flat = torch.cat([g.reshape(-1).float() for g in group])
            dist.all_reduce(flat)
            for g, part in zip(group, flat.split([g.numel() for g in group])):
                g.copy_(part.view_as(g))

    def gather_objects(self, obj) -> list:
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    def average(self, values: dict[str, float], weight: float) -> dict[str, float]:
        parts = self.gather_objects((weight, values))
        total = sum(w for w, _ in parts)
        return {k: sum(w * v[k] for w, v in parts) / max(total, 1) for k in values}

    # ------------------------------------------------------------------------------------------ meeting points
    def arrive(self, value: float) -> "DistributedArrival":
        self._tag += 1
        return DistributedArrival(self, self._tag, value)

    def meet(self, what: str) -> None:
        """Wait for every rank to get here, naming the ones that do not within ``timeout_s``."""
        self.arrive(time.time()).wait(what)

    def barrier(self) -> None:
        dist.barrier(group=self.ctrl)

    def close(self) -> None:
        """Leave the group (after a last barrier, so no rank exits while another still talks to it)."""
        if dist.is_initialized():
            self.barrier()
            dist.destroy_process_group()

    def check_same(self, what: str, value) -> None:
        """Refuse to start when ranks were given different ``value`` (compared by a hash), naming the ranks."""
        digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]
        digests = self.gather_objects(digest)
        bad = [r for r, d in enumerate(digests) if d != digests[0]]
        if bad:
            raise BadInput(f"rank(s) {bad} were started with another {what} than rank 0 (hash {digests[bad[0]]} vs "
                           f"{digests[0]}): every worker must get the same parameter file, model and data")


class DistributedArrival(Arrival):
    """:class:`Arrival` over the control group: an asynchronous all-reduce of the ``[W]`` values (complete when the
    last rank joins), plus point-to-point copies read only to name the missing ranks after a timeout."""

    def __init__(self, world: DistributedWorld, tag: int, value: float):
        self.w, self.t0 = world, time.time()
        W, r = world.size, world.rank
        self.values = torch.zeros(W, dtype=torch.float64)
        self.values[r] = value
        self._work = dist.all_reduce(self.values, group=world.ctrl, async_op=True)
        self._seen = {s: torch.full((1,), float("nan"), dtype=torch.float64) for s in range(W) if s != r}
        self._recv = [dist.irecv(b, src=s, group=world.ctrl, tag=tag) for s, b in self._seen.items()]
        msg = torch.tensor([value], dtype=torch.float64)
        self._send = [dist.isend(msg, dst=s, group=world.ctrl, tag=tag) for s in self._seen]

    def done(self) -> bool:
        return self._work.is_completed()

    def missing(self) -> list[int]:
        return [s for s, b in self._seen.items() if math.isnan(float(b[0]))]

    def check(self, what: str) -> None:
        if time.time() - self.t0 > self.w.timeout_s and not self.done():
            raise TimedOut(f"rank {self.w.rank}: rank(s) {self.missing()} have not {what} {self.w.timeout_s:.0f} "
                           "s after this one (hung or dead?); the job stops (torchrun restarts it from the last "
                           "checkpoint with --max-restarts); raise scheduler.hang_timeout_s if their work is "
                           "that long")

    def wait(self, what: str) -> torch.Tensor:
        while not self.done():
            self.check(what)
            time.sleep(0.0005)
        self._work.wait()
        for w in self._recv + self._send:
            w.wait()
        return self.values
