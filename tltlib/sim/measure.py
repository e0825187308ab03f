"""The cost model measured on this machine (:class:`tltlib.sim.costs.MeasuredCosts`), held to what is physical: one
measurement for the adaptive engine's tuner and for the simulator.

1. :func:`measure_costs`: target forwards of rows x new tokens after short to long cached contexts, drafter forwards
   of 1 and a tree's ``branch`` nodes per row and a catch-up over a backlog, a plain forward at unequal lengths. The
   tuner's measurement (one pass, when a trainer or a notebook builds the adaptive controller) lifts a cell below its
   neighbour; the simulator's calibration (two passes) takes their disagreement as the noise, refused beyond
   :data:`tltlib.sim.physical.NOISE_LIMIT` ("rerun on a quiet machine"), and the costs must grow with rows, context
   and tokens (a fall within the noise is lifted, beyond it refused).
2. :func:`fit_overheads`: the engine's costs beyond its forwards (sampling, bookkeeping, a rollout's set-up), fitted
   on measured rollouts: a per-iteration overhead that is never negative and does not shrink as rows grow, an SD
   step at least as costly as its forwards, a set-up >= 0 (within the noise; beyond it refused).

Used by :mod:`tltlib.rollout.adaptive` (the tuner) and :mod:`tltlib.lab.calibrate` (``simulate --validate``).

Departures: none (measurement and fitting).
"""
from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np
import torch

from ..errors import BadInput
from ..kernels.dispatch import pack_weights, packed_weights
from ..kernels.search import ensure as ensure_kernels
from ..machine import call_times, device_sync
from ..model import native
from ..model.cudagraph import GraphConfig, GraphPool, Replay, span_bucket
from ..spec.strategy import SpecStrategy
from .costs import MeasuredCosts, iteration_time
from .physical import at_least, check_drift, check_quiet, monotone, nondecreasing_fit, pass_noise, tolerance

CATCH_UP_WIDTH = 64
"""Backlog entries per row of the catch-up :func:`measure_costs` times (wider ones are extrapolated linearly)."""


@torch.no_grad()
def measure_costs(model, drafter=None, rows=None, contexts=(64, 512), tokens=(1, 9, 25), widths=(1, 4),
                  catch_up_width: int = CATCH_UP_WIDTH, repeats: int = 3, passes: int = 1,
                  max_batch: int = 64, graphs: GraphConfig | None = None, progress: bool = False,
                  native_layers: bool = True) -> MeasuredCosts:
    """The cost model of ``model`` (and ``drafter``) on this machine, as the rollout runs them (this machine's
    kernels, the packed weights; on CUDA its graphs, ``graphs``: the rollout's :class:`GraphConfig`, default
    ``RolloutConfig``'s): seconds of target forwards (``rows`` x ``tokens`` new tokens after each of
    ``contexts`` cached ones), of drafter forwards (``widths`` nodes per row), of a drafter catch-up over
    ``catch_up_width`` backlog entries per row and of a one-token forward with the rows at unequal lengths (at the
    first context). Each cell is the median of ``repeats`` calls after a warm-up.

    ``rows`` default: powers of four up to ``max_batch``, and ``max_batch`` itself (the tuner's: make it the SD
    threshold, since rewards are normalised by the plain rate up to there). Contexts are capped by the model's
    positions. With ``passes=2`` (the simulator's calibration) the table is timed twice, the second time in the
    opposite order of rows; the value is the passes' mean and their disagreement the measurement's noise
    (:func:`tltlib.sim.physical.pass_noise`), refused beyond :data:`tltlib.sim.physical.NOISE_LIMIT` ("rerun on a
    quiet machine"), and a cost that falls, beyond the noise, as rows, context or tokens grow is refused too (within
    it, lifted: ``notes``). With one pass (the tuner's, measured when a trainer is built) nothing is refused: a cell
    below its neighbour is lifted to it (the tuner's prior needs no noise bound; no ``notes``). Nothing is committed to
    any cache.

    Where the rollout replays CUDA graphs (``graphs.active(device)``) the target's forwards and the drafter's
    levels are timed as it runs them: through a :class:`~tltlib.model.cudagraph.GraphPool` of ``graphs`` over the
    measurement's caches (captured at the warm-up call, then replayed at the row bucket and the span bucket the
    rollout would use: the caches are as long as that bucket); the catch-up stays eager, as in the rollout. On a CPU
    every forward is a plain call, with the layers in one C++ call where ``native_layers`` (the rollout's
    ``RolloutConfig.native_layers``, on by default in both; :mod:`tltlib.model.native`). ``progress``: a bar over the
    (rows, context) cells of each pass."""
    if passes not in (1, 2):
        raise BadInput(f"passes must be 1 (the tuner's measurement) or 2 (a calibration: the noise), got {passes}")
    ensure_kernels(model, drafter, measure=None)      # the kernels a rollout runs with (as it reads them)
    rows = tuple(rows) if rows is not None else _powers_of_four(max_batch)
    positions = model.config.max_position_embeddings
    contexts = tuple(sorted({min(c, positions - max(*tokens, *widths) - 2) for c in contexts}))
    catch_up_width = max(2, min(catch_up_width, positions - contexts[0] - 2))
    g = torch.Generator().manual_seed(0)
    graphs = graphs if graphs is not None else GraphConfig()
    graphs = graphs if graphs.active(model.device) else None
    from tqdm.auto import tqdm
    with tqdm(total=passes * len(rows) * len(contexts), desc="cost model: timing forwards", unit="cell",
              disable=not progress) as bar:
        runs = [_cost_pass(model, drafter, rows, contexts, tokens, widths, catch_up_width, repeats, order, g,
                           graphs=graphs, bar=bar, native_layers=native_layers)
                for order in (1, -1)[:passes]]
    mean = {k: np.mean([r[k] for r in runs], axis=0) for k in runs[0]}
    cells = lambda r: np.concatenate([r["target"].ravel(), r["draft"].ravel() if drafter is not None else []])  # noqa: E731
    noise = pass_noise(cells(runs[0]), cells(runs[1])) if passes == 2 else 0.0
    if passes == 2:
        check_quiet(noise, "the forward costs")
    tol = tolerance(noise) if passes == 2 else math.inf
    target, notes = monotone(mean["target"], [("rows", rows), ("context", contexts), ("tokens", tokens)],
                             "a target forward", tol)
    draft, more = monotone(mean["draft"], [("rows", rows), ("context", contexts), ("width", widths)],
                           "a draft level", tol) if drafter is not None else (None, [])
    nested = lambda a: tuple(tuple(tuple(float(v) for v in c) for c in r) for r in a)       # noqa: E731
    flat = lambda a: tuple(float(v) for v in a)                                             # noqa: E731
    return MeasuredCosts(rows, contexts, tuple(tokens), nested(target), tuple(widths),
                         nested(draft) if drafter is not None else (),
                         catch_up_width=catch_up_width if drafter is not None else 0,
                         catch_up_s=flat(mean["catch_up"]) if drafter is not None else (),
                         ragged_s=flat(mean["ragged"]), noise=noise,
                         notes=tuple(notes + more) if passes == 2 else ())


def _powers_of_four(max_batch: int) -> tuple:
    """1, 4, 16, ... up to ``max_batch``, and ``max_batch`` itself."""
    out = [4 ** i for i in range(int(math.log(max(1, max_batch), 4) + 1e-9) + 1)]
    return tuple(out + ([max_batch] if out[-1] < max_batch else []))


def _cost_pass(model, drafter, rows, contexts, tokens, widths, catch_up_width: int, repeats: int, order: int,
               g, graphs: GraphConfig | None = None, bar=None, native_layers: bool = True) -> dict:
    """One pass of :func:`measure_costs` over the rows in ``order`` (1 or -1): median seconds of ``target`` ``[rows,
    contexts, tokens]``, ``draft`` ``[rows, contexts, widths]`` (zeros without a drafter), ``catch_up`` and
    ``ragged`` ``[rows]``; with ``graphs``, the forwards replayed as the rollout's (:func:`replay_over`)."""
    dev, vocab = model.device, model.config.vocab_size
    out = {"target": np.zeros((len(rows), len(contexts), len(tokens))),
           "draft": np.zeros((len(rows), len(contexts), len(widths))),
           "catch_up": np.zeros(len(rows)), "ragged": np.zeros(len(rows))}
    # what a CPU rollout runs with (RolloutConfig.packed_weights, .native_layers); the plans freed at the end
    plans = native.NativePlans() if native_layers and dev.type == "cpu" else None
    with packed_weights(pack_weights(model)), native.native_layers(plans):
        for i, b in list(enumerate(rows))[::order]:
            for j, ctx in enumerate(contexts):
                cache = model.new_cache(b, cache_length(ctx + max(tokens) + 1, graphs))
                prompt = torch.randint(0, vocab, (b, ctx), generator=g).to(dev)
                h = prefill(lambda x, at: model.forward_cached(x, cache, logits_at=at)[1], prompt, cache.advance)
                forward, replay = (lambda t: model.forward_cached(t, cache)), replay_over([cache], graphs)
                for k, n in enumerate(tokens):
                    x = torch.randint(0, vocab, (b, n), generator=g).to(dev)
                    out["target"][i, j, k] = typical_seconds(lambda x=x: replay("target", forward, cache, n, x),
                                                             repeats, dev)
                if j == 0:
                    out["ragged"][i] = out["target"][i, 0, 0] * _ragged_ratio(
                        lambda x: replay("target", forward, cache, 1, x), cache, b, vocab, g, dev, 4 * repeats)
                if drafter is not None:
                    out["draft"][i, j], wide = _draft_costs(drafter, h, prompt, vocab, ctx, widths,
                                                            catch_up_width if j == 0 else 0, repeats, g, graphs)
                    if j == 0:
                        out["catch_up"][i] = wide
                if bar is not None:
                    bar.update()
    if plans is not None:
        plans.close()
    return out


def _draft_costs(drafter, h, prompt, vocab: int, ctx: int, widths, catch_up_width: int, repeats: int, g,
                 graphs: GraphConfig | None = None) -> tuple:
    """(median seconds of a drafter forward of each of ``widths`` nodes per row, and of a catch-up over
    ``catch_up_width`` entries per row with logits at the last only; 0 when ``catch_up_width`` is 0) after ``ctx``
    cached positions; tokens drawn from the target's ``vocab``. With ``graphs`` the widths' forwards are replayed
    (the rollout's drafts are graphed), the catch-up runs eagerly (as the rollout's)."""
    b, dev = prompt.shape[0], prompt.device
    dcache = drafter.new_cache(b, cache_length(ctx + max(max(widths), catch_up_width) + 1, graphs))
    features = h[:, :-1]
    prefill(lambda x, at, s: drafter.forward_cached(features[:, s:s + x.shape[1]], x, dcache, logits_at=at),
            prompt[:, 1:], dcache.advance, with_start=True)
    replay, level = replay_over([dcache], graphs), (lambda f, x: drafter.forward_cached(f, x, dcache))

    def timed(n: int, last_only: bool = False) -> float:                   # n tokens per row
        f = h[:, -1:].expand(b, n, h.shape[-1]).contiguous()
        x = torch.randint(0, vocab, (b, n), generator=g).to(dev)
        if last_only:
            at = torch.full((b,), n - 1, device=dev)
            return typical_seconds(lambda: drafter.forward_cached(f, x, dcache, logits_at=at), repeats, dev)
        return typical_seconds(lambda: replay("draft", level, dcache, n, f, x), repeats, dev)
    return [timed(n) for n in widths], (timed(catch_up_width, last_only=True) if catch_up_width else 0.0)


PREFILL_CHUNK = 64
"""Tokens per row of each forward that fills a measurement's cache: the attention scores of one forward over a whole
512-token context at 128 rows take ~1.6 GB (notebook 04's cost model peaked at 2.0 GB RSS, 1.2 GB in chunks of 64);
what is timed after is the same whatever the chunking."""


def prefill(forward, tokens: torch.Tensor, advance, chunk: int = PREFILL_CHUNK, with_start: bool = False):
    """Fill a cache with ``tokens`` ``[B, N]`` in chunks of ``chunk`` per row: ``forward(x, logits_at)`` (or
    ``forward(x, logits_at, start)`` with ``with_start``) over each ``[B, <= chunk]`` piece, logits at its last
    token only, then ``advance(n)`` commits it. Returns the forwards' outputs joined along the tokens (``[B, N, ...]``
    when they are tensors), for the drafter's features."""
    b, n = tokens.shape
    outs = []
    for s in range(0, n, chunk):
        x = tokens[:, s:s + chunk]
        at = torch.full((b,), x.shape[1] - 1, device=tokens.device)
        outs.append(forward(x, at, s) if with_start else forward(x, at))
        advance(x.shape[1])
    return torch.cat(outs, 1) if isinstance(outs[0], torch.Tensor) else outs


def cache_length(needed: int, graphs: GraphConfig | None) -> int:
    """Slots of a measurement's cache that must hold ``needed``: ``needed``, or with ``graphs`` the span bucket
    that holds them (:func:`~tltlib.model.cudagraph.span_bucket`), the span a rollout's graph of these slots
    attends over whenever its cache is that long."""
    return needed if graphs is None else span_bucket(needed, max(2 * needed, graphs.min_span), graphs.min_span)


def replay_over(caches, graphs: GraphConfig | None) -> Replay:
    """The door a measured forward goes through, as in the rollout (:class:`~tltlib.model.cudagraph.Replay`): a
    plain call without ``graphs``; with them a :class:`~tltlib.model.cudagraph.GraphPool` of ``graphs`` over
    ``caches`` (captured on CUDA at the first call, replayed afterwards)."""
    return Replay(GraphPool(caches, graphs) if graphs is not None else None)


def _ragged_ratio(forward, cache, b: int, vocab: int, g, dev, repeats: int) -> float:
    """How much longer a one-token ``forward(tokens)`` over ``cache`` takes with its ``b`` rows 0-2 positions apart
    than with them at one length (the fastest of ``repeats`` each, interleaved: a difference of a few percent); the
    cache is left as it was."""
    if b == 1:
        return 1.0
    spread = (torch.arange(b) % 3).to(dev)
    x = torch.randint(0, vocab, (b, 1), generator=g).to(dev)
    sync = device_sync(dev)
    best = {False: min(call_times(lambda: forward(x), 1, dev)), True: math.inf}   # the warm-up: call_times' own
    for _ in range(repeats):
        for uneven in (True, False):
            cache.advance(spread if uneven else 0)                   # a tensor advance re-reads the exact bounds
            sync()
            t = time.perf_counter()
            forward(x)
            sync()
            best[uneven] = min(best[uneven], time.perf_counter() - t)
            cache.advance(-spread if uneven else 0)
    return best[True] / best[False]


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

    Each is held to its physical bound (:func:`tltlib.sim.physical.at_least`, within the noise of ``costs`` or the
    machine's ``drift``, whichever is larger): an overhead >= 0 (measured against the band's forward), an SD step
    >= 1x its forwards, a set-up >= 0; beyond that a :class:`CalibrationError` names the value and asks for a quiet
    machine. ``drift``: how far the machine's speed had moved during the rollouts from its speed while the forwards
    were timed (``|factor - 1|``, the largest over them; :class:`tltlib.lab.calibrate.Drift`): a shared VM a few
    minutes later runs the same forward 10-20% faster or slower, and the fit sees that as overhead; refused above
    :data:`tltlib.sim.physical.NOISE_LIMIT`."""
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
        raise BadInput("no decode iterations to fit the overhead to: the calibration rollout was empty")
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
