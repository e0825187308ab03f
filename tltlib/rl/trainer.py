"""The RL step with TLT: rollout (adaptive SD), rewards, GRPO update of the very module the engine decodes with, and
the online drafter trained on the pairs the rollout streamed — in one process or as one of W data-parallel workers.

One :meth:`GRPOTrainer.step` (every phase a method, timed as ``time/<phase>_s``):

1. **rollout** — this worker's share of ``generation_batch_size / num_generations`` prompts, ``num_generations``
   completions each, by the :class:`tltlib.rollout.engine.RolloutEngine` with the adaptive controller (or a fixed
   strategy, or none); the pairs the drafter trains on stream into the :class:`tltlib.drafting.pairs.PairBuffer`. With
   several workers the **spot trainer** (:class:`tltlib.rl.scheduler.SpotTrainer`) then trains the drafter until the
   last worker's rollout ends and merges the workers' drafters (inside this phase's time);
2. **reward** — the reward functions on this worker's completions, gathered into the whole batch
   (:class:`Completions`), then group advantages (:mod:`tltlib.rl.grpo`);
3. **logprob** — no-grad forwards for the reference policy (``beta > 0``) and the old policy (``num_iterations >
   1``), in length-bucketed micro-batches (:mod:`tltlib.model.logprobs`);
4. **update** — ``num_iterations`` AdamW steps, each accumulating the loss over the micro-batches (gradients summed
   over the workers), normalised by the whole batch (:class:`LossStats`);
5. **drafter** — without the spot trainer: ``drafter_steps`` micro-steps on batches sampled from the buffer (older
   RL steps down-weighted), merged over the workers; the drafter's version moves, so the adaptive controller
   re-explores its arms.

Distribution enters only through the trainer's :class:`tltlib.rl.world.World` (one process: gathers return their
input). The step returns one dict of metrics under the vocabulary of :mod:`tltlib.metrics` (``rl/*`` of the whole
batch; ``rollout/*``, ``spec/*``, ``drafter/*``, ``update/*``, ``time/*`` of this worker; ``sched/*`` under torchrun,
a world of one included); :meth:`GRPOTrainer.evaluate` adds ``eval/*``.
:meth:`GRPOTrainer.save` writes everything a bit-identical resume needs (policy, optimizers, drafter, buffer,
controller, RNG states, step; each worker's own state beside it) into one folder atomically;
:meth:`GRPOTrainer.load` refuses a folder from another model or configuration.

Paper: TLT §3 (system overview: rollout with adaptive SD, drafter trained on the rollout's hidden states), §4-5.
Departures:
1. In one process the drafter trains between rollouts (there is no idle worker); its cost is on the step's critical
   path and reported as ``time/drafter_s``.
2. A resumed run is bit-identical only when the strategy choice does not depend on wall-clock time (a fixed
   strategy or none; with several workers also no spot trainer on a drafter the rollout uses); the adaptive
   controller's rewards are timings, so after a resume it makes the same *kind* of decisions, not necessarily the
   same ones (the output distribution is the same either way: SD is lossless).
"""
from __future__ import annotations

import copy
import hashlib
import math
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from ..errors import BadInput, NotFinite
from ..kv.paged import KVConfig
from ..model.drafter import check_separate
from ..model.logprobs import micro_batches, padded_tokens, response_logprobs
from ..model.optimizer import MixedPrecisionAdamW
from ..model.sampling import SamplingConfig
from ..rollout.engine import RolloutConfig, RolloutEngine
from ..rollout.result import RolloutResult
from ..spec.strategy import SpecStrategy
from ..tasks.prompts import encode_prompts
from . import checkpoint, online
from .batch import Completions, LossStats, UpdateBatch
from .clock import StepClock
from .config import TLTConfig
from .curriculum import CurriculumConfig, level_pools, stage, stage_pool
from .drift import DriftGate
from .grpo import (
    GRPOConfig,
    accuracy_reward,
    aggregate_loss,
    clipped_token_loss,
    compute_rewards,
    group_advantages,
    kl_k3,
    reward_name,
)
from .memory import MeasuredLengths, WorkerShape, plan_worker
from .online import adaptive_controller, drafter_training
from .scheduler import SchedulerConfig, SpotTrainer, SpotWindow
from .world import World


class GRPOTrainer:
    """GRPO with TLT on one model: in one process, or as one data-parallel worker (``world``).

    Args:
        model: the policy (a :class:`tltlib.model.decoder.Transformer`); updated in place — the engine decodes with it.
        With
            several workers it must already be on ``world.device``.
        tokenizer: its tokenizer.
        problems: the training prompts (:class:`tltlib.tasks.problem.Problem`), sampled without replacement each step
            (the same draw on every worker; each rolls out its share).
        args: :class:`tltlib.rl.grpo.GRPOConfig`.
        reward_funcs: TRL-style reward functions (default: :func:`tltlib.rl.grpo.accuracy_reward`).
        drafter: an EAGLE drafter for the target (None: no learned drafter; ``tlt.speculative`` must then be
            ``"off"`` or an n-gram strategy).
        tlt: :class:`TLTConfig` (None = plain decoding, no drafter training: the baseline).
        progress: tqdm bars for rollouts (rank 0 only).
        world: :class:`tltlib.rl.world.World` (default: one process) or a :class:`~tltlib.rl.world.DistributedWorld`.
        scheduler: :class:`tltlib.rl.scheduler.SchedulerConfig`, the spot trainer's settings (default: its defaults;
        with
            one worker there is no idle window).
        curriculum: :class:`tltlib.rl.curriculum.CurriculumConfig`: the prompts of each step come from the levels
            opened so far (None: from all problems).
        lengths: :class:`tltlib.rl.memory.MeasuredLengths` of an earlier rollout, from which the memory check estimates
            the KV the rollouts hold (None: every row at max_completion_length).
    """

    def __init__(self, model, tokenizer, problems, args: GRPOConfig, reward_funcs=(accuracy_reward,),
                 drafter=None, tlt: TLTConfig | None = None, progress: bool = False, world: World | None = None,
                 scheduler: SchedulerConfig | None = None, curriculum: CurriculumConfig | None = None,
                 lengths: MeasuredLengths | None = None):
        self.world = world or World(str(model.device))
        self.sched = scheduler or SchedulerConfig()
        self.model, self.tokenizer, self.problems, self.args = model, tokenizer, list(problems), args
        self.tlt = tlt or TLTConfig(speculative="off", online_drafter=False, drafter_steps=0)
        self.reward_funcs = list(reward_funcs)
        self._check(drafter, scheduler)
        self.curriculum, self.pools = curriculum, None if curriculum is None else \
            level_pools(self.problems, curriculum, args.prompts_per_step)
        self.slice = self.world.shard(args.prompts_per_step)
        self.progress = progress and self.world.rank == 0
        self.device = model.device
        self.sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                       max_new_tokens=args.max_completion_length)
        self.drafter = drafter
        # float32 master weights when the policy computes in bf16/fp16 (AdamW on bf16 weights barely moves them)
        self.optimizer = MixedPrecisionAdamW(model.parameters(), lr=args.learning_rate,
                                             betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.weight_decay)
        self.buffer, self.drafter_trainer = drafter_training(model, drafter, self.tlt, self.sched, self.world.size,
                                                             args.seed)
        # the KV pool (memory.py): a run that cannot fit is refused here, before its first rollout
        self.kv_plan = plan_worker(model.config, args, self.worker_shape(), self.device, lengths)
        self.engine = RolloutEngine(model, RolloutConfig(  # here (a missing chat template named too)
            self.sampling, num_generations=args.num_generations, kv=KVConfig(memory=self.kv_plan.pool_bytes)),
            drafter=drafter)
        self.reference = copy.deepcopy(model).eval().requires_grad_(False) if args.beta > 0 else None  # pi_ref
        self.spot = SpotTrainer(self.world, self.sched, self.drafter_trainer, self.buffer, self.tlt.drafter_batch)
        self.controller = adaptive_controller(model, drafter, self.tlt, args.generation_batch_size, args.seed)
        self.alarms = online.alarms_for(self.tlt, model, drafter)     # SD's and the drafter's silent failures (alarm/*)
        self.drift = DriftGate(self.tlt.drafter_train, self.tlt.drift_margin)     # when the online drafter trains
        self._source = online.strategy(self.tlt, self.controller, self.alarms)
        rank_seed = args.seed + 7919 * self.world.rank    # rank 0 samples as one process does
        self.generator = torch.Generator(device=self.device).manual_seed(rank_seed)
        if self.buffer is not None:
            self.buffer.rng = np.random.default_rng(rank_seed)
        self.rng = np.random.default_rng(args.seed)       # the prompt draw: the same on every worker
        self.step_count = 0
        self.history: list[dict] = []
        self.world.check_same("configuration", {"fingerprint": self.fingerprint(), "scheduler": asdict(self.sched),
                                                "max_steps": args.max_steps, "save_steps": args.save_steps,
                                                "problems": [p.prompt for p in self.problems[:64]]})

    def _check(self, drafter, scheduler) -> None:
        args, tlt = self.args, self.tlt
        if not self.problems:
            raise BadInput("no training problems")
        if len(self.problems) < args.prompts_per_step:
            raise BadInput(f"{len(self.problems)} training problems but a step needs {args.prompts_per_step} "
                           f"(generation_batch_size {args.generation_batch_size} / num_generations "
                           f"{args.num_generations}); give more problems or a smaller batch")
        if not self.reward_funcs:
            raise BadInput("give at least one reward function")
        if args.reward_weights is not None and len(args.reward_weights) != len(self.reward_funcs):
            raise BadInput(f"reward_weights has {len(args.reward_weights)} values for {len(self.reward_funcs)} "
                           "reward functions")
        spec = tlt.speculative
        if spec not in ("adaptive", "off") and SpecStrategy.parse(spec).uses_drafter and drafter is None:
            raise BadInput(f"speculative={spec!r} needs a learned drafter: pass drafter=... (or use ngram-D)")
        if scheduler is not None and scheduler.spot_trainer and self.world.size == 1 and tlt.online_drafter \
                and tlt.drafter_steps < 1:
            raise BadInput("the spot trainer is on with one worker, where it trains tlt.drafter_steps micro-steps "
                           "after the update, but drafter_steps is 0: give drafter_steps >= 1 or spot_trainer: false")
        if drafter is not None:
            check_separate(drafter, self.model)

    def worker_shape(self, sample: int = 256) -> WorkerShape:
        """What this worker's memory depends on (:class:`tltlib.rl.memory.WorkerShape`): the longest prompt among
        the first ``sample`` problems, its rows per step, the policy's and the online drafter's sizes."""
        args = self.args
        trains = self.drafter_trainer is not None
        return WorkerShape(
            prompt_tokens=max(len(p) for p in encode_prompts(self.problems[:sample], self.tokenizer)),
            rows=len(range(args.prompts_per_step)[self.slice]) * args.num_generations,
            elem_bytes=next(self.model.parameters()).element_size(),
            params=sum(p.numel() for p in self.model.parameters()), drafter=self.drafter is not None,
            drafter_trainable=sum(p.numel() for p in self.drafter.parameters() if p.requires_grad) if trains else 0,
            buffer_tokens=self.tlt.buffer_tokens if self.buffer is not None else 0)

    @property
    def strategy(self):
        """What the rollout is given: the controller, a fixed strategy name, or None (watched by the alarms)."""
        return self._source

    # ------------------------------------------------------------------------------------------- the RL step
    def step(self) -> dict:
        """One RL step; returns its metrics (also appended to :attr:`history`)."""
        clock = StepClock(self.device)
        problems = self.next_problems()
        with clock.phase("rollout"):          # with several workers: until every worker holds the merged drafter
            res = self.rollout(problems, clock)
            window = self.spot.idle_window(self.step_count, clock)
        with clock.phase("reward"):
            batch = self.score(problems, res)
        with clock.phase("logprob"):
            ref_lp, old_lp = self.frozen_logprobs(batch)
        with clock.phase("update"):
            losses = self.update(batch, ref_lp, old_lp, clock)
        losses = losses.summed(self.world)     # over the whole batch
        with clock.phase("drafter"):
            drafter_stats = self.train_drafter(window, clock, res)
        self.step_count += 1
        m = self.metrics(res, batch, losses, drafter_stats, clock)
        if self.alarms is not None:
            m.update(self.alarms.metrics())
        if self.curriculum is not None:           # the level opened last (cumulative stages draw from all before)
            m["rl/curriculum_level"] = float(self.curriculum.levels[stage(self.step_count - 1, self.curriculum)])
        if self.world.distributed:
            m.update(self.spot.metrics(window, clock))
        self.history.append(m)
        return m

    def next_problems(self) -> list:
        """This worker's prompts of the next RL step (the step's draw is the same on every worker)."""
        pool = len(self.problems) if self.pools is None else stage_pool(self.pools, self.step_count, self.curriculum)
        idx = self.rng.choice(pool, size=self.args.prompts_per_step, replace=False)
        return [self.problems[i] for i in sorted(idx)][self.slice]

    def rollout(self, problems, clock: StepClock | None = None) -> RolloutResult:
        """``num_generations`` completions of each problem, SD switching on as rows finish; the drafter's pairs
        stream into the buffer."""
        t = time.time()
        if self.buffer is not None:
            self.buffer.rl_step = self.step_count
        self.model.eval()
        res = self.engine.generate(encode_prompts(problems, self.tokenizer), self.generator, progress=self.progress,
                                   strategy=self.strategy, pairs=self.buffer)
        self.engine.kept.release(keep_graphs=True)   # the update needs the memory: free the packs and CPU buffers
        if clock is not None:
            clock.span("rollout", t)
        return res

    def score(self, problems, res: RolloutResult) -> UpdateBatch:
        """Rewards of this worker's completions, gathered over the workers; group advantages over the whole
        batch; this worker's share of them, with its sequences in micro-batches."""
        args, G, n = self.args, self.args.num_generations, res.num_sequences
        texts = res.texts(self.tokenizer)
        prompts = [problems[i // G].prompt for i in range(n)]
        completions = texts if isinstance(problems[0].prompt, str) else [[{"role": "assistant", "content": t}]
                                                                         for t in texts]
        responses = [res.response_ids(i) for i in range(n)]
        columns = {"answer": [problems[i // G].answer for i in range(n)], "completion_ids": responses}
        per_func, rewards = compute_rewards(self.reward_funcs, prompts, completions, columns, args.reward_weights)
        mine = Completions(rewards, per_func, torch.tensor([len(r) for r in responses]),
                           torch.tensor([not (args.mask_truncated_completions and t) for t in res.truncated]))
        whole = mine.gather(self.world, "reached the all-gather of rewards and statistics")
        first = self.world.rank * n
        advantages = group_advantages(whole.reward, G, args.scale_rewards)[first:first + n].to(self.device)
        seq_prompts = [res.prompt_ids[i // G] for i in range(n)]
        lengths = [len(p) + len(r) for p, r in zip(seq_prompts, responses)]
        return UpdateBatch(seq_prompts, responses, advantages, micro_batches(lengths, args.micro_batch_tokens),
                           whole, mine)

    @torch.no_grad()
    def frozen_logprobs(self, batch: UpdateBatch):
        """(reference policy's, old policy's) per-token log-probabilities per micro-batch, or None where unused
        (``beta == 0``; ``num_iterations == 1``, where the old policy is the current one)."""
        def logprobs(model):
            return [response_logprobs(model, batch.sequence_batch(g, self.engine.pad_id, self.device), self.sampling,
                                      self.args.logprob_chunk) for g in batch.micro_batches]
        ref = logprobs(self.reference) if self.reference is not None else None
        old = logprobs(self.model) if self.args.num_iterations > 1 else None
        return ref, old

    def update(self, batch: UpdateBatch, ref_lp=None, old_lp=None, clock: StepClock | None = None) -> LossStats:
        """``num_iterations`` AdamW steps of the clipped GRPO loss, each over all micro-batches (gradients summed
        over the workers); returns this worker's shares of the loss statistics (:meth:`LossStats.summed` adds the
        other workers'). The gradients accumulate in float32 and AdamW steps float32 master weights when the policy
        computes in bf16/fp16 (:class:`~tltlib.model.optimizer.MixedPrecisionAdamW`). A non-finite gradient norm
        raises before the step is applied (under float16: the step is skipped and the loss scale lowered)."""
        args, model, opt = self.args, self.model, self.optimizer
        model.train()
        local = LossStats()
        for _ in range(args.num_iterations):
            opt.zero_grad()
            for k, g in enumerate(batch.micro_batches):
                self._accumulate(batch, k, g, ref_lp, old_lp, local)
                opt.accumulate()
            t = time.time()
            self.world.sum_gradients(opt.master_weights(), "reached the update's gradient all-reduce")
            if clock is not None:
                clock.span("update sync", t)
            norm = opt.clip_grad_norm(args.max_grad_norm if args.max_grad_norm > 0 else float("inf"))
            if not math.isfinite(norm) and not opt.overflow_skips:
                opt.zero_grad()
                raise NotFinite(
                    f"RL step {self.step_count + 1}: the policy's gradient norm is {norm} (loss "
                    f"{local.loss:.4g}): the update diverged and was not applied; lower learning_rate (now "
                    f"{args.learning_rate:g}) or set max_grad_norm, and resume from the last checkpoint")
            local.moved = opt.step()
        model.eval()
        opt.zero_grad()
        return replace(local, grad_norm=norm)

    def _accumulate(self, batch: UpdateBatch, k: int, g: list, ref_lp, old_lp, stats: LossStats) -> None:
        """Forward and backward of micro-batch ``k`` (this worker's completions ``g``); adds its share of the loss
        statistics to ``stats``."""
        args = self.args
        n_total, tokens = len(batch.whole.reward), batch.whole.counted_tokens
        mb = batch.sequence_batch(g, self.engine.pad_id, self.device)
        lp = response_logprobs(self.model, mb, self.sampling, args.logprob_chunk)
        mask = mb.response_mask() & batch.mine.counted[g].to(self.device)[:, None]
        old = old_lp[k] if old_lp is not None else lp.detach()
        per_token, clipped = clipped_token_loss(lp, old, batch.advantages[g], args.epsilon, args.clip_high)
        if ref_lp is not None:
            kl = kl_k3(lp, ref_lp[k])
            per_token = per_token + args.beta * kl
            stats.kl += float((kl.detach() * mask).sum()) / max(tokens, 1) / args.num_iterations
        loss = aggregate_loss(per_token, mask, args.loss_type, n_total, tokens, args.max_completion_length)
        self.optimizer.backward(loss)
        stats.loss += float(loss.detach()) / args.num_iterations
        stats.clip_frac += float((clipped & mask).sum()) / max(tokens, 1) / args.num_iterations

    def train_drafter(self, window: SpotWindow | None = None, clock: StepClock | None = None,
                      res: RolloutResult | None = None) -> dict:
        """The online drafter's training of this step: none when the spot trainer trained it in the idle window
        (its ``drafter/*`` statistics are returned); else ``drafter_steps`` micro-steps, merged over the workers,
        unless ``drafter_train: on_drift`` finds the acceptance of the rollout ``res`` still near its best
        (:class:`~tltlib.rl.drift.DriftGate`). Then the stale and mismatch alarms look at the drafter."""
        trains = self.drafter_trainer is not None
        train = self.drift.decide(res.timeline) if trains and res is not None else True
        version = online.version_before(self.spot, window, self.drafter)
        stats = online.train_drafter(self.spot, self.tlt, window, clock, train)
        if not trains:
            return stats
        moved = self.drafter.version != version
        if moved:
            self.drift.trained()
        due = window.steps > 0 if self.spot.active and window is not None else train and bool(self.buffer.sequences())
        online.watch_drafter(self.alarms, [self.engine.drafter], self.drafter, version, self.args.learning_rate > 0,
                             due, self.world)
        return {**stats, "drafter/trained": float(moved), **self.drift.metrics()}

    def metrics(self, res: RolloutResult, batch: UpdateBatch, losses: LossStats, drafter_stats: dict,
                clock: StepClock) -> dict:
        """The step's metrics: ``rl/*`` of the whole batch, this worker's ``rollout/*``, ``spec/*``, ``drafter/*``,
        ``update/*`` and ``time/*``."""
        whole, lengths = batch.whole, batch.lengths
        update_tokens = sum(lengths) * self.args.num_iterations
        acc = next((j for j, f in enumerate(self.reward_funcs) if f is accuracy_reward), None)
        update_s = clock.phases["update"]
        return {"rl/step": self.step_count, "rl/reward_mean": float(whole.reward.mean()),
                "rl/reward_std": float(whole.reward.std()),
                "rl/accuracy": float((whole.per_func[:, acc] >= 1.0).float().mean()) if acc is not None
                else float("nan"),
                "rl/loss": losses.loss, "rl/kl": losses.kl, "rl/clip_frac": losses.clip_frac,
                "rl/grad_norm": losses.grad_norm, "update/weights_moved": losses.moved,
                "rl/completion_len_mean": float(whole.length.double().mean()),
                **{f"rl/reward/{reward_name(f)}": float(np.nanmean(whole.per_func[:, j].numpy()))
                   for j, f in enumerate(self.reward_funcs)},
                **res.stats, **drafter_stats,
                "drafter/version": float(getattr(self.drafter, "version", 0)),
                "drafter/buffer_pairs": float(self.buffer.num_pairs if self.buffer is not None else 0),
                "update/tokens": float(update_tokens),
                "update/padding_frac": 1 - sum(lengths) / padded_tokens(lengths, batch.micro_batches),
                "update/tokens_per_s": update_tokens / max(update_s, 1e-9), **clock.metrics()}

    # ---------------------------------------------------------------------------------------------- around
    @torch.no_grad()
    def evaluate(self, problems, strategy: str | None = "chain-8") -> dict:
        """Held-out accuracy with greedy decoding (``eval/*``), each worker evaluating its share. With a drafter
        the rollout uses ``strategy`` (speculative decoding is exact at temperature 0, so only the time changes);
        the tuner learns nothing."""
        mine = problems[self.world.rank::self.world.size]
        m = {"eval/accuracy": 0.0, "eval/len_mean": 0.0}
        if mine:
            engine = RolloutEngine(self.model, RolloutConfig(replace(self.sampling, temperature=0.0),
                                                             num_generations=1),
                                   drafter=self.drafter)
            res = engine.generate(encode_prompts(mine, self.tokenizer),
                                  strategy=strategy if self.drafter is not None else None)
            texts = res.texts(self.tokenizer)
            m = {"eval/accuracy": float(np.mean([accuracy_reward([p.prompt], [t], [p.answer])[0]
                                                 for p, t in zip(mine, texts)])),
                 "eval/len_mean": float(res.lengths.float().mean())}
        return self.world.average(m, len(mine))

    def train(self, steps: int | None = None, on_step=None, save_to: str | os.PathLike | None = None) -> list[dict]:
        """Run ``steps`` more RL steps (default: up to ``args.max_steps``); ``on_step(metrics)`` after each; with
        ``save_to``, checkpoint every ``save_steps`` steps and at the end."""
        steps = self.args.max_steps - self.step_count if steps is None else steps
        out = []
        for _ in range(steps):
            out.append(self.step())
            if on_step is not None:
                on_step(out[-1])
            if save_to and (self.args.save_steps and self.step_count % self.args.save_steps == 0):
                self.save(save_to)
        if save_to and out:
            self.save(save_to)
        return out

    def weights_digest(self) -> str:
        """sha256 of the policy's weights (equal on every worker after every step)."""
        h = hashlib.sha256()
        for k, v in sorted(self.model.state_dict().items()):
            h.update(k.encode())
            h.update(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    # --------------------------------------------------------------------------------------------- checkpoint
    def fingerprint(self) -> dict:
        """What a checkpoint must match to be resumed here (:func:`tltlib.rl.checkpoint.fingerprint`)."""
        return checkpoint.fingerprint(self.model.config, self.args, self.tlt, self.drafter is not None,
                                      [reward_name(f) for f in self.reward_funcs], self.curriculum, self.world.size,
                                      self.sched)

    def save(self, path: str | os.PathLike) -> Path:
        """Write a checkpoint folder atomically (:func:`tltlib.rl.checkpoint.save`)."""
        return checkpoint.save(path, self.checkpoint_state(), self.world, self._worker_state())

    def load(self, path: str | os.PathLike) -> "GRPOTrainer":
        """Restore a checkpoint written by :meth:`save`; refused, with the differences named, when it comes from
        another model or configuration (:func:`tltlib.rl.checkpoint.load`)."""
        state, worker = checkpoint.load(path, self.fingerprint(), self.device, self.world)
        self.restore(state, worker)
        return self

    def checkpoint_state(self) -> checkpoint.TrainerState:
        """Everything a bit-identical resume needs (:class:`tltlib.rl.checkpoint.TrainerState`)."""
        trains = self.drafter_trainer
        meta = {"step": self.step_count, "fingerprint": self.fingerprint(), "numpy_rng": self.rng.bit_generator.state,
                "history": self.history,
                "controller": self.controller.state_dict() if self.controller is not None else None,
                "drafter_version": getattr(self.drafter, "version", None), "drafter_drift": self.drift.state_dict(),
                "drafter_steps_done": trains.steps_done if trains else None}
        tensors = {"optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state()}
        parts = {"reference": self.reference, "drafter": self.drafter,
                 "drafter_optimizer": trains.opt if trains else None, "buffer": self.buffer}
        tensors.update({k: v.state_dict() for k, v in parts.items() if v is not None})
        return checkpoint.TrainerState(meta, self.model.state_dict(), tensors)

    def _worker_state(self) -> dict:
        """This worker's own state beside the checkpoint (several workers: each samples and tunes on its own)."""
        return {"generator": self.generator.get_state(),
                "buffer": self.buffer.state_dict() if self.buffer is not None else None,
                "controller": self.controller.state_dict() if self.controller is not None else None}

    def restore(self, state: checkpoint.TrainerState, worker: dict | None = None) -> None:
        """Put this trainer in the checkpointed ``state`` (and, with several workers, this worker's ``worker``)."""
        meta, tensors = state.meta, state.tensors
        self.model.load_state_dict(state.policy)
        self.optimizer.load_state_dict(tensors["optimizer"])
        self.generator.set_state(tensors["generator"])
        if self.reference is not None:
            self.reference.load_state_dict(tensors["reference"])
        if self.drafter is not None:
            self.drafter.load_state_dict(tensors["drafter"])
            self.drafter.version = meta["drafter_version"]
        if self.drafter_trainer is not None:
            self.drafter_trainer.opt.load_state_dict(tensors["drafter_optimizer"])
            self.drafter_trainer.steps_done = meta["drafter_steps_done"]
        if self.buffer is not None:
            self.buffer.load_state_dict(tensors["buffer"])
        if self.controller is not None:
            self.controller.load_state_dict(meta["controller"])
        self.drift.load_state_dict(meta.get("drafter_drift"))
        self.rng.bit_generator.state = meta["numpy_rng"]
        self.step_count, self.history = meta["step"], list(meta["history"])
        if worker is not None:
            self.generator.set_state(worker["generator"])
            if self.buffer is not None:
                self.buffer.load_state_dict(worker["buffer"])
            if self.controller is not None:
                self.controller.load_state_dict(worker["controller"])
