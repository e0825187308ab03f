"""Teaching helpers (notebook 02): Leviathan's rule on a toy p and q (the mass it keeps, the residual, draws that
follow p), a response's speculative steps traced on a real prompt, and plain vs speculative samples.

Paper: TLT §5 relies on SD being lossless; these helpers make that visible: the draft tree with the target's and
drafter's probabilities, the accept/reject walk and the residual, then the sample distributions side by side.

Departures: none.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from scipy.stats import chi2_contingency

from ..errors import BadInput
from ..model.sampling import SamplingConfig
from ..rollout.engine import RolloutConfig, RolloutEngine
from ..spec.strategy import OFF, SpecStrategy


def _traced_rollout(target, drafter, prompt: list[int], strategy: SpecStrategy, sampling: SamplingConfig,
                    context_steps: int, max_new_tokens: int, seed: int, ignore_eos: bool = False, what: str = ""):
    """A one-row rollout of the real engine after ``context_steps`` plain iterations (fewer if the response ended),
    its SD steps traced from now on (``rollout.spec.trace`` after each)."""
    if not strategy.enabled:
        raise BadInput(f"{what} needs a speculative strategy (chain or tree), not 'off'")
    if strategy.rule == "block":
        raise BadInput(f"{what} shows token-wise verification, draft by draft; {strategy.name} judges the chain "
                       f"jointly: trace chain-{strategy.depth}")
    cfg = RolloutConfig(SamplingConfig(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                       max_new_tokens=max_new_tokens), ignore_eos=ignore_eos)
    rollout = RolloutEngine(target, cfg, drafter=drafter).start(
        [prompt], torch.Generator(device=target.embed.weight.device).manual_seed(seed))
    for _ in range(context_steps):
        if not rollout.running:
            break
        rollout.iterate(OFF)
    rollout.spec.keep_trace = True
    return rollout


def trace_step(target, drafter, prompt: list[int], strategy: SpecStrategy, sampling: SamplingConfig,
               context_steps: int = 8, seed: int = 0):
    """Decode ``context_steps`` plain iterations after the prompt, then one traced SD step.

    Returns (trace, the response tokens emitted before the step). Uses a one-row rollout of the real engine."""
    rollout = _traced_rollout(target, drafter, prompt, strategy, sampling, context_steps,
                              context_steps + strategy.depth + 2, seed, ignore_eos=True, what="trace_step")
    before = rollout.out_tokens[0, : context_steps + 1].tolist()
    rollout.iterate(strategy)
    return rollout.spec.trace, before


def trace_steps(target, drafter, prompt: list[int], strategy: SpecStrategy, sampling: SamplingConfig,
                context_steps: int = 4, max_steps: int = 24, seed: int = 0) -> list[dict]:
    """One response decoded with ``strategy`` after ``context_steps`` plain iterations, every SD step traced:
    ``[{"step": k, "before": response tokens before it, "trace": SpecTrace}]`` (at most ``max_steps``; one row of the
    real engine). What notebook 02's step-by-step view flips through: no model call once computed."""
    if context_steps < 0 or max_steps < 1:
        raise BadInput(f"trace_steps needs context_steps >= 0 and max_steps >= 1, got {context_steps}, {max_steps}")
    rollout = _traced_rollout(target, drafter, prompt, strategy, sampling, context_steps,
                              context_steps + max_steps * (strategy.depth + 1) + 1, seed, what="trace_steps")
    steps = []
    while rollout.running and len(steps) < max_steps:
        before = rollout.out_tokens[0, : int(rollout.n_gen[0])].tolist()
        rollout.iterate(strategy)
        steps.append({"step": len(steps), "before": before, "trace": rollout.spec.trace})
    return steps


def first_rejection(steps: list[dict]) -> int | None:
    """The index of the first traced step (:func:`trace_steps`) in which the target turned a draft down and drew
    from the residual (not a fully accepted path with its bonus token); None when every step accepted all."""
    return next((i for i, s in enumerate(steps) if not bool(s["trace"].bonus[0])), None)


def toy_pair(tokens: int = 6, seed: int = 0, closeness: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """A target distribution p and a drafter's q over ``tokens`` tokens, q = ``closeness`` p + (1 - ``closeness``) r
    for another random r (1: the drafter is exact, 0: unrelated): the toy of notebook 02's first section.
    Returns float64 ``[tokens]`` arrays that sum to 1."""
    if tokens < 2 or not 0.0 <= closeness <= 1.0:
        raise BadInput(f"toy_pair needs tokens >= 2 and closeness in [0, 1], got {tokens} and {closeness}")
    g = np.random.default_rng(seed)
    p = g.dirichlet(np.full(tokens, 0.8))
    r = g.dirichlet(np.full(tokens, 0.8))
    return p, closeness * p + (1 - closeness) * r


def mass_split(p: np.ndarray, q: np.ndarray) -> dict:
    """How Leviathan's rule splits the target's p ``[V]`` given the drafter's q ``[V]``: ``accepted`` = min(p, q),
    the mass a draft keeps (a draft d is kept with probability min(1, p(d)/q(d)); it was proposed with q(d));
    ``alpha`` = its sum, the chance a draft is kept; ``residual`` = max(0, p - q), the mass the resample after a
    rejection must supply (it draws from ``residual / (1 - alpha)``); ``accepted + residual`` = p exactly."""
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    accepted, residual = np.minimum(p, q), np.maximum(p - q, 0.0)
    return {"accepted": accepted, "residual": residual, "alpha": float(accepted.sum())}


def toy_speculative_draws(p: np.ndarray, q: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    """``n`` tokens drawn the speculative way: a draft d ~ q, kept with probability min(1, p(d)/q(d)), else a token
    from the residual norm(max(0, p - q)). Their distribution is p (the notebook's check of :func:`mass_split`)."""
    g = np.random.default_rng(seed)
    split = mass_split(p, q)
    d = g.choice(len(q), size=n, p=np.asarray(q) / np.sum(q))
    keep = g.random(n) * np.asarray(q)[d] < np.asarray(p)[d]
    out = d.copy()
    if split["alpha"] < 1.0 and (~keep).any():
        out[~keep] = g.choice(len(p), size=int((~keep).sum()), p=split["residual"] / split["residual"].sum())
    return out


def sample_categories(target, drafter, prompts: list[list[int]], strategy: SpecStrategy, sampling: SamplingConfig,
                      samples: int, key, seed: int = 0, chunk: int = 128, progress: bool = False) -> Counter:
    """Counts of ``key(response_ids)`` over ``samples`` responses per prompt (``strategy`` off = plain), sampled
    ``chunk`` responses per prompt at a time (memory bounded by the chunk, not the sample count), one random stream;
    ``progress``: a bar over the samples."""
    from tqdm.auto import tqdm
    if samples < 1 or chunk < 1:
        raise BadInput(f"sample_categories needs samples >= 1 and chunk >= 1, got {samples} and {chunk}")
    g = torch.Generator(device=target.embed.weight.device).manual_seed(seed)
    counts: Counter = Counter()
    with tqdm(total=samples * len(prompts), desc=f"sampling ({strategy.name})", unit="response",
              disable=not progress) as bar:
        for start in range(0, samples, chunk):
            n = min(chunk, samples - start)
            eng = RolloutEngine(target, RolloutConfig(sampling, num_generations=n), drafter=drafter)
            res = eng.generate(prompts, g, strategy=strategy)
            counts.update(key(res.response_ids(i)) for i in range(res.num_sequences))
            bar.update(res.num_sequences)
            eng.release()                # the chunk's KV pool goes before the next is made
    return counts


def compare_samplers(plain: Counter, spec: Counter, min_count: int = 5):
    """(labels, plain counts, speculative counts, chi-square homogeneity p-value); categories seen fewer than
    ``min_count`` times in total are pooled into ``"other"``."""
    labels = sorted(set(plain) | set(spec), key=lambda k: -(plain[k] + spec[k]))
    keep = [k for k in labels if plain[k] + spec[k] >= min_count]
    rest = [k for k in labels if k not in keep]
    a = [plain[k] for k in keep] + ([sum(plain[k] for k in rest)] if rest else [])
    b = [spec[k] for k in keep] + ([sum(spec[k] for k in rest)] if rest else [])
    names = [str(k) for k in keep] + (["other"] if rest else [])
    table = np.array([a, b])
    table = table[:, table.sum(0) > 0]
    pvalue = float(chi2_contingency(table)[1]) if table.shape[1] > 1 else 1.0
    return names, a, b, pvalue
