"""Teaching helpers (notebook 02): one speculative step traced on a real prompt, and plain vs speculative samples.

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


def trace_step(target, drafter, prompt: list[int], strategy: SpecStrategy, sampling: SamplingConfig,
               context_steps: int = 8, seed: int = 0):
    """Decode ``context_steps`` plain iterations after the prompt, then one traced SD step.

    Returns (trace, the response tokens emitted before the step). Uses a one-row rollout of the real engine."""
    if not strategy.enabled:
        raise BadInput("trace_step needs a speculative strategy (chain or tree), not 'off'")
    cfg = RolloutConfig(SamplingConfig(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                       max_new_tokens=context_steps + strategy.depth + 2), ignore_eos=True)
    rollout = RolloutEngine(target, cfg, drafter=drafter).start(
        [prompt], torch.Generator(device=target.embed.weight.device).manual_seed(seed))
    for _ in range(context_steps):
        rollout.iterate(OFF)
    before = rollout.out_tokens[0, : context_steps + 1].tolist()
    rollout.spec.keep_trace = True
    rollout.iterate(strategy)
    return rollout.spec.trace, before


def sample_categories(target, drafter, prompts: list[list[int]], strategy: SpecStrategy, sampling: SamplingConfig,
                      samples: int, key, seed: int = 0) -> Counter:
    """Counts of ``key(response_ids)`` over ``samples`` responses per prompt (``strategy`` off = plain)."""
    eng = RolloutEngine(target, RolloutConfig(sampling, num_generations=samples), drafter=drafter)
    res = eng.generate(prompts, torch.Generator(device=target.embed.weight.device).manual_seed(seed),
                       strategy=strategy)
    return Counter(key(res.response_ids(i)) for i in range(res.num_sequences))


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
