"""How a rollout runs: :class:`RolloutConfig` (sampling, GRPO group size, compaction, prefill chunks, draft room, the
KV cache and its memory, CUDA graphs, packed weights), the settings of :class:`tltlib.rollout.engine.RolloutEngine`.

Paper: TLT §5 (the rollout engine these settings configure).

Departures: none.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import BadInput
from ..kv.paged import KVConfig
from ..model.cudagraph import GraphConfig
from ..model.sampling import SamplingConfig
from ..spec.strategy import SpecStrategy


@dataclass(frozen=True)
class RolloutConfig:
    """How a rollout runs."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Temperature, top-k, top-p and max_new_tokens."""
    num_generations: int = 1
    """G: responses sampled per prompt (GRPO group size)."""
    compact_fraction: float = 0.125
    """Compact the cache once at least this share of the batch's rows has finished (0 = at every finish)."""
    prefill_rows: int = 64
    """Prompts prefilled per forward (bounds prefill activation memory)."""
    ignore_eos: bool = False
    """Keep generating after EOS until max_new_tokens (benchmarks: every row decodes the same number of tokens)."""
    draft_margin: int = 72
    """Cache slots kept beyond the longest sequence for draft tokens (must exceed a strategy's verify tokens)."""
    graphs: GraphConfig = field(default_factory=GraphConfig)
    """CUDA graphs for the decode, verify and draft forwards of small batches (on CUDA; no effect on a CPU)."""
    kv: KVConfig = field(default_factory=KVConfig)
    """The KV cache: paged (default; pages taken as rows grow, a prompt's pages shared by its G samples) or dense,
    and the memory its pool may take (:class:`tltlib.kv.paged.KVConfig`)."""
    packed_weights: bool = True
    """On a CPU in float32: projections of 3+ rows through oneDNN on a packed copy of the target's weights, kept
    between rollouts and re-made when a weight changed (1.2-2x faster projections for a second copy of the weights;
    :class:`tltlib.kernels.dispatch.WeightPacks`). No effect elsewhere."""
    native_layers: bool = True
    """On a CPU in float32: the target's decode and verify forwards, and the drafter's, run their whole stack of decoder
    layers in one C++ call (:mod:`tltlib.model.native`: the same ATen calls and small ops as the Python layers, the
    same hidden states bit for bit, without the Python between them). Plain decoding of SmolLM2-135M: 1.24x / 1.14x
    / 1.18x faster steps at 1 / 16 / 64 rows (Intel Xeon, 2 threads); notebook 04's rollouts of the tiny reasoner
    1.32x faster without SD and 1.09x with chain-8 SD, which then gains 1.57x over no SD against 1.87x on the Python
    layers (``bench native_rollout``, AMD EPYC, 2 threads; docs/results.md). False: the Python layers (as does
    ``TLTLIB_NATIVE_LAYERS=0``). No effect elsewhere, or where ``compile_layers`` runs the compiled stack. Measure
    the cost model with the same setting (``measure_costs(native_layers=...)``)."""
    compile_layers: bool = False
    """On a CPU: the target's decode and verify forwards run its whole stack of decoder layers compiled by
    ``torch.compile`` into one graph (:mod:`tltlib.model.fused`: the small ops fused by Inductor, the projections and
    the paged attention opaque calls to the kernel table's choices; the weights stay inputs, so GRPO's updates need
    no recompile). The first rollout of a process compiles (about 30 s per shape family for SmolLM2 on 2 cores,
    seconds from the cache later); where compilation is unavailable the eager layers run with one warning. Off by
    default: it gains only a few percent (``python -m tltlib bench decode_breakdown --compile``; docs/results.md).
    No effect on CUDA."""

    def __post_init__(self):
        if self.num_generations < 1:
            raise BadInput(f"num_generations must be >= 1, got {self.num_generations}")
        if not 0 <= self.compact_fraction < 1:
            raise BadInput(f"compact_fraction must be in [0, 1), got {self.compact_fraction}")
        if self.prefill_rows < 1:
            raise BadInput(f"prefill_rows must be >= 1, got {self.prefill_rows}")
        if self.draft_margin < 1:
            raise BadInput(f"draft_margin must be >= 1, got {self.draft_margin}")


def fitting_strategy(name, where: str) -> SpecStrategy:
    """The strategy ``name`` (a name, or a :class:`SpecStrategy`) of the setting ``where``, refused naming it when
    unreadable or larger than the room a rollout's cache leaves for one step's draft (``RolloutConfig.draft_margin``,
    which the GRPO trainers and train-grpo jobs keep at its default): checked where a run is configured, before a
    model loads, not at the rollout's first SD step."""
    if isinstance(name, bool):
        raise BadInput(f"{where} = {name!r}: YAML reads an unquoted off (or on, yes, no) as {name}; write 'off'")
    try:
        st = SpecStrategy.parse(name)
    except BadInput as e:
        raise BadInput(f"{where}: {e}") from None
    room = RolloutConfig.draft_margin - 1
    if st.verify_tokens > room:
        every = " (budget 0: every drafted node)" if st.kind in ("tree", "hybrid") and not st.budget else ""
        raise BadInput(f"{where} = {str(name)!r} verifies {st.verify_tokens} draft tokens per step{every}, more "
                       f"than the rollout's cache leaves room for ({room}): {_smaller(st, room)}")
    return st


def _smaller(st: SpecStrategy, room: int) -> str:
    """How to make ``st`` verify at most ``room`` draft tokens, with an example."""
    if st.kind in ("chain", "ngram"):
        return f"draft at most {room} tokens (e.g. {st.kind}-{min(room, 8)})"
    depth = min(st.depth, 8)
    if st.kind == "suffix":
        return f"give a budget of at most {room} (e.g. suffix-{depth}-{min(room, 16)})"
    return f"give a budget of at most {room} (e.g. {st.kind}-{depth}x{st.branch}-{min(room, 32)})"
