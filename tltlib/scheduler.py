"""Idle-time drafter training on data-parallel rollout workers (torch.distributed, launched by torchrun).

W workers (``torchrun --nproc-per-node W``; multi-node with torchrun's usual ``--nnodes/--rdzv-*`` flags) each hold
the whole policy and drafter. One RL step:

1. **Rollout, sharded by GRPO group.** Every rank draws the same prompts (the prompt sampler is seeded alike) and
   rolls out its contiguous share of whole groups, with its own sampling generator (seed + rank).
2. **Spot trainer.** A rank whose rollout is over goes BUSY -> IDLE -> TRAINING: it runs drafter micro-steps on its
   pair buffer until the *last* rank's rollout ends. The end of the rollout is one asynchronous all-reduce on a gloo
   control group that each rank joins when its own rollout is over (it completes when the last one joins);
   preemption is checked between micro-steps, so training stops at most one micro-step after the last rollout.
3. **Drafter sync.** The ranks' drafters (trainable tensors only, never the target's embedding or head) and their
   AdamW moments are averaged, weighted by the micro-steps each rank ran (one trainer: its weights are broadcast);
   every rank then holds the same drafter, whose ``version`` moves by one.
4. **Rewards, advantages, update.** Rewards are all-gathered so that advantages, loss normalisation (completions
   and tokens of the whole batch) and the ``rl/*`` metrics are those of the whole batch (``rollout/*``, ``spec/*``,
   ``update/*``, ``drafter/*`` and ``time/*`` are rank 0's; its ``time/rollout_s`` includes the idle window and the
   sync); the policy's gradients are summed by all-reduce (fp32 buckets); every rank applies the same AdamW step,
   so all ranks hold identical weights (:meth:`weights_digest`).
5. **Timeline.** Per rank: rollout, idle, training, sync, update; gathered on rank 0 into ``sched/*`` metrics
   (idle share, harvested share = training time inside the idle window / idle time, preemption latency, sync time).

A rank that stops reporting is named: the rollout-end signal and the update wait at most
``SchedulerConfig.hang_timeout_s`` and then raise, naming the ranks that have not arrived (each rank also sends
its arrival to every other one point to point, so the missing ones are known). A killed rank makes torchrun stop
the group; with ``--max-restarts`` the job restarts and resumes from its last checkpoint (:mod:`tltlib.rljob`),
where every rank's own state (sampling generator, pair buffer, tuner) is saved beside the shared one.

Several nodes: checkpoints are written by every rank into the output folder's parent and moved by rank 0, so the
output folder must be on a filesystem all nodes share; ``sched/*`` latencies compare wall clocks across ranks, so
they assume clocks synchronised well below the latencies (NTP: about a millisecond).

Paper: TLT §5 (spot trainer on idle workers, BUSY -> IDLE -> TRAINING, preemptible; the drafter update reaches every
rollout worker). Reference: ``worker_manager.py`` (ZMQ coordinator; stops almost at once; replicas never synced).
Departures:
1. With W = 1 there is no idle worker: the drafter trains after the update, as in :mod:`tltlib.trainer`.
2. The drafters of several trainers are merged by step-weighted averaging of weights and AdamW moments (local SGD),
   not gradient all-reduce: the trainers start and stop at different times, so they cannot step together.
3. A resumed run is bit-identical when the rollout does not use the drafter (``speculative: off``); with SD on,
   the number of spot micro-steps depends on timing, so the drafter, and through it the random draws, differ (the
   output distribution does not: SD is exact).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .trainer import GRPOTrainer

PAIR_MODES = ("own", "all")
GRACE_S = 0.005
"""How long a rank whose rollout just ended listens for the others' arrivals before it starts training."""
MARGIN_S = 10.0
"""Collectives time out this long after the named arrival timeout (a failing rank exits after at most this)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Data-parallel workers and their spot trainer."""

    spot_trainer: bool = True
    """Train the drafter on workers whose rollout is over, until the last one ends (False: after the update)."""
    max_micro_steps: int = 200
    """Most drafter micro-steps one worker runs in one idle window (the spot trainer's budget)."""
    pairs: str = "own"
    """The spot trainer's data: ``"own"`` (this worker's rollouts) or ``"all"`` (the step's pairs of every worker are
    exchanged after the rollout, so each buffer holds every worker's earlier steps plus its own current one)."""
    micro_step_pairs: int = 1024
    """Most (hidden, token) pairs in one spot-trainer micro-step (at least one sequence): bounds a micro-step's
    time and so the preemption latency (0 = the one-process batch, ``tlt.drafter_batch`` sequences)."""
    hang_timeout_s: float = 1800.0
    """A rank that has not finished its rollout (or reached the update) this long after the others is named in an
    error and the job stops (torchrun restarts it with ``--max-restarts``)."""

    def __post_init__(self):
        if self.pairs not in PAIR_MODES:
            raise ValueError(f"scheduler.pairs must be one of {PAIR_MODES}, got {self.pairs!r}")
        if self.spot_trainer and self.max_micro_steps < 1:
            raise ValueError(f"the spot trainer is on but its budget max_micro_steps is {self.max_micro_steps}: give "
                             "it >= 1 micro-step per idle window, or set spot_trainer: false")
        if self.micro_step_pairs < 0:
            raise ValueError(f"micro_step_pairs must be >= 0 (0 = no bound), got {self.micro_step_pairs}")
        if not self.hang_timeout_s > 0:
            raise ValueError(f"hang_timeout_s must be > 0 seconds, got {self.hang_timeout_s}")


# ------------------------------------------------------------------------------------------------ process group
def launched_by_torchrun() -> bool:
    """True inside a process started by torchrun (or any launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_command(workers: int, args: list[str], max_restarts: int = 0, python: str | None = None) -> list[str]:
    """The command that runs ``python -m tltlib ARGS`` as ``workers`` processes on this node under torchrun
    (``--standalone``: a local rendezvous; for several nodes call torchrun yourself with ``--nnodes`` and
    ``--rdzv-endpoint``)."""
    import sys
    if workers < 1 or max_restarts < 0:
        raise ValueError(f"workers must be >= 1 and max_restarts >= 0, got {workers} and {max_restarts}")
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
            f"--max-restarts={max_restarts}", "-m", "tltlib", *args]


def launch(params: str | os.PathLike, workers: int, output_dir: str | os.PathLike, max_restarts: int = 0,
           extra: tuple = (), progress: bool = True, timeout_s: float | None = None) -> Path:
    """Run ``train-grpo --params PARAMS`` on ``workers`` torchrun processes and wait for it (a notebook's way to
    start a job), with a progress bar over the RL steps; returns ``output_dir``. Raises with the end of the workers'
    output when the job fails."""
    import signal
    import subprocess
    import tempfile
    import threading

    from tqdm.auto import tqdm
    cmd = torchrun_command(workers, ["train-grpo", "--params", str(params), "--output-dir", str(output_dir),
                                     "--quiet", *extra], max_restarts)
    env = {**os.environ, "TLTLIB_NO_VENV": "1"}
    bar = tqdm(desc=f"GRPO steps on {workers} workers", unit="step", disable=not progress)
    with tempfile.TemporaryFile("w+") as err:
        # its own session, so that a timeout or an interrupt stops torchrun and every worker it started
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        timer = None
        if timeout_s is not None:
            timer = threading.Timer(timeout_s, lambda: os.killpg(proc.pid, signal.SIGTERM))
            timer.start()
        try:
            for line in proc.stdout:
                if line.startswith("{"):
                    m = json.loads(line)
                    bar.update(1)
                    bar.set_postfix(step_s=f"{m['time/step_s']:.1f}", idle=f"{m.get('sched/idle_frac', 0):.0%}",
                                    harvested=f"{m.get('sched/harvested', float('nan')):.0%}")
            rc = proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGTERM)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        bar.close()
        if rc != 0:
            err.seek(0)
            lines = [x for x in err.read().splitlines() if x.strip() and not x.startswith(("W", "*"))]
            errors = [x for x in lines if x.startswith("error:") or "Error" in x]
            raise RuntimeError(f"the {workers}-worker job failed (exit {rc}): {' '.join(cmd)}\n"
                               + "\n".join((errors or lines)[-8:]))
    return Path(output_dir)


def write_job_params(path: str | os.PathLike, model: str, drafter: str, grpo: dict, tlt: dict | None,
                     scheduler: dict, device: str = "auto", dtype: str = "float32", train_problems: int = 4096,
                     eval_problems: int = 128, eval_steps: int = 0) -> Path:
    """Write a train-grpo parameter file (checked by reading it back: a bad value fails here, not in the workers)."""
    import yaml

    from .fileio import atomic_write_text
    from .rljob import read_job
    d = {"model": str(model), "drafter": str(drafter), "device": device, "dtype": dtype,
         "train_problems": train_problems, "eval_problems": eval_problems, "eval_steps": eval_steps,
         "grpo": dict(grpo), "tlt": None if tlt is None else dict(tlt), "scheduler": dict(scheduler)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, yaml.safe_dump(d, sort_keys=False))
    read_job(path)
    return path


def shard(num_prompts: int, world: int, rank: int) -> slice:
    """The contiguous prompts (whole GRPO groups) of ``rank``; refuses a world that cannot split them evenly."""
    if world > num_prompts:
        raise ValueError(f"{world} workers but only {num_prompts} prompts per step: every worker needs at least one "
                         "prompt (a whole GRPO group); use fewer workers (--nproc-per-node) or raise "
                         "generation_batch_size")
    if num_prompts % world:
        ok = [w for w in range(1, num_prompts + 1) if num_prompts % w == 0]
        raise ValueError(f"world size {world} does not divide the {num_prompts} prompts (GRPO groups) of a step: "
                         f"each worker rolls out whole groups, equally many; use {ok} workers, or change "
                         "generation_batch_size / num_generations")
    k = num_prompts // world
    return slice(rank * k, (rank + 1) * k)


class Workers:
    """This process's place in the group: rank, world size, device, and the collectives the trainer needs.

    Data (gradients, drafter weights) go over the default group (gloo on CPU, nccl on CUDA); small control messages
    (arrivals, metrics, timelines) over a gloo group, on CPU tensors."""

    def __init__(self, device: str = "auto", timeout_s: float = 1800.0):
        if not launched_by_torchrun():
            raise RuntimeError("not launched by torchrun: start the job with torchrun --nproc-per-node W ... (or "
                               "python -m tltlib train-grpo --workers W)")
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        if cuda:
            n = torch.cuda.device_count()
            self.device = f"cuda:{self.local_rank % max(n, 1)}"
            torch.cuda.set_device(self.device)
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            backend = "nccl" if n >= local_world else "gloo"     # nccl needs a GPU of its own per rank
        else:
            self.device, backend = "cpu", "gloo"
        if not dist.is_initialized():
            # torchrun's store outlives a restarted group (--max-restarts); the keys of each attempt go under a
            # prefix of their own, or the new ranks would read the dead ones' addresses
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                  int(os.environ.get("MASTER_PORT", 29500)), self.world,
                                  is_master=not agent and self.rank == 0,
                                  timeout=timedelta(seconds=timeout_s + MARGIN_S))
            # collectives time out MARGIN_S after the arrivals do, so a hang is reported by name (Arrival) first
            dist.init_process_group(backend, store=dist.PrefixStore(f"tltlib/attempt-{attempt}", store),
                                    rank=self.rank, world_size=self.world,
                                    timeout=timedelta(seconds=timeout_s + MARGIN_S),
                                    device_id=torch.device(self.device) if backend == "nccl" else None)
        self.ctrl = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s + MARGIN_S))
        self.timeout_s = timeout_s

    def gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """[n, k] on every rank (same n) -> [W n, k], rank order (CPU, control group)."""
        rows = rows.detach().cpu().contiguous()
        parts = [torch.empty_like(rows) for _ in range(self.world)]
        dist.all_gather(parts, rows, group=self.ctrl)
        return torch.cat(parts)

    def gather_objects(self, obj) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

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
            raise ValueError(f"rank(s) {bad} were started with another {what} than rank 0 (hash {digests[bad[0]]} vs "
                             f"{digests[0]}): every worker must get the same parameter file, model and data")

    def arrive(self, tag: int, value: float) -> "Arrival":
        return Arrival(self, tag, value)


class Arrival:
    """Every rank reports ``value`` (e.g. its rollout end time); :meth:`done` polls whether all ranks have,
    :meth:`wait` blocks until they have or names the missing ranks after the timeout."""

    def __init__(self, workers: Workers, tag: int, value: float):
        self.w, self.t0 = workers, time.time()
        W, r = workers.world, workers.rank
        self.values = torch.zeros(W, dtype=torch.float64)
        self.values[r] = value
        self._work = dist.all_reduce(self.values, group=workers.ctrl, async_op=True)
        # point to point copies, read only to name the ranks missing after a timeout
        self._seen = {s: torch.full((1,), float("nan"), dtype=torch.float64) for s in range(W) if s != r}
        self._recv = [dist.irecv(b, src=s, group=workers.ctrl, tag=tag) for s, b in self._seen.items()]
        msg = torch.tensor([value], dtype=torch.float64)
        self._send = [dist.isend(msg, dst=s, group=workers.ctrl, tag=tag) for s in self._seen]

    def done(self) -> bool:
        return self._work.is_completed()

    def missing(self) -> list[int]:
        return [s for s, b in self._seen.items() if math.isnan(float(b[0]))]

    def check(self, what: str) -> None:
        if time.time() - self.t0 > self.w.timeout_s and not self.done():
            raise TimeoutError(f"rank {self.w.rank}: rank(s) {self.missing()} have not {what} {self.w.timeout_s:.0f} "
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


# ---------------------------------------------------------------------------------------------------- trainer
class DistributedGRPOTrainer(GRPOTrainer):
    """:class:`~tltlib.trainer.GRPOTrainer` as one of W data-parallel workers with the spot trainer.

    Args: as :class:`~tltlib.trainer.GRPOTrainer`, plus ``scheduler`` (:class:`SchedulerConfig`) and ``workers``
    (:class:`Workers`; made from torchrun's environment when None). ``model`` must already be on ``workers.device``.
    """

    def __init__(self, model, tokenizer, problems, args, reward_funcs=None, drafter=None, tlt=None,
                 progress: bool = False, scheduler: SchedulerConfig | None = None, workers: Workers | None = None):
        from .grpo import accuracy_reward
        self.sched = scheduler or SchedulerConfig()
        self.workers = workers or Workers(str(model.device), self.sched.hang_timeout_s)
        W, r = self.workers.world, self.workers.rank
        if tlt is not None and self.sched.spot_trainer and tlt.online_drafter and tlt.drafter_steps < 1 and W == 1:
            raise ValueError("the spot trainer is on with one worker, where it trains tlt.drafter_steps micro-steps "
                             "after the update, but drafter_steps is 0: give drafter_steps >= 1 or spot_trainer: false")
        super().__init__(model, tokenizer, problems, args, reward_funcs or (accuracy_reward,), drafter, tlt,
                         progress and r == 0)
        self.slice = shard(args.prompts_per_step, W, r)
        self.generator.manual_seed(args.seed + 7919 * r)       # rank 0 samples as the one-process trainer
        if self.buffer is not None:
            self.buffer.rng = np.random.default_rng(args.seed + 7919 * r)
        if self.drafter is not None:
            target = {t.data_ptr() for t in model.parameters()}
            shared = [n for n, p in self.drafter.named_parameters() if p.data_ptr() in target]
            if shared:
                raise ValueError(f"drafter parameters {shared} share storage with the target: they would be synced "
                                 "and trained as the drafter's; keep the target's tensors out of the drafter's "
                                 "parameters")
        self.workers.check_same("configuration", {"fingerprint": self.fingerprint(), "scheduler": asdict(self.sched),
                                                  "max_steps": args.max_steps, "save_steps": args.save_steps,
                                                  "problems": [p.prompt for p in self.problems[:64]]})
        self._sched: dict = {}
        self._tag = 0                                  # point-to-point tags of the arrivals

    # ------------------------------------------------------------------------------------------ overrides
    def fingerprint(self) -> dict:
        """As the one-process trainer's, plus the world size (each rank's state is saved: W is fixed for a run) and
        the scheduler settings that change what is trained (budgets and timeouts may change on resume)."""
        return {**super().fingerprint(), "world": self.workers.world,
                "scheduler": {"spot_trainer": self.sched.spot_trainer, "pairs": self.sched.pairs}}

    def _spot(self) -> bool:
        return self.sched.spot_trainer and self.workers.world > 1

    def _trains_drafter(self) -> bool:
        # with the spot trainer on several workers the budget is the idle window (tlt.drafter_steps is not used)
        return self._spot() or super()._trains_drafter()

    def _next_problems(self) -> list:
        return super()._next_problems()[self.slice]

    def _shard_offset(self, n: int) -> int:
        return self.workers.rank * n

    def _arrive(self, value: float) -> Arrival:
        self._tag += 1                             # the same sequence of tags on every rank
        return self.workers.arrive(self._tag, value)

    def _meet(self, what: str) -> None:
        """Wait for every rank to get here, naming the ones that do not within ``hang_timeout_s``."""
        self._arrive(time.time()).wait(what)

    def _gather_rows(self, rows):
        if self.workers.world == 1:
            return rows
        self._meet("reached the all-gather of rewards and statistics")
        return self.workers.gather_rows(rows)

    def _reduce_gradients(self) -> None:
        if self.workers.world == 1:
            return
        t = time.time()
        self._meet("reached the update's gradient all-reduce")
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:                     # a parameter this rank's batch did not reach: its share is 0
                p.grad = torch.zeros_like(p)
        self.workers.all_reduce_flat([p.grad for p in params])
        self._events.append(("update sync", t, time.time()))

    def _rollout(self, prompt_ids):
        W = self.workers.world
        self._events = []
        t_start = time.time()
        res = super()._rollout(prompt_ids)
        t_end = time.time()
        self._events.append(("rollout", t_start, t_end))
        if W == 1:
            self._sched = {"start": t_start, "end": t_end, "steps": 0, "train": None, "stop": None, "micro": [],
                           "sync_s": 0.0}
            return res
        arrival = self._arrive(t_end)
        version = getattr(self.drafter, "version", 0)
        steps, micro, t_train, t_stop, dstats = 0, [], None, None, {}
        # the last rank to finish must not start a micro-step: it knows it is last when every other rank's
        # arrival has reached it (messages posted before this rank listened take a few ms to land)
        grace = time.time() + GRACE_S
        while arrival.missing() and not arrival.done() and time.time() < grace:
            time.sleep(0.0002)
        spot = (self._spot() and self.drafter_trainer is not None and arrival.missing()
                and not arrival.done() and self.buffer.sequences())
        if spot:
            t_train = time.time()
            while not arrival.done() and steps < self.sched.max_micro_steps:
                t0 = time.perf_counter()
                dstats = self.drafter_trainer.step(self.buffer.sample(self.tlt.drafter_batch,
                                                                      self.sched.micro_step_pairs))
                micro.append(time.perf_counter() - t0)
                steps += 1
                arrival.check("finished their rollout")
            t_stop = time.time()
            self._events.append(("training", t_train, t_stop))
        ends = arrival.wait("finished their rollout")
        t_seen = time.time()
        last_end = float(ends.max())
        t0 = time.time()
        if self.sched.spot_trainer:
            self._sync_drafter(steps, version)
        if self.sched.pairs == "all" and self.buffer is not None:
            self._exchange_pairs()
        t1 = time.time()
        self._events.append(("sync", t0, t1))
        self._sched = {"start": t_start, "end": t_end, "steps": steps, "train": t_train,
                       "stop": t_stop, "micro": micro, "sync_s": t1 - t0, "dstats": dstats,
                       "signal_s": t_seen - last_end if not steps else None}
        return res

    def _train_drafter(self) -> dict:
        if not self._spot():
            version = getattr(self.drafter, "version", 0)
            t = time.time()
            dstats = super()._train_drafter()
            if self.workers.world > 1 and self.drafter_trainer is not None:
                self._sync_drafter(self.tlt.drafter_steps if self.buffer.sequences() else 0, version)
            self._events.append(("drafter", t, time.time()))
            return dstats
        return self._sched.get("dstats", {})

    # ---------------------------------------------------------------------------------------------- sync
    def _sync_drafter(self, steps: int, version: int) -> None:
        """Average the drafters (trainable tensors and AdamW moments) over the ranks, weighted by ``steps``."""
        if self.drafter_trainer is None:
            return
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        opt = self.drafter_trainer.opt
        weight = torch.tensor([float(steps), float(self.drafter_trainer.steps_done)], dtype=torch.float64)
        dist.all_reduce(weight[:1], group=self.workers.ctrl)
        dist.all_reduce(weight[1:], op=dist.ReduceOp.MAX, group=self.workers.ctrl)
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
        self.workers.all_reduce_flat(tensors)
        for p in params:
            opt.state[p]["step"].fill_(float(steps_done))
        self.drafter_trainer.steps_done = steps_done
        self.drafter.version = version + 1

    def _exchange_pairs(self) -> None:
        """Give every rank the pairs the others streamed in this step (``scheduler.pairs = "all"``)."""
        parts = self.workers.gather_objects(self.buffer.export_step(self.step_count))
        for r, part in enumerate(parts):
            if r != self.workers.rank:
                self.buffer.ingest(part)

    # ------------------------------------------------------------------------------------------- metrics
    def _extra_metrics(self) -> dict:
        s = self._sched
        after = max(b for name, a, b in self._events if name in ("rollout", "training", "sync"))
        self._events.insert(0, ("update", after, time.time()))     # rewards, log-probs, update (drawn first)
        mine = {"rank": self.workers.rank, "events": self._events, **{k: v for k, v in s.items() if k != "dstats"}}
        every = self.workers.gather_objects(mine) if self.workers.world > 1 else [mine]
        return schedule_metrics(every)

    def evaluate(self, problems, strategy: str | None = "chain-8") -> dict:
        """Held-out greedy accuracy, each rank evaluating its share of ``problems``."""
        W, r = self.workers.world, self.workers.rank
        mine = problems[r::W]
        m = super().evaluate(mine, strategy) if mine else {"eval/accuracy": 0.0, "eval/len_mean": 0.0}
        parts = self.workers.gather_objects((len(mine), m)) if W > 1 else [(len(mine), m)]
        n = sum(k for k, _ in parts)
        return {key: sum(k * d[key] for k, d in parts) / max(n, 1) for key in ("eval/accuracy", "eval/len_mean")}

    def weights_digest(self) -> str:
        """sha256 of the policy's weights (equal on every rank after every step)."""
        h = hashlib.sha256()
        for k, v in sorted(self.model.state_dict().items()):
            h.update(k.encode())
            h.update(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    # ---------------------------------------------------------------------------------------- checkpoint
    def _rank_state(self) -> dict:
        return {"generator": self.generator.get_state(),
                "buffer": self.buffer.state_dict() if self.buffer is not None else None,
                "controller": self.controller.state_dict() if self.controller is not None else None}

    def save(self, path) -> Path:
        """Every rank's own state (sampling generator, pair buffer, tuner) goes beside the shared checkpoint."""
        path = Path(path).resolve()
        W, r = self.workers.world, self.workers.rank
        if W == 1:
            return super().save(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.parent / f".{path.name}-rank{r}-step{self.step_count}.pt"
        tmp = staged.with_name(staged.name + ".part")
        torch.save(self._rank_state(), tmp)
        tmp.replace(staged)
        self.workers.barrier()
        if r == 0:
            self._staged = [path.parent / f".{path.name}-rank{k}-step{self.step_count}.pt" for k in range(W)]
            super().save(path)
        self.workers.barrier()
        return path

    def _save_extra(self, folder: Path) -> None:
        for k, f in enumerate(getattr(self, "_staged", [])):
            f.replace(folder / f"rank{k}.pt")

    def load(self, path) -> "DistributedGRPOTrainer":
        super().load(path)
        if self.workers.world > 1:
            f = Path(path) / f"rank{self.workers.rank}.pt"
            st = torch.load(f, map_location="cpu", weights_only=False)
            self.generator.set_state(st["generator"])
            if self.buffer is not None:
                self.buffer.load_state_dict(st["buffer"])
            if self.controller is not None:
                self.controller.load_state_dict(st["controller"])
        return self


def schedule_metrics(workers: list[dict]) -> dict:
    """``sched/*`` metrics of one step from every rank's record (``start``, ``end``: its rollout; ``train``/``stop``:
    its training window or None; ``micro``: micro-step seconds; ``sync_s``; ``events``: (phase, t0, t1) wall-clock
    spans). Times in the timeline are relative to the earliest rollout start."""
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
    # what the spot trainer adds to the critical path: from the last rollout's end until every rank has the merged
    # drafter (signal, the interrupted micro-step, the sync); without it the ranks would go on at the last end
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
