"""The simulator's costs measured on this machine (:class:`tltlib.costs.MeasuredCosts`), held to what is physical.

1. :func:`measure_costs`: target forwards of rows x new tokens after short to long cached contexts, drafter forwards
   of 1 and ``top_k`` nodes per row, timed in two passes over the table; their disagreement is the measurement's
   noise, refused beyond :data:`tltlib.physical.NOISE_LIMIT` ("rerun on a quiet machine"), and the costs must grow
   with rows, context and tokens (a fall within the noise is lifted, beyond it refused).
2. :func:`fit_overheads`: the engine's costs beyond its forwards (sampling, bookkeeping, a rollout's set-up), fitted
   on measured rollouts: a per-iteration overhead that is never negative and does not shrink as rows grow, an SD
   step at least as costly as its forwards, a set-up >= 0 (within the noise; beyond it refused).

Used by :mod:`tltlib.calibrate` (``simulate --validate``).

Departures: none (measurement and fitting).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from .costs import MeasuredCosts, iteration_time
from .kernel_search import ensure as ensure_kernels
from .kernels import pack_weights, packed_weights
from .physical import at_least, check_drift, check_quiet, monotone, nondecreasing_fit, pass_noise, tolerance
from .profiling import call_times
from .speculative import SpecStrategy


@torch.no_grad()
def measure_costs(model, drafter=None, rows=(1, 2, 4, 8, 16, 32, 64, 128), contexts=(32, 256, 768),
                  tokens=(1, 5, 9, 17), widths=(1, 4), repeats=5) -> MeasuredCosts:
    """Seconds of target forwards (``rows`` x ``tokens`` new tokens after each of ``contexts`` cached ones) and of
    drafter forwards (``widths`` nodes per row): in each of two passes over the whole table (the second in the
    opposite order of rows) the median of ``repeats`` after a warm-up; the value is the passes' mean and their
    disagreement the measurement's noise (:func:`tltlib.physical.pass_noise`). Refused (:class:`CalibrationError`,
    "rerun on a quiet machine") when the passes disagree by more than :data:`tltlib.physical.NOISE_LIMIT` or a cost
    falls, beyond the noise, as rows, context or tokens grow; a fall within the noise is lifted (``notes``)."""
    ensure_kernels(model, drafter)                    # the kernels a rollout runs with, chosen before any timing
    g = torch.Generator().manual_seed(0)
    passes = [_cost_pass(model, drafter, rows, contexts, tokens, widths, repeats, order, g) for order in (1, -1)]
    (t1, d1), (t2, d2) = passes
    cells = lambda t, d: np.concatenate([t.ravel(), d.ravel() if drafter is not None else []])   # noqa: E731
    noise = pass_noise(cells(t1, d1), cells(t2, d2))
    check_quiet(noise, "the forward costs")
    tol = tolerance(noise)
    target, notes = monotone((t1 + t2) / 2, [("rows", rows), ("context", contexts), ("tokens", tokens)],
                             "a target forward", tol)
    draft, more = monotone((d1 + d2) / 2, [("rows", rows), ("context", contexts), ("width", widths)],
                           "a draft level", tol) if drafter is not None else (d1, [])
    as_tuple = lambda a: tuple(tuple(tuple(float(v) for v in c) for c in r) for r in a)       # noqa: E731
    return MeasuredCosts(tuple(rows), tuple(contexts), tuple(tokens), as_tuple(target), tuple(widths),
                         as_tuple(draft) if drafter is not None else (), noise=noise, notes=tuple(notes + more))


def _cost_pass(model, drafter, rows, contexts, tokens, widths, repeats: int, order: int, g) -> tuple:
    """One pass of :func:`measure_costs` over the rows in ``order`` (1 or -1): (target ``[rows, contexts, tokens]``,
    draft ``[rows, contexts, widths]``, zeros without a drafter) median seconds."""
    dev, vocab = model.device, model.config.vocab_size
    target = np.zeros((len(rows), len(contexts), len(tokens)))
    draft = np.zeros((len(rows), len(contexts), len(widths)))
    with packed_weights(pack_weights(model)):         # what a CPU rollout runs with (RolloutConfig.packed_weights)
        for i, b in list(enumerate(rows))[::order]:
            for j, ctx in enumerate(contexts):
                cache = model.new_cache(b, ctx + max(tokens) + 1)
                prompt = torch.randint(0, vocab, (b, ctx), generator=g).to(dev)
                _, h = model.forward_cached(prompt, cache, logits_at=torch.full((b,), ctx - 1, device=dev))
                cache.advance(ctx)
                for k, n in enumerate(tokens):
                    x = torch.randint(0, vocab, (b, n), generator=g).to(dev)
                    target[i, j, k] = typical_seconds(lambda x=x: model.forward_cached(x, cache), repeats, dev)
                if drafter is None:
                    continue
                dcache = drafter.new_cache(b, ctx + max(widths) + 1)
                last = torch.full((b,), ctx - 2, device=dev)
                drafter.forward_cached(h[:, :-1], prompt[:, 1:], dcache, logits_at=last)
                dcache.advance(ctx - 1)
                for k, n in enumerate(widths):
                    f = h[:, -1:].expand(b, n, h.shape[-1]).contiguous()
                    x = torch.randint(0, vocab, (b, n), generator=g).to(dev)
                    draft[i, j, k] = typical_seconds(lambda f=f, x=x: drafter.forward_cached(f, x, dcache), repeats, dev)
    return target, draft


def typical_seconds(fn, repeats: int, dev) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after a warm-up call."""
    return float(np.median(call_times(fn, repeats, dev)))


def fit_overheads(costs: MeasuredCosts, rollouts, drift: float = 0.0) -> MeasuredCosts:
    """``costs`` with the engine's costs beyond its forwards fitted to measured rollouts (``(timeline, prompt
    length, seconds, responses)``: ``seconds`` the rollout's wall time, None when unknown), per band of running rows
    (doubling from 1): for plain iterations the median of measured less predicted seconds, smoothed by a
    non-decreasing fit in the rows (weighted by the band's iterations: an engine's bookkeeping does not shrink as
    rows grow); for SD steps the median of measured over predicted; the set-up per response
    (:attr:`MeasuredCosts.setup_s_per_row`) is the median of what each rollout took beyond its prefill and
    iterations (``seconds`` less the timeline's last ``time``) over its ``responses``. A fit without plain
    iterations, SD steps or wall times keeps ``costs``' fit of those.

    Each is held to its physical bound (:func:`tltlib.physical.at_least`, within the noise of ``costs`` or the
    machine's ``drift``, whichever is larger): an overhead >= 0 (measured against the band's forward), an SD step
    >= 1x its forwards, a set-up >= 0; beyond that a :class:`CalibrationError` names the value and asks for a quiet
    machine. ``drift``: how far the machine's speed had moved during the rollouts from its speed while the forwards
    were timed (``|factor - 1|``, the largest over them; :class:`tltlib.calibrate.Drift`): a shared VM a few
    minutes later runs the same forward 10-20% faster or slower, and the fit sees that as overhead; refused above
    :data:`tltlib.physical.NOISE_LIMIT`."""
    check_drift(drift, "the rollouts the engine's costs are fitted on")
    bare = replace(costs, overhead=(), sd_scale=(), setup_s_per_row=0.0, fit_notes=())
    plain, sd, setup, per_response = [], [], [], []
    for timeline, prompt_len, seconds, responses in rollouts:
        gen = 0.0
        for rows, took, name, accepted in zip(timeline["active"], timeline["iter_time"], timeline["strategy"],
                                              timeline["accepted"], strict=True):
            st = SpecStrategy.parse(str(name))
            predicted = iteration_time(bare, rows, prompt_len + gen, st)
            if st.enabled:
                sd.append((rows, took / predicted))
            else:
                plain.append((rows, took - predicted, predicted))
            gen += 1 + (accepted / rows if st.enabled else 0)
        if seconds is not None and len(timeline["time"]):
            setup.append((seconds - float(timeline["time"][-1])) / responses)
            per_response.append(seconds / responses)
    if not plain and not sd:
        raise ValueError("no decode iterations to fit the overhead to: the calibration rollout was empty")
    tol, notes = tolerance(max(costs.noise, drift)), []
    overhead, sd_scale, setup_s = costs.overhead, costs.sd_scale, costs.setup_s_per_row
    if plain:
        xs, ys, counts = _bands([p[:2] for p in plain])
        _, forward, _ = _bands([(p[0], p[2]) for p in plain])
        fitted, why = at_least(nondecreasing_fit(xs, ys, counts), 0.0, forward, tol,
                               "the engine's cost per plain iteration beyond its forward", "s",
                               [f"{x:g} rows" for x in xs])
        overhead, notes = tuple(zip(xs, map(float, fitted))), notes + why
    if sd:
        xs, ys, _ = _bands(sd)
        fitted, why = at_least(ys, 1.0, 1.0, tol, "an SD step's time over its forwards'", "x",
                               [f"{x:g} rows" for x in xs])
        sd_scale, notes = tuple(zip(xs, map(float, fitted))), notes + why
    if setup:
        fitted, why = at_least([float(np.median(setup))], 0.0, [float(np.median(per_response))], tol,
                               "a rollout's set-up per response", "s", ["the fitted rollouts"])
        setup_s, notes = float(fitted[0]), notes + why
    if notes and drift > costs.noise:
        notes.insert(0, f"within the machine's drift of {drift:.0%} between timing the forwards and these rollouts "
                        f"(the passes' noise: {costs.noise:.0%})")
    return replace(bare, overhead=overhead, sd_scale=sd_scale, setup_s_per_row=setup_s, fit_notes=tuple(notes))


def _bands(points) -> tuple[list[float], list[float], list[int]]:
    """Per band of rows doubling from 1: the median rows, the median value and how many ``(rows, value)`` points
    it holds."""
    rows, y = np.asarray(points, dtype=np.float64).T
    band = np.floor(np.log2(rows)).astype(int)
    keys = np.unique(band)
    return ([float(np.median(rows[band == k])) for k in keys], [float(np.median(y[band == k])) for k in keys],
            [int((band == k).sum()) for k in keys])
