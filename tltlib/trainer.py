"""The RL step loop with TLT in one process: rollout (adaptive SD), rewards, GRPO update of the very module the
engine decodes with, then the online drafter trained on the pairs the rollout streamed; checkpoint and resume.

One :meth:`GRPOTrainer.step`:

1. **rollout** — ``generation_batch_size / num_generations`` prompts, ``num_generations`` completions each, by the
   :class:`tltlib.rollout.RolloutEngine` with the adaptive controller (or a fixed strategy, or none); the pairs the
   drafter consumes stream into the :class:`tltlib.pairs.PairBuffer`;
2. **rewards** — the reward functions, then group advantages (:mod:`tltlib.grpo`);
3. **log-probs** — no-grad forwards for the reference policy (``beta > 0``) and the old policy
   (``num_iterations > 1``), in length-bucketed micro-batches (:mod:`tltlib.logprobs`);
4. **update** — ``num_iterations`` AdamW steps, each accumulating the loss over the micro-batches;
5. **drafter** — ``drafter_steps`` micro-steps on batches sampled from the buffer (older RL steps down-weighted);
   the drafter's version moves, so the adaptive controller re-explores its arms.

Every phase is timed (``time/*``); the step returns one dict of metrics under the vocabulary of
:mod:`tltlib.profiling`. :meth:`GRPOTrainer.save` writes everything a bit-identical resume needs (policy, optimizers,
drafter, buffer, controller, RNG states, step) into one folder atomically; :meth:`GRPOTrainer.load` refuses a
folder from another model or configuration.

Paper: TLT §3 (system overview: rollout with adaptive SD, drafter trained on the rollout's hidden states), §4-5.
Departures:
1. The drafter trains between rollouts in the same process (the spot trainer on idle workers is
   :mod:`tltlib.scheduler`'s job); its cost is therefore on the step's critical path and reported as ``time/drafter_s``.
2. A resumed run is bit-identical only when the strategy choice does not depend on wall-clock time (a fixed
   strategy or none); the adaptive controller's rewards are timings, so after a resume it makes the same *kind*
   of decisions, not necessarily the same ones (the output distribution is the same either way: SD is lossless).
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from .adaptive import DEFAULT_ARMS, AdaptiveConfig, AdaptiveController, TunerConfig, default_threshold, measure_costs
from .grpo import GRPOConfig, accuracy_reward, aggregate_loss, clipped_token_loss, compute_rewards, group_advantages
from .grpo import kl_k3, reward_name
from .logprobs import SequenceBatch, micro_batches, padded_tokens, response_logprobs
from .rollout import RolloutConfig, RolloutEngine
from .sampling import SamplingConfig
from .speculative import SpecStrategy
from .tasks import encode_prompts

CHECKPOINT_FORMAT = "tltlib-grpo-checkpoint-1"


@dataclass(frozen=True)
class TLTConfig:
    """What TLT adds to the RL step: speculative rollout and the online drafter."""

    speculative: str = "adaptive"
    """``"adaptive"`` (SD switch + BEG-MAB), ``"off"`` (plain decoding: the baseline), or one strategy name used at
    every step (``"chain-8"``)."""
    threshold: int = 0
    """SD runs at or below this many running rows (0 = the measured default for the device)."""
    arms: tuple = ("off", *DEFAULT_ARMS)
    """The adaptive tuner's strategies; ``off`` lets it keep plain decoding where no SD strategy pays (a drafter
    that RL has left behind, or a compute-bound batch)."""
    on_drafter_change: str = "reset"
    """What the adaptive tuner does when the online drafter has trained: ``"reset"`` re-explores the drafter's arms,
    ``"keep"`` keeps their reward windows (see :class:`~tltlib.adaptive.AdaptiveConfig`)."""
    online_drafter: bool = True
    """Train the drafter on every rollout's pairs (False: the drafter stays as loaded, "frozen")."""
    drafter_steps: int = 6
    """Drafter micro-steps after each rollout (the one-process training budget)."""
    drafter_lr: float = 3e-4
    """Drafter AdamW learning rate (constant after 10 warm-up steps)."""
    drafter_batch: int = 4
    """Sequences per drafter micro-step (of similar length; see PairBuffer.sample)."""
    buffer_tokens: int = 1 << 20
    """Pairs the drafter's buffer holds."""
    buffer_decay: float = 0.5
    """Sampling weight of pairs from a step ``a`` RL steps ago: ``decay ** a``."""

    def __post_init__(self):
        if self.speculative not in ("adaptive", "off"):
            from .speculative import SpecStrategy
            SpecStrategy.parse(self.speculative)     # raises with the syntax
        if self.drafter_steps < 0:
            raise ValueError(f"drafter_steps is the drafter-training budget per RL step and must be >= 0, got "
                             f"{self.drafter_steps}")
        AdaptiveConfig(on_drafter_change=self.on_drafter_change)     # raises naming the allowed values
        if not 0 < self.buffer_decay <= 1 or self.buffer_tokens < 2:
            raise ValueError(f"buffer_decay must be in (0, 1] and buffer_tokens >= 2 pairs, got {self.buffer_decay}, "
                             f"{self.buffer_tokens}")
        if self.threshold < 0 or self.drafter_batch < 1 or not self.drafter_lr > 0:
            raise ValueError("threshold must be >= 0, drafter_batch >= 1 and drafter_lr > 0")


def _config_dict(cfg) -> dict:
    return json.loads(json.dumps(asdict(cfg), default=str))


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class GRPOTrainer:
    """GRPO with TLT on one model, in one process.

    Args:
        model: the policy (a :class:`tltlib.model.Transformer`); updated in place — the engine decodes with it.
        tokenizer: its tokenizer.
        problems: the training prompts (:class:`tltlib.tasks.Problem`), sampled without replacement each step.
        args: :class:`tltlib.grpo.GRPOConfig`.
        reward_funcs: TRL-style reward functions (default: :func:`tltlib.grpo.accuracy_reward`).
        drafter: an EAGLE drafter for the target (None: no learned drafter; ``tlt.speculative`` must then be
            ``"off"`` or an n-gram strategy).
        tlt: :class:`TLTConfig` (None = plain decoding, no drafter training: the baseline).
        progress: tqdm bars for rollouts.
    """

    def __init__(self, model, tokenizer, problems, args: GRPOConfig, reward_funcs=(accuracy_reward,),
                 drafter=None, tlt: TLTConfig | None = None, progress: bool = False):
        if not problems:
            raise ValueError("no training problems")
        if len(problems) < args.prompts_per_step:
            raise ValueError(f"{len(problems)} training problems but a step needs {args.prompts_per_step} "
                             f"(generation_batch_size {args.generation_batch_size} / num_generations "
                             f"{args.num_generations}); give more problems or a smaller batch")
        self.model, self.tokenizer, self.problems, self.args = model, tokenizer, list(problems), args
        self.tlt = tlt or TLTConfig(speculative="off", online_drafter=False, drafter_steps=0)
        self.reward_funcs = list(reward_funcs)
        if not self.reward_funcs:
            raise ValueError("give at least one reward function")
        if args.reward_weights is not None and len(args.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"reward_weights has {len(args.reward_weights)} values for {len(self.reward_funcs)} "
                             "reward functions")
        self.progress = progress
        dev = self.device = model.device
        self.sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                       max_new_tokens=args.max_completion_length)
        spec = self.tlt.speculative
        if spec not in ("adaptive", "off") and SpecStrategy.parse(spec).uses_drafter and drafter is None:
            raise ValueError(f"speculative={spec!r} needs a learned drafter: pass drafter=... (or use ngram-D)")
        self.drafter = drafter
        self.engine = RolloutEngine(model, RolloutConfig(self.sampling, group_size=args.num_generations),
                                    drafter=drafter)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate,
                                           betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.weight_decay)
        self.reference = None
        if args.beta > 0:                              # a frozen copy of the initial policy
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.buffer = self.drafter_trainer = None
        if drafter is not None and self.tlt.online_drafter and self._trains_drafter():
            from .draft_train import DrafterTrainConfig, DrafterTrainer
            from .pairs import PairBuffer, PairBufferConfig
            w = model.embed.weight
            self.buffer = PairBuffer(model.config.hidden_size, PairBufferConfig(
                max_tokens=self.tlt.buffer_tokens, decay=self.tlt.buffer_decay, seed=args.seed), w.dtype, w.device)
            self.drafter_trainer = DrafterTrainer(drafter, DrafterTrainConfig(
                lr=self.tlt.drafter_lr, batch_sequences=self.tlt.drafter_batch, warmup_steps=10,
                schedule="constant", seed=args.seed))
        self.controller = None
        if self.tlt.speculative == "adaptive":
            threshold = self.tlt.threshold or default_threshold(dev)
            arms = tuple(a for a in self.tlt.arms if drafter is not None or str(a).startswith(("ngram", "off")))
            if not arms:
                raise ValueError("speculative='adaptive' without a drafter needs n-gram arms (e.g. ngram-4)")
            costs = measure_costs(model, drafter, max_batch=max(1, min(threshold, args.generation_batch_size)))
            self.controller = AdaptiveController(AdaptiveConfig(threshold=threshold, tuner=TunerConfig(
                arms=arms, seed=args.seed), on_drafter_change=self.tlt.on_drafter_change), costs, drafter)
        self.generator = torch.Generator(device=dev).manual_seed(args.seed)
        self.rng = np.random.default_rng(args.seed)
        self.step_count = 0
        self.history: list[dict] = []

    # ------------------------------------------------------------------------------------------------ pieces
    @property
    def strategy(self):
        """What the rollout is given: the controller, a fixed strategy name, or None."""
        if self.controller is not None:
            return self.controller
        return None if self.tlt.speculative == "off" else self.tlt.speculative

    def _next_problems(self) -> list:
        idx = self.rng.choice(len(self.problems), size=self.args.prompts_per_step, replace=False)
        return [self.problems[i] for i in sorted(idx)]

    def _trains_drafter(self) -> bool:
        """Whether the online drafter gets a training budget (here: ``drafter_steps`` after each update)."""
        return self.tlt.drafter_steps > 0

    def _shard_offset(self, n: int) -> int:
        """Index of this process's first completion in the whole batch (one process: 0)."""
        return 0

    def _policy_logprobs(self, model, batches, prompts, responses) -> list[torch.Tensor]:
        with torch.no_grad():
            return [response_logprobs(model, SequenceBatch.build(prompts, responses, g, self.engine.pad_id,
                                                                 self.device), self.sampling, self.args.logprob_chunk)
                    for g in batches]

    # ------------------------------------------------------- what data-parallel workers override (scheduler.py)
    def _rollout(self, prompt_ids):
        """This process's rollout of ``prompt_ids`` (the data-parallel trainer adds the spot trainer around it)."""
        return self.engine.generate(prompt_ids, self.generator, progress=self.progress, strategy=self.strategy,
                                    pairs=self.buffer)

    def _gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-completion rows [n, k] of this process -> the whole batch's [N, k] (one process: the same)."""
        return rows

    def _reduce_gradients(self) -> None:
        """Sum the policy's gradients over the data-parallel workers (one process: nothing to do)."""

    def _train_drafter(self) -> dict:
        """The drafter's training for this step: ``drafter_steps`` micro-steps after the update."""
        dstats: dict = {}
        if self.drafter_trainer is not None and self.buffer.sequences():
            for _ in range(self.tlt.drafter_steps):
                dstats = self.drafter_trainer.step(self.buffer.sample(self.tlt.drafter_batch))
        return dstats

    def _extra_metrics(self) -> dict:
        return {}

    def _save_extra(self, folder: Path) -> None:
        """Write more files into a checkpoint folder being saved (data-parallel workers: each rank's own state)."""

    # --------------------------------------------------------------------------------------------------- step
    def step(self) -> dict:
        """One RL step; returns its metrics (also appended to :attr:`history`)."""
        args, model = self.args, self.model
        G = args.num_generations
        t_step = time.perf_counter()
        problems = self._next_problems()
        prompt_ids = encode_prompts(problems, self.tokenizer)
        if self.buffer is not None:
            self.buffer.step = self.step_count
        model.eval()
        res = self._rollout(prompt_ids)
        t_rollout = time.perf_counter() - t_step

        t0 = time.perf_counter()
        n = res.num_sequences
        texts = res.texts(self.tokenizer)
        prompts = [problems[i // G].prompt for i in range(n)]
        completions = texts if isinstance(problems[0].prompt, str) else [[{"role": "assistant", "content": t}]
                                                                         for t in texts]
        columns = {"answer": [problems[i // G].answer for i in range(n)],
                   "completion_ids": [res.response_ids(i) for i in range(n)]}
        per_func, rewards = compute_rewards(self.reward_funcs, prompts, completions, columns, args.reward_weights)
        responses = [res.response_ids(i) for i in range(n)]
        counted = torch.tensor([not (args.mask_truncated_completions and t) for t in res.truncated])
        # the whole batch (all workers' completions): advantages, loss normalisation and metrics are global
        rows = self._gather_rows(torch.cat([rewards[:, None].double(), per_func.double(), torch.tensor(
            [[len(r), len(r) * bool(c)] for r, c in zip(responses, counted)], dtype=torch.float64)], 1))
        all_rewards, all_per_func = rows[:, 0].float(), rows[:, 1:-2].float()
        first = self._shard_offset(n)
        advantages = group_advantages(all_rewards, G, args.scale_rewards)[first:first + n].to(self.device)
        n_total, batch_tokens = rows.shape[0], int(rows[:, -1].sum())
        t_reward = time.perf_counter() - t0

        seq_prompts = [prompt_ids[i // G] for i in range(n)]
        lengths = [len(p) + len(r) for p, r in zip(seq_prompts, responses)]
        batches = micro_batches(lengths, args.micro_batch_tokens)
        t0 = time.perf_counter()
        ref_lp = self._policy_logprobs(self.reference, batches, seq_prompts, responses) if self.reference else None
        old_lp = self._policy_logprobs(model, batches, seq_prompts, responses) if args.num_iterations > 1 else None
        t_logprob = time.perf_counter() - t0

        t0 = time.perf_counter()
        model.train()
        stats = torch.zeros(3, dtype=torch.float64)          # loss, kl, clipped tokens (sums over this worker)
        for _ in range(args.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            for k, g in enumerate(batches):
                mb = SequenceBatch.build(seq_prompts, responses, g, self.engine.pad_id, self.device)
                lp = response_logprobs(model, mb, self.sampling, args.logprob_chunk)
                mask = mb.response_mask() & counted[g].to(self.device)[:, None]
                old = old_lp[k] if old_lp is not None else lp.detach()
                per_token, clipped = clipped_token_loss(lp, old, advantages[g], args.epsilon, args.clip_high)
                if ref_lp is not None:
                    kl = kl_k3(lp, ref_lp[k])
                    per_token = per_token + args.beta * kl
                    stats[1] += float((kl.detach() * mask).sum()) / max(batch_tokens, 1) / args.num_iterations
                loss = aggregate_loss(per_token, mask, args.loss_type, n_total, batch_tokens,
                                      args.max_completion_length)
                loss.backward()
                stats[0] += float(loss.detach()) / args.num_iterations
                stats[2] += float((clipped & mask).sum()) / max(batch_tokens, 1) / args.num_iterations
            self._reduce_gradients()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                  args.max_grad_norm if args.max_grad_norm > 0 else float("inf"))
            if not math.isfinite(float(norm)):
                self.optimizer.zero_grad(set_to_none=True)
                raise FloatingPointError(
                    f"RL step {self.step_count + 1}: the policy's gradient norm is {float(norm)} (loss "
                    f"{float(stats[0]):.4g}): the update diverged and was not applied; lower learning_rate (now "
                    f"{args.learning_rate:g}) or set max_grad_norm, and resume from the last checkpoint")
            self.optimizer.step()
        model.eval()
        self.optimizer.zero_grad(set_to_none=True)
        t_update = time.perf_counter() - t0
        stats = self._gather_rows(stats[None]).sum(0)

        t0 = time.perf_counter()
        dstats = self._train_drafter()
        t_drafter = time.perf_counter() - t0

        self.step_count += 1
        update_tokens = sum(lengths) * args.num_iterations
        acc = next((j for j, f in enumerate(self.reward_funcs) if f is accuracy_reward), None)
        m = {"rl/step": self.step_count, "rl/reward_mean": float(all_rewards.mean()),
             "rl/reward_std": float(all_rewards.std()),
             "rl/accuracy": float((all_per_func[:, acc] >= 1.0).float().mean()) if acc is not None else float("nan"),
             "rl/loss": float(stats[0]), "rl/kl": float(stats[1]),
             "rl/clip_frac": float(stats[2]), "rl/grad_norm": float(norm),
             "rl/completion_len_mean": float(rows[:, -2].mean()),
             **{f"rl/reward/{reward_name(f)}": float(np.nanmean(all_per_func[:, j].numpy()))
                for j, f in enumerate(self.reward_funcs)},
             **res.stats, **{k: v for k, v in dstats.items()},
             "drafter/version": float(getattr(self.drafter, "version", 0)),
             "drafter/buffer_pairs": float(self.buffer.num_pairs if self.buffer is not None else 0),
             "update/tokens": float(update_tokens),
             "update/padding_frac": 1 - sum(lengths) / padded_tokens(lengths, batches),
             "update/tokens_per_s": update_tokens / max(t_update, 1e-9),
             "time/rollout_s": t_rollout, "time/reward_s": t_reward, "time/logprob_s": t_logprob,
             "time/update_s": t_update, "time/drafter_s": t_drafter, "time/step_s": time.perf_counter() - t_step,
             **self._extra_metrics()}
        self.history.append(m)
        return m

    @torch.no_grad()
    def evaluate(self, problems, strategy: str | None = "chain-8") -> dict:
        """Held-out accuracy with greedy decoding (``eval/*``). With a drafter the rollout uses ``strategy``
        (speculative decoding is exact at temperature 0, so only the time changes); the tuner learns nothing."""
        engine = RolloutEngine(self.model, RolloutConfig(replace(self.sampling, temperature=0.0), group_size=1),
                               drafter=self.drafter)
        res = engine.generate(encode_prompts(problems, self.tokenizer),
                              strategy=strategy if self.drafter is not None else None)
        texts = res.texts(self.tokenizer)
        return {"eval/accuracy": float(np.mean([accuracy_reward([p.prompt], [t], [p.answer])[0]
                                                for p, t in zip(problems, texts)])),
                "eval/len_mean": float(res.lengths.float().mean())}

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

    # --------------------------------------------------------------------------------------------- checkpoint
    def fingerprint(self) -> dict:
        """What a checkpoint must match to be resumed here (the model's shape, the RL and TLT settings)."""
        args = {k: v for k, v in _config_dict(self.args).items() if k not in ("max_steps", "save_steps")}
        return {"model": self.model.config.to_hf(), "grpo": args, "tlt": _config_dict(self.tlt),
                "drafter": self.drafter is not None, "rewards": [reward_name(f) for f in self.reward_funcs]}

    def save(self, path: str | os.PathLike) -> Path:
        """Write a checkpoint folder atomically (a temporary folder renamed over ``path``; other files there, such
        as the run's metrics.jsonl, are carried over)."""
        from safetensors.torch import save_file

        from .fileio import atomic_folder
        with atomic_folder(path, keep_existing=True) as tmp:
            meta = {"format": CHECKPOINT_FORMAT, "step": self.step_count, "fingerprint": self.fingerprint(),
                    "numpy_rng": self.rng.bit_generator.state, "history": self.history,
                    "controller": self.controller.state_dict() if self.controller is not None else None,
                    "drafter_version": getattr(self.drafter, "version", None),
                    "drafter_steps_done": self.drafter_trainer.steps_done if self.drafter_trainer else None}
            (tmp / "trainer_state.json").write_text(json.dumps(meta, default=float) + "\n")
            save_file({k: v.detach().cpu().contiguous() for k, v in self.model.state_dict().items()},
                      str(tmp / "policy.safetensors"))
            tensors = {"optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state()}
            if self.reference is not None:
                tensors["reference"] = self.reference.state_dict()
            if self.drafter is not None:
                tensors["drafter"] = self.drafter.state_dict()
            if self.drafter_trainer is not None:
                tensors["drafter_optimizer"] = self.drafter_trainer.opt.state_dict()
            if self.buffer is not None:
                tensors["buffer"] = self.buffer.state_dict()
            torch.save(tensors, tmp / "state.pt")
            self._save_extra(tmp)
            digest = hashlib.sha256(json.dumps(meta["fingerprint"], sort_keys=True).encode()).hexdigest()[:16]
            (tmp / "README.md").write_text(f"# tltlib GRPO checkpoint\n\nStep {self.step_count}; configuration "
                                           f"{digest}. Resume with `python -m tltlib train-grpo --params <the file that "
                                           f"started it> --resume {path}`.\n")
        return Path(path)

    def load(self, path: str | os.PathLike) -> "GRPOTrainer":
        """Restore a checkpoint written by :meth:`save` (refused, with the differences named, when it comes from
        another model or configuration)."""
        from safetensors.torch import load_file

        from .fileio import read_json
        path = Path(path)
        state_file = path / "trainer_state.json"
        if not state_file.is_file():
            raise FileNotFoundError(f"{str(path)!r} is not a tltlib GRPO checkpoint (no trainer_state.json); pass "
                                    "the folder written by a run (--output-dir)")
        meta = read_json(state_file, "the checkpoint is damaged: resume from an earlier one")
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{state_file}: format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT!r}")
        mine, theirs = _flatten(self.fingerprint()), _flatten(meta["fingerprint"])
        diff = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        if diff:
            raise ValueError(f"{path} was written by a run with another model or configuration (differs in "
                             f"{', '.join(diff[:6])}); resume with the same model and settings, or start anew "
                             "with another output folder")
        self.model.load_state_dict(load_file(str(path / "policy.safetensors"), device=str(self.device)))
        tensors = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
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
        self.rng.bit_generator.state = meta["numpy_rng"]
        self.step_count, self.history = meta["step"], list(meta["history"])
        return self


def load_weights(path: str | os.PathLike, model, drafter=None) -> dict:
    """Load the policy (and the drafter) of a checkpoint written by :meth:`GRPOTrainer.save` into ``model`` (and
    ``drafter``) without a trainer, e.g. to probe a finished run; returns its ``trainer_state.json``."""
    from safetensors.torch import load_file

    from .fileio import read_json
    path = Path(path)
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a tltlib GRPO checkpoint (no trainer_state.json)")
    meta = read_json(path / "trainer_state.json", "the checkpoint is damaged")
    model.load_state_dict(load_file(str(path / "policy.safetensors"), device=str(model.embed.weight.device)))
    if drafter is not None:
        tensors = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
        if "drafter" not in tensors:
            raise ValueError(f"{path} holds no drafter (the run had none): load the policy only")
        drafter.load_state_dict(tensors["drafter"])
        drafter.version = meta.get("drafter_version") or 0
    return meta
