"""What a :class:`tltlib.rollout.engine.RolloutEngine` keeps between rollouts: the device buffers of a rollout (the
target's KV cache, the SD state with the drafter's cache and backlog, the CUDA graphs replaying its forwards) and, on a
CPU, the target's weights packed for oneDNN (:class:`tltlib.kernels.dispatch.WeightPacks`).

Buffers are kept with CUDA graphs (graphs hold their addresses) and on a CPU (allocating and zeroing them costs a
rollout of the tiny reasoner ~1%), not on a GPU without graphs; packs only on a CPU in float32 (re-made when a
weight changed; one copy shared by every engine over the same model). :meth:`Kept.release` frees both.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

from ..errors import Refused
from ..kernels.dispatch import WeightPacks
from ..kernels.ragged_attention import kernel as ragged_kernel
from ..kernels.search import ensure as ensure_kernels
from ..kv.paged import KVConfig
from ..model.cudagraph import GraphPool, Replay
from ..spec.step import SpecDecoder


@dataclass
class Workspace:
    """A rollout's device buffers: the target's KV cache, the SD state (the drafter's cache and backlog) and the
    :class:`~tltlib.model.cudagraph.Replay` every graphed forward goes through (with its CUDA graphs)."""

    cache: object
    spec: SpecDecoder
    replay: Replay


def kv_share(model, drafter=None) -> float:
    """The target cache's share of the KV budget: the budget is split in proportion to the caches' bytes per token
    (layers x KV heads x head width x element size), so that both hold as many tokens (1.0 without a drafter)."""
    if drafter is None:
        return 1.0
    target = model.config.num_layers * model.embed.weight.element_size()
    draft = drafter.fc.weight.element_size()                     # one layer, the target's KV heads and width
    return target / (target + draft)


def kv_budgets(kv: KVConfig, model, drafter=None) -> tuple[int, int]:
    """The KV budget's bytes for the target's cache and the drafter's (0 without one), split by :func:`kv_share`."""
    total = kv.budget_bytes(model.device)
    target = int(total * kv_share(model, drafter))
    return target, total - target


class Kept:
    """The workspace and packed weights of one :class:`~tltlib.rollout.engine.RolloutEngine` (its model, drafter and
    config are read from the engine at every rollout)."""

    def __init__(self, engine):
        self.engine = engine
        self._workspace: tuple | None = None      # (key, Workspace, weakref to its rollout)
        self.packs = WeightPacks.of(engine.model)  # shared by every engine over this model
        if engine.model.device.type == "cpu":
            ragged_kernel()                       # built or loaded now (once per process), not in the first rollout
            ensure_kernels(engine.model, engine.drafter, measure=None)   # the table as measured (or env)

    def weight_packs(self) -> dict | None:
        """The packed weights a rollout runs with (re-packed when the weights changed), or None."""
        e = self.engine
        if self.packs.module is not e.model:
            raise Refused("RolloutEngine.model was replaced after the engine was made: make a new engine")
        return self.packs.current() if e.config.packed_weights and e.model.device.type == "cpu" else None

    def workspace(self, owner, rows: int, max_len: int) -> Workspace:
        """The target's KV cache and the SD state (with the forward runner) for the rollout ``owner`` of ``rows``
        rows of at most ``max_len`` tokens.

        With CUDA graphs, and on a CPU, they are kept for the next rollout of the same shape (graphs hold the
        buffers' addresses; ``max_len`` is rounded up to a multiple of 256 so that rollouts of similar prompts share
        them), unless the rollout that holds them is still running: :meth:`release` frees that memory (e.g. before
        a training update). On a CPU a kept workspace of the same rows and at least ``max_len`` serves too (attention
        reads only the used span): fresh buffers cost their first touch, 0.2-1.5 s of a 3 s tiny-reasoner rollout of
        128 rows on this VM, so a rollout of shorter responses after a longer one must not re-allocate."""
        model, cfg, drafter = self.engine.model, self.engine.config, self.engine.drafter
        graphs = cfg.graphs.active(model.device)
        keep = graphs or model.device.type == "cpu"
        if keep:
            max_len = -(-max_len // 256) * 256
            weights = (model.embed.weight.data_ptr(),
                       None if drafter is None else drafter.fc.weight.data_ptr())
            key = (rows, max_len, id(drafter), weights, model.embed.weight.dtype)
            kept = self._workspace
            holder = kept[2]() if kept is not None else None
            # the same rows, drafter, weights and dtype, and room enough (exactly as much for graphs)
            fits = kept is not None and kept[0][0] == key[0] and kept[0][2:] == key[2:] and (
                kept[0][1] == max_len or not graphs and kept[0][1] > max_len)
            if fits and (holder is None or holder.done):
                key = kept[0]
                ws = kept[1]
                ws.cache.reset(rows)
                ws.spec.reset(rows)
                self._workspace = (key, ws, weakref.ref(owner))
                return ws
            if holder is None or holder.done:
                self._workspace = None            # free the old buffers before allocating new ones
        target_bytes, drafter_bytes = kv_budgets(cfg.kv, model, drafter)
        cache = model.new_cache(rows, max_len, cfg.kv, target_bytes)
        replay = Replay()
        spec = SpecDecoder(model, drafter, cfg.sampling, rows, max_len, max_emit=cfg.draft_margin, replay=replay,
                           kv=cfg.kv, budget_bytes=drafter_bytes)
        if graphs:
            replay.pool = GraphPool([cache] + ([spec.cache] if spec.cache is not None else []), cfg.graphs)
        ws = Workspace(cache, spec, replay)
        if keep and self._workspace is None:
            self._workspace = (key, ws, weakref.ref(owner))
        return ws

    def release(self, keep_graphs: bool = False) -> None:
        """Free the packed weights and the kept buffers (``keep_graphs``: not buffers that CUDA graphs replay,
        which would have to be captured again)."""
        if not (keep_graphs and self._workspace is not None and self._workspace[1].replay.pool is not None):
            self._workspace = None
        self.packs.clear()
