"""Is SD lossless here: the check's four tests on the user's model, drafter and sampling settings.

1. Greedy identity: plain and speculative greedy decoding emit the same tokens (a difference is a failure unless
   the target's top two logits at that position are a float tie).
2. χ² of the first response tokens' joint, prompt by prompt, speculative against plain sampling.
3. The response-length distribution with and without SD (a two-sample test).
4. The rollout's sampling log-probs against the training forward's.

Paper: TLT §5 (the adaptive rollout engine must not change the RL result); Leviathan et al. (exact rejection).
Departures: none.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from scipy.stats import ks_2samp, mannwhitneyu

from ...errors import Refused
from ...kv.paged import KVConfig
from ...kv.pages import kv_bytes_per_token
from ...model.logprobs import SequenceBatch, response_logprobs
from ...model.sampling import SamplingConfig, probs_from_logits
from ...rollout.engine import RolloutConfig, RolloutEngine
from ...spec.strategy import FixedStrategy, SpecStrategy
from ..explain import compare_samplers
from .config import CheckConfig, Verdict

LOGPROB_TOL = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}
"""Largest |rollout log-prob - training forward's| accepted, by the model's dtype (kernels differ, sums differ)."""
TIE_TOL = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}
"""Top-two logit margin under which a greedy difference is a float tie, not a loss."""


def engine(model, drafter, sampling: SamplingConfig, strategy: SpecStrategy | None, num_generations: int,
           ignore_eos: bool = False, kv_tokens: int = 0) -> RolloutEngine:
    """A rollout engine for ``strategy`` (the drafter only when it drafts with it); ``kv_tokens``: the tokens its
    paged KV pool holds (0: the engine's default budget, as large as a dense cache of its rows)."""
    drafter = drafter if strategy is not None and strategy.uses_drafter else None
    kv = KVConfig()
    if kv_tokens:
        c, elem = model.config, model.embed.weight.element_size()
        layers = c.num_layers + (1 if drafter is not None else 0)
        kv = KVConfig(memory=max(2, kv_tokens * kv_bytes_per_token(layers, c.num_kv_heads, c.dim_head, elem)))
    cfg = RolloutConfig(sampling, num_generations=num_generations, ignore_eos=ignore_eos, kv=kv)
    return RolloutEngine(model, cfg, drafter=drafter)


def generate(eng: RolloutEngine, prompts, strategy: SpecStrategy | None, seed: int, progress: bool = False):
    """One rollout of ``prompts`` on ``eng`` with ``strategy`` at every decode iteration (None: plain)."""
    g = torch.Generator(device=eng.model.embed.weight.device).manual_seed(seed)
    return eng.generate(prompts, g, strategy=FixedStrategy(strategy) if strategy is not None else None,
                        progress=progress)


def rollout(model, drafter, prompts, sampling: SamplingConfig, strategy: SpecStrategy | None, num_generations: int,
            seed: int, ignore_eos: bool = False, progress: bool = False):
    """One rollout of ``prompts`` (``num_generations`` each) with ``strategy`` at every decode iteration (None:
    plain); ``progress``: a bar over its decode iterations."""
    eng = engine(model, drafter, sampling, strategy, num_generations, ignore_eos)
    try:
        return generate(eng, prompts, strategy, seed, progress)
    finally:
        eng.release()                 # its KV pool now, not when a garbage collection finds the engine's cycle


def _ran_sd(sd_steps: float, what: str) -> None:
    if not sd_steps:
        raise Refused(f"check: the speculative arm of the {what} ran no SD step (every response ended at its first "
                      "token?); give longer responses (--max-new-tokens) or other prompts")


def first_difference(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """(row, position) of the first token where two lists of responses differ (a shorter response differs where
    it ends), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        for j in range(max(len(x), len(y))):
            if j >= len(x) or j >= len(y) or x[j] != y[j]:
                return i, j
    return None


def top_two_margin(model, tokens: list[int]) -> float:
    """The gap between the target's two largest logits after ``tokens`` (a float tie when tiny)."""
    with torch.no_grad():
        h = model.hidden_states(torch.tensor([tokens], device=model.embed.weight.device))[0, -1]
        logits = (h @ model.head_weight.T).float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def greedy_identity(model, drafter, prompts, strategy: SpecStrategy, cfg: CheckConfig) -> Verdict:
    """Plain vs speculative greedy decoding of ``cfg.greedy_tokens`` per prompt: the same tokens, or a failure
    naming the first row and position that differ (a tie of the top two logits there is reported, not failed)."""
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=cfg.greedy_tokens)
    plain = rollout(model, drafter, prompts, greedy, None, 1, cfg.seed)
    spec = rollout(model, drafter, prompts, greedy, strategy, 1, cfg.seed)
    _ran_sd(spec.stats.get("spec/steps", 0), "greedy identity test")
    a = [plain.response_ids(i) for i in range(plain.num_sequences)]
    b = [spec.response_ids(i) for i in range(spec.num_sequences)]
    diff = first_difference(a, b)
    numbers = {"rows": len(a), "tokens": sum(map(len, a)), "sd_steps": spec.stats["spec/steps"]}
    if diff is None:
        return Verdict("lossless", "greedy identity", "pass",
                       f"{numbers['tokens']} greedy tokens of {len(a)} prompts identical with {strategy.name}", numbers)
    row, pos = diff
    margin = top_two_margin(model, list(prompts[row]) + a[row][:pos])
    numbers.update(row=row, position=pos, top_two_margin=margin)
    tie = margin < TIE_TOL.get(model.embed.weight.dtype, 1e-3)
    return Verdict("lossless", "greedy identity", "pass" if tie else "fail",
                   f"prompt {row} differs at token {pos} with {strategy.name}: " + (
                       f"a float tie (top-two logit margin {margin:.1e}), not a loss" if tie else
                       f"the target's choice there leads by {margin:.3f} logits: SD changed a greedy output"), numbers)


def entropies(model, prompt: list[int], response: list[int], sampling: SamplingConfig) -> torch.Tensor:
    """``[len(response)]`` entropy (nats) of the sampling distribution each response token was drawn from."""
    ids = torch.tensor([list(prompt) + list(response)], device=model.embed.weight.device)
    with torch.no_grad():
        h = model.hidden_states(ids)[0, len(prompt) - 1: -1]
        p = probs_from_logits((h @ model.head_weight.T).float(), sampling.temperature, sampling.top_k, sampling.top_p)
    return -(p * p.clamp_min(1e-30).log()).sum(-1)


def entropic_contexts(model, rows, sampling: SamplingConfig, k: int, windows: int = 1) -> list[list[int]]:
    """Per (prompt, response) row, up to ``windows`` contexts: the prompt and the response's head up to where its
    next ``k`` tokens (the second to the k-th of them decided by SD steps) carry the most entropy, the windows apart
    from each other: where a sampler's error shows. A row shorter than ``k + 1`` tokens gives its prompt alone."""
    out = []
    for prompt, response in rows:
        if len(response) <= k:
            out.append(list(prompt))
            continue
        ent = entropies(model, prompt, response, sampling)
        score = ent.unfold(0, k - 1, 1).sum(-1)[: len(response) - k + 1].clone()   # j: tokens j+1 .. j+k-1
        for _ in range(windows):
            j = int(score.argmax())
            if score[j] == -float("inf"):
                break
            out.append(list(prompt) + list(response[:j]))
            score[max(0, j - k): j + k] = -float("inf")
    return out


LOGITS_BYTES = 1 << 27
"""The most bytes of verify logits one rollout of the χ² test may hold (its rows are chunked to fit)."""


def first_tokens_chi2(model, drafter, contexts, strategy: SpecStrategy, cfg: CheckConfig,
                      max_rows: int | None = None) -> Verdict:
    """χ² homogeneity test of (context, first ``cfg.first_tokens`` tokens) between ``cfg.samples`` plain and
    speculative samples per context, at the user's sampling settings (rare outcomes pooled per the test's rule).
    ``contexts``: prompts, or prompts with a response's head (:func:`entropic_contexts`). The samples are drawn in
    rollouts of at most ``max_rows`` rows (default: what keeps a verify's logits under :data:`LOGITS_BYTES`; a real
    model's logits and KV cache for a thousand rows at once do not fit a CPU's memory)."""
    s = SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p, max_new_tokens=cfg.first_tokens)
    if max_rows is None:
        max_rows = LOGITS_BYTES // (4 * model.config.vocab_size * (strategy.verify_tokens + 1))
    per = min(max(1, max_rows // cfg.samples), len(contexts))       # contexts per rollout (its pool: for those)
    count, sd_steps = [Counter(), Counter()], 0
    page = KVConfig().page_size                # a forked row's pages: its new tokens, and a copy of a shared one
    tokens = per * (max(map(len, contexts)) + page) + per * cfg.samples * (2 * page + strategy.verify_tokens + 2)
    engines = [engine(model, drafter, s, strat, cfg.samples, kv_tokens=tokens * 5 // 4) for strat in (None, strategy)]
    for c0 in range(0, len(contexts), per):
        chunk = contexts[c0: c0 + per]
        for arm, strat in enumerate((None, strategy)):
            r = generate(engines[arm], chunk, strat, cfg.seed + 1 + arm + 2 * c0)
            count[arm].update((c0 + i // cfg.samples, tuple(r.response_ids(i))) for i in range(r.num_sequences))
            sd_steps += r.stats.get("spec/steps", 0) if strat is not None else 0
    for eng in engines:
        eng.release()
    _ran_sd(sd_steps, "χ² test")
    labels, _, _, p = compare_samplers(*count)
    n = sum(count[0].values())
    numbers = {"pvalue": p, "samples_per_arm": n, "categories": len(labels), "first_tokens": cfg.first_tokens,
               "sd_steps": sd_steps}
    status = "pass" if p >= cfg.alpha else "fail"
    return Verdict("lossless", "first tokens χ²", status,
                   f"joint of the next {cfg.first_tokens} tokens after {len(contexts)} contexts, {n} samples per arm "
                   f"in {len(labels)} categories: p = {p:.3g}"
                   + ("" if status == "pass" else f" < {cfg.alpha}: SD changes the distribution"), numbers)


def lengths_test(plain, spec, cfg: CheckConfig) -> Verdict:
    """Response lengths of a plain and a speculative rollout of the same prompts: Kolmogorov-Smirnov and
    Mann-Whitney, the smaller p doubled (Bonferroni)."""
    a, b = plain.lengths.cpu().numpy(), spec.lengths.cpu().numpy()
    p_ks = float(ks_2samp(a, b).pvalue)
    p_mw = float(mannwhitneyu(a, b).pvalue) if np.ptp(np.concatenate([a, b])) > 0 else 1.0
    p = min(1.0, 2 * min(p_ks, p_mw))
    numbers = {"pvalue": p, "pvalue_ks": p_ks, "pvalue_mannwhitney": p_mw, "rows_per_arm": int(a.size),
               "mean_plain": float(a.mean()), "mean_sd": float(b.mean()),
               "truncated_plain": float(plain.truncated.mean()), "truncated_sd": float(spec.truncated.mean())}
    status = "pass" if p >= cfg.alpha else "fail"
    return Verdict("lossless", "response lengths", status,
                   f"{a.size} responses per arm, mean {a.mean():.1f} plain vs {b.mean():.1f} SD tokens: p = {p:.3g}"
                   + ("" if status == "pass" else f" < {cfg.alpha}: SD changes the response lengths"), numbers)


def logprobs_test(model, res, sampling: SamplingConfig) -> Verdict:
    """The rollout's sampling log-probs against the training forward's on the same sequences (what GRPO's ratio
    divides by; a mismatch biases every update)."""
    n = res.num_sequences
    prompts = [res.prompt_ids[i // res.num_generations] for i in range(n)]
    responses = [res.response_ids(i) for i in range(n)]
    batch = SequenceBatch.build(prompts, responses, list(range(n)), 0, res.tokens.device)
    with torch.no_grad():
        train = response_logprobs(model, batch, sampling)
    mask = batch.response_mask()
    diff = float((train - res.logprobs[:, : batch.width].to(train))[mask].abs().max()) if mask.any() else 0.0
    tol = LOGPROB_TOL.get(model.embed.weight.dtype, 1e-3)
    numbers = {"max_abs_diff": diff, "tolerance": tol, "tokens": int(mask.sum())}
    return Verdict("lossless", "log-probs", "pass" if diff <= tol else "fail",
                   f"{int(mask.sum())} tokens: rollout vs training forward log-probs differ by at most {diff:.1e} "
                   f"(tolerance {tol:.0e})", numbers)
