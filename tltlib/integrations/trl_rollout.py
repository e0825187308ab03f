"""TLT inside TRL's ``GRPOTrainer``: the adaptive rollout engine and the online drafter behind TRL's ``rollout_func``.

``GRPOTrainer(..., rollout_func=tlt_rollout_func(model_folder, drafter_folder))``: TRL keeps its dataset, rewards,
loss, optimizer, logging, checkpoints and its data-parallel scaling with accelerate (FSDP and ZeRO-3 refused: their
weights are sharded); each generation batch is sampled by tltlib's engine (plain decoding while many rows run,
speculative decoding in the long tail, chosen by the tuner), with TRL's temperature, top-p, top-k and max completion
length, and returned with the exact sampling log-probs. The
rollout's (hidden, token) pairs train the drafter right after the rollout (one process) or, with several processes,
on each process whose share has finished while the others still generate (the spot trainer over the process group
accelerate started; the drafters are merged when the last share ends).

One call of the rollout (:meth:`TLTRollout.__call__`, the prompts of this process, each repeated
``num_generations`` times as TRL's sampler orders them):

1. first call: the checks (:mod:`.trl_checks`), the rollout's model (from the folder, compared with TRL's model
   tensor by tensor; or built from TRL's model), the drafter, the controller, the callback (:mod:`.trl_state`) and, on
   a resumed run, the state from TRL's checkpoint;
2. the policy's weights copied from ``trainer.model`` when TRL's ``global_step`` moved (``time/weight_sync_s``);
3. the prompts templated as TRL templates them, ``num_generations`` samples of each (the adaptive engine), ended
   by the tokens TRL counts as EOS;
4. training mode: the drafter trains on the pairs (``time/drafter_s``); its version moves;
5. the metrics under tltlib's names (``rollout/*``, ``spec/*``, ``drafter/*``, ``time/*``) into TRL's logs.

Paper: TLT §3-5 (adaptive rollout, online drafter, spot trainer) served to TRL's GRPO.
Departures:
1. TRL's ``rollout_func`` is experimental; this module is tested with :data:`.trl_checks.TRL_SUPPORTED` only.
2. In one process the drafter trains after the rollout and before TRL's update (tltlib's own trainer: after the
   update); either way the drafter trained on step k's pairs drafts step k+1.
3. The pair buffer is not part of TRL's checkpoints (see :mod:`.trl_state`).
"""
from __future__ import annotations

import os
import time
from collections import defaultdict

import torch

from ..errors import BadInput, NotFound
from ..fileio import resolve
from ..kv.paged import KVConfig
from ..model.decoder import Transformer
from ..model.drafter import load_drafter
from ..model.weights import load_model
from ..rl import online
from ..rl.clock import StepClock
from ..rl.config import TLTConfig
from ..rl.drift import DriftGate
from ..rl.scheduler import SchedulerConfig, SpotTrainer
from ..rl.world import DistributedWorld, World
from ..rollout.config import RolloutConfig
from ..rollout.engine import RolloutEngine
from ..tasks.tokenizer import load_tokenizer
from . import trl_state
from .trl_checks import check_tokenizer, check_trainer, check_trl_version, groups, sampling_of
from .trl_weights import check_architecture, config_of, copy_weights, first_difference, hf_tensors, unwrapped


def tlt_rollout_func(model: str | os.PathLike | None = None, drafter: str | os.PathLike | None = None,
                     tlt: TLTConfig | None = None, scheduler: SchedulerConfig | None = None,
                     kv: KVConfig | None = None, resume_from: str | os.PathLike | None = None,
                     progress: bool = False) -> "TLTRollout":
    """TRL's ``rollout_func`` running TLT: ``GRPOTrainer(..., rollout_func=tlt_rollout_func(...))``.

    Args:
        model: the tltlib model folder the trainer's model was loaded from (its weights and tokenizer are compared
            with TRL's at the first call); None: the rollout decodes with a copy of TRL's own model.
        drafter: an EAGLE drafter folder trained for that model (None: no learned drafter; the adaptive tuner then
            chooses among the model-free n-gram arms and plain decoding).
        tlt: :class:`tltlib.rl.config.TLTConfig` (threshold, arms, online drafter), as in ``train-grpo``.
        scheduler: :class:`tltlib.rl.scheduler.SchedulerConfig` (the spot trainer with several processes).
        kv: the rollout's KV cache and its memory budget (:class:`tltlib.kv.paged.KVConfig`).
        resume_from: a TRL checkpoint folder whose ``tlt_rollout/`` to restore (default: TRL's own,
            ``output_dir/checkpoint-<global_step>``, when TRL resumed).
        progress: a tqdm bar of finished responses per rollout (process 0).
    """
    return TLTRollout(model, drafter, tlt, scheduler, kv, resume_from, progress)


class TLTRollout:
    """The state of the TLT rollout behind TRL's ``rollout_func`` (see the module's docstring); made by
    :func:`tlt_rollout_func`, bound to its trainer at the first call."""

    def __init__(self, model=None, drafter=None, tlt: TLTConfig | None = None, scheduler: SchedulerConfig | None = None,
                 kv: KVConfig | None = None, resume_from=None, progress: bool = False):
        self.trl_version = check_trl_version()
        self.model_path = resolve(model) if model is not None else None
        self.drafter_path = resolve(drafter) if drafter is not None else None
        for what, path in (("model", self.model_path), ("drafter", self.drafter_path)):
            if path is not None and not path.is_dir():
                raise NotFound(f"tlt_rollout_func({what}=...): no folder {str(path)!r}")
        self.tlt, self.sched, self.kv = tlt or TLTConfig(), scheduler or SchedulerConfig(), kv or KVConfig()
        self.tlt.check_drafter(self.drafter_path is not None, "tlt_rollout_func")
        self.resume_from, self.progress = resume_from, progress
        self.trainer = None
        self.synced_step: int | None = None
        self.engines: dict[int, RolloutEngine] = {}
        self.pending: list = []                  # (window, clock) of each rollout since the last optimizer step

    # ------------------------------------------------------------------------------------------------ binding
    def bind(self, trainer) -> None:
        """Check ``trainer`` and build everything the rollout needs (at the first call)."""
        check_trainer(trainer)
        args = trainer.args
        self.sampling = sampling_of(args)
        self.eos_ids = tuple(trainer.eos_token_ids)      # TRL's: the tokenizer's EOS and the generation config's
        hf = unwrapped(trainer.model)
        device = trainer.accelerator.device
        if device.type == "cpu":
            device = torch.device("cpu")              # accelerate's multi-CPU names it cpu:<rank>
        dtype = (torch.bfloat16 if args.bf16 else torch.float16 if args.fp16      # TRL's autocast, else its weights'
                 else next(hf.parameters()).dtype)
        self.model, self.tokenizer = self._policy(hf, device, dtype, trainer.state.global_step > 0,
                                                  trainer.processing_class)
        if self.model_path is not None:
            check_tokenizer(trainer.processing_class, self.tokenizer, str(self.model_path))
        self.drafter = load_drafter(self.drafter_path, self.model) if self.drafter_path is not None else None
        procs = trainer.accelerator.num_processes
        self.world = DistributedWorld(device.type) if procs > 1 else World(str(device))
        self.buffer, self.drafter_trainer = online.drafter_training(self.model, self.drafter, self.tlt, self.sched,
                                                                    self.world.size, args.seed)
        self.spot = SpotTrainer(self.world, self.sched, self.drafter_trainer, self.buffer, self.tlt.drafter_batch)
        rows = args.per_device_train_batch_size * args.steps_per_generation
        self.controller = online.adaptive_controller(self.model, self.drafter, self.tlt, rows, args.seed)
        self.alarms = online.alarms_for(self.tlt, self.model, self.drafter)   # SD's and the drafter's silent failures
        self.drift = DriftGate(self.tlt.drafter_train, self.tlt.drift_margin)
        self.source = online.strategy(self.tlt, self.controller, self.alarms)
        self.synced_version, self.due = getattr(self.drafter, "version", None), False
        self.generator = torch.Generator(device=device).manual_seed(args.seed + 7919 * self.world.rank)
        self.trainer = trainer
        trainer.add_callback(trl_state.callback(self))
        folder = trl_state.resumed_from(trainer, self.resume_from)
        if folder is not None:
            trl_state.load(self, folder)

    def _policy(self, hf, device, dtype, resumed: bool, trl_tokenizer):
        """(the rollout's model, its tokenizer): the folder's model checked against TRL's, or a copy of TRL's."""
        if self.model_path is None:
            with torch.device(device):
                model = Transformer(config_of(hf), init_std=0.0).to(dtype)
            copy_weights(model, hf_tensors(hf))
            return model.eval().requires_grad_(False), trl_tokenizer
        model = load_model(self.model_path, dtype=dtype, device=str(device))
        check_architecture(model.config, hf)
        diff = None if resumed else first_difference(model, hf_tensors(hf))
        if diff is not None:
            raise BadInput(f"TRL's model is not the model in {str(self.model_path)!r}: {diff}; load the TRL "
                           "trainer's model from the same folder (GRPOTrainer(model=folder)), or pass "
                           "tlt_rollout_func(model=None) to decode with TRL's own weights")
        return model.eval().requires_grad_(False), load_tokenizer(self.model_path)

    # ----------------------------------------------------------------------------------------------- the call
    def __call__(self, prompts: list, trainer) -> dict:
        """TRL's ``rollout_func(prompts, trainer)``: ``prompt_ids``, ``completion_ids`` and ``logprobs`` (the sampling
        log-probabilities of each completion token), one row per prompt of this process."""
        if self.trainer is None:
            self.bind(trainer)
        elif trainer is not self.trainer:
            raise BadInput("this TLT rollout_func is bound to another GRPOTrainer: make one per trainer")
        train = trainer.model.training
        G = trainer.num_generations if train else trainer.num_generations_eval
        starts, g = groups(prompts, G, "per_device_train_batch_size x steps_per_generation" if train
                           else "per_device_eval_batch_size")
        clock = StepClock(self.model.device)
        with clock.phase("weight_sync"):
            self.sync(trainer)
        ids = self.encode([prompts[s] for s in starts], trainer)
        with clock.phase("rollout"):
            res = self.rollout(ids, g, train, trainer.state.global_step, clock)
            window = self.spot.idle_window(trainer.state.global_step, clock) if train else None
        drafter_stats = {}
        if train:
            with clock.phase("drafter"):
                drafter_stats = self.train_drafter(res, window, clock)
            if self.world.distributed:
                self.pending.append((window, clock))
        alarms = self.alarms.metrics() if self.alarms is not None else {}
        self.log(trainer, "train" if train else "eval", {**res.stats, **drafter_stats, **self._drafter_metrics(),
                                                          **alarms,
                                                          **{k: v for k, v in clock.metrics().items()
                                                             if k != "time/step_s"}})
        n = res.num_sequences
        return {"prompt_ids": [list(ids[i // g]) for i in range(n)],
                "completion_ids": [res.response_ids(i) for i in range(n)],
                "logprobs": [res.logprobs[i, : int(res.lengths[i])].tolist() for i in range(n)]}

    def train_drafter(self, res, window, clock) -> dict:
        """The online drafter after a training rollout (:func:`tltlib.rl.online.train_drafter`), unless
        ``drafter_train: on_drift`` finds its acceptance on ``res`` still near its best."""
        if self.drafter_trainer is None:
            return online.train_drafter(self.spot, self.tlt, window, clock)
        train, version = self.drift.decide(res.timeline), online.version_before(self.spot, window, self.drafter)
        stats = online.train_drafter(self.spot, self.tlt, window, clock, train)
        if self.drafter.version != version:
            self.drift.trained()
        self.due |= window.steps > 0 if self.spot.active and window is not None else \
            train and bool(self.buffer.sequences())
        return {**stats, "drafter/trained": float(self.drafter.version != version), **self.drift.metrics()}

    def sync(self, trainer) -> None:
        """Copy TRL's weights into the rollout's model when TRL's optimizer has stepped since the last copy; then
        the stale and mismatch alarms look at the drafter (trained since the last copy when it was due to)."""
        step = trainer.state.global_step
        if step != self.synced_step:
            copy_weights(self.model, hf_tensors(trainer.model))
            if self.synced_step is not None and self.drafter_trainer is not None:
                online.watch_drafter(self.alarms, [e.drafter for e in self.engines.values()], self.drafter,
                                     self.synced_version, True, self.due, self.world)
                self.synced_version, self.due = self.drafter.version, False
            self.synced_step = step

    def encode(self, prompts: list, trainer) -> list[list[int]]:
        """Token ids of each prompt as TRL's own generation tokenizes it: chat messages through the chat template
        (with the generation prompt, TRL's ``chat_template`` and ``chat_template_kwargs``), text as it is."""
        tok = trainer.processing_class
        if isinstance(prompts[0], list):
            out = tok.apply_chat_template(conversation=prompts, chat_template=getattr(trainer, "chat_template", None),
                                          add_generation_prompt=True, tokenize=True, return_dict=True,
                                          **(getattr(trainer, "chat_template_kwargs", None) or {}))
            return [list(r) for r in out["input_ids"]]
        return [list(r) for r in tok(text=prompts)["input_ids"]]

    def rollout(self, ids: list[list[int]], G: int, train: bool, step: int, clock: StepClock):
        """``G`` samples of each prompt by the adaptive engine; in training the pairs stream into the buffer."""
        engine = self.engines.get(G)
        if engine is None:
            engine = self.engines[G] = RolloutEngine(self.model, RolloutConfig(
                self.sampling, num_generations=G, kv=self.kv), drafter=self.drafter, eos_ids=self.eos_ids)
        pairs = self.buffer if train else None
        if pairs is not None:
            pairs.rl_step = step
        t = time.time()
        res = engine.generate(ids, self.generator, progress=self.progress and self.world.rank == 0,
                              strategy=self.source, pairs=pairs)
        engine.kept.release(keep_graphs=True)       # TRL's update needs the memory
        clock.span("rollout", t)
        return res

    # ------------------------------------------------------------------------------------------------ metrics
    def _drafter_metrics(self) -> dict:
        if self.drafter is None:
            return {}
        return {"drafter/version": float(self.drafter.version),
                "drafter/buffer_pairs": float(self.buffer.num_pairs if self.buffer is not None else 0)}

    def log(self, trainer, mode: str, metrics: dict) -> None:
        """Add ``metrics`` to TRL's logs of ``mode`` (TRL averages each over the steps of a logging interval); the
        per-depth acceptance histogram (``spec/accept_ge_*``, up to 64 keys) is left out of TRL's logs."""
        store = getattr(trainer, "_metrics", None)
        if store is None:
            store = trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.startswith("spec/accept_ge_"):
                store[mode][k].append(float(v))

    def log_schedule(self) -> None:
        """With several processes, after TRL's optimizer step: the ``sched/*`` metrics of the last rollout (idle
        share, harvested share, preemption, sync) from every process's idle window, into TRL's logs."""
        for window, clock in self.pending:
            self.log(self.trainer, "train", self.spot.metrics(window, clock))
        self.pending = []
