"""The decoder layers' stack in one C++ call (:mod:`tltlib.model.native`): the Python layers' hidden states, logits
and cache writes bit for bit under every projection kernel (packed copies included), decode and masked verify
forwards; the same tokens in rollouts, plain and speculative; where it does not apply, the Python layers; a packed
copy made stale refused, a replaced parameter noticed, the switch honoured, the plans freed."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tltlib.errors import BadInput, Refused
from tltlib.kernels import dispatch
from tltlib.kernels import table as kernel_table
from tltlib.kernels.ragged_attention import kernel
from tltlib.kv.paged import KVConfig
from tltlib.kv.paged_attention import MASKED_KERNEL_MAX_NEW
from tltlib.model import native
from tltlib.model.decoder import ModelConfig, Transformer
from tltlib.model.loading import load
from tltlib.model.sampling import SamplingConfig
from tltlib.rollout.engine import RolloutConfig, RolloutEngine
from tltlib.tasks.chain import ChainTaskConfig, generate_problems
from tltlib.tasks.prompts import encode_prompts

pytestmark = pytest.mark.skipif(kernel() is None, reason="the CPU kernels cannot be built here")


def _model(architecture: str = "qwen2", seed: int = 0) -> Transformer:
    """A random model of three layers (qwen2: q/k/v biases; llama: none) with 9 heads over 3 KV heads, as SmolLM2."""
    cfg = ModelConfig(vocab_size=60, hidden_size=72, intermediate_size=112, num_layers=3, num_heads=9, num_kv_heads=3,
                      architecture=architecture)
    torch.manual_seed(seed)
    return Transformer(cfg).eval()


def _target(model, *args):
    """:func:`native.run_layers` over the target's layers and final norm."""
    return native.run_layers(model, model.layers, model.norm, model.config, *args)


def _run(model, prompts: torch.Tensor, plans, steps: int = 3, verify: int = 3):
    """A prefill of ``prompts``, ``steps`` one-token forwards (feeding back the argmax) and one forward of ``verify``
    tokens, each inside :func:`native.native_layers` (``plans`` None: the Python layers). Returns the hidden states
    and logits of every forward after the prefill and the cache's K/V pages."""
    cache = model.new_cache(prompts.shape[0], prompts.shape[1] + steps + verify + 4)
    out = []
    with torch.no_grad(), native.native_layers(plans):
        logits, _ = model.forward_cached(prompts, cache)
        cache.advance(prompts.shape[1])
        nxt = logits[:, -1].argmax(-1)[:, None]
        for _ in range(steps):
            logits, hidden = model.forward_cached(nxt, cache)
            cache.advance(1)
            out += [hidden, logits]
            nxt = logits[:, -1].argmax(-1)[:, None]
        logits, hidden = model.forward_cached(torch.cat([nxt] * verify, 1), cache)
        out += [hidden, logits]
    return out, cache.k.clone(), cache.v.clone()


@pytest.mark.parametrize("kind", kernel_table.LINEAR_KERNELS)
@pytest.mark.parametrize("rows", [1, 4])
def test_the_cpp_stack_equals_the_python_layers_bit_for_bit(kind, rows):
    """Every projection kernel the table can pick, one and four rows, a model with biases: each decode and verify
    forward's hidden states and logits, and the K/V written, equal the Python layers' exactly; the stack ran (a plan
    per row count: the decodes' and the verify's)."""
    if kind == "mkl-packed" and not dispatch.mkl_packing_available():
        pytest.skip("no MKL packed SGEMM in this torch")
    model = _model()
    prompts = torch.randint(0, 60, (rows, 5), generator=torch.Generator().manual_seed(rows))
    packs = dispatch.pack_weights(model)
    with kernel_table.using(kernel_table.Forced(linear=kind)), dispatch.packed_weights(packs):
        if kind == "mkl-packed":                       # the Python path checks MKL's product first (the stack waits)
            _run(model, prompts, None)
        want, k_want, v_want = _run(model, prompts, None)
        plans = native.NativePlans()
        got, k_got, v_got = _run(model, prompts, plans)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)
    made = {key[-1] for key, plan in plans._plans.items() if plan is not None}
    assert {rows, rows * 3} <= made, made


def test_rollouts_give_the_same_tokens_plain_and_speculative():
    """The shipped tiny reasoner (no biases) and its drafter, greedy, plain and chain-4 SD (verifies through the masked
    kernel), 2 generations of 3 prompts: the same tokens and log-probabilities with the C++ stack as without."""
    model, tok, drafter = load("data/tiny-reasoner", "data/tiny-reasoner-drafter")
    prompts = encode_prompts(generate_problems(ChainTaskConfig(), 3, seed=5), tok)
    config = RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=40), num_generations=2)
    calls = []
    real = native.run_layers

    def counted(model, layers, final_norm, cfg, x, *args):
        out = real(model, layers, final_norm, cfg, x, *args)
        calls.append((type(model).__name__, x.shape[1], out is not None))
        return out

    for strategy in (None, "chain-4"):
        off = RolloutEngine(model, replace(config, native_layers=False), drafter=drafter).generate(
            prompts, strategy=strategy)
        native.run_layers, calls[:] = counted, []
        try:
            on = RolloutEngine(model, replace(config, native_layers=True), drafter=drafter).generate(
                prompts, strategy=strategy)
        finally:
            native.run_layers = real
        assert torch.equal(on.tokens, off.tokens), strategy
        assert torch.equal(on.logprobs, off.logprobs), strategy
        ran = {(who, t) for who, t, native_ran in calls if native_ran}   # decodes, verifies and drafts ran in C++
        want = {("Transformer", 1)} if strategy is None else {("Transformer", 5), ("Drafter", 1), ("Drafter", 5)}
        assert ran == want, ran
        # every one-token forward ran in C++: the chain's drafting steps too, whose rotary tables are slices of the
        # step's (not contiguous with several rows: they once fell back to the Python layer after the first draft)
        python = [(who, t) for who, t, native_ran in calls if t == 1 and not native_ran]
        assert python == [], python


def test_the_drafters_layer_in_cpp_equals_its_python_layer_bit_for_bit():
    """EAGLE's drafter (one layer, no input norm, no final norm) over its own paged cache: a catch-up forward of four
    pairs, then one-pair forwards, each drafted hidden state and logit equal to the Python layer's exactly."""
    model, _, drafter = load("data/tiny-reasoner", "data/tiny-reasoner-drafter")
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 6, model.config.hidden_size, generator=g)
    tokens = torch.randint(0, model.config.vocab_size, (3, 6), generator=g)

    def drafts(plans):
        cache, out = drafter.new_cache(3, 16), []
        with torch.no_grad(), native.native_layers(plans):
            for lo, hi in ((0, 4), (4, 5), (5, 6)):
                logits, h = drafter.forward_cached(hidden[:, lo:hi], tokens[:, lo:hi], cache)
                cache.advance(hi - lo)
                out += [logits, h]
        return out

    plans = native.NativePlans()
    got, want = drafts(plans), drafts(None)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert {key[-1] for key, plan in plans._plans.items() if plan is not None} == {3, 12}


def test_where_it_does_not_apply_the_python_layers_run():
    """None (the Python layers) outside a block, with the switch off, for a dense cache, a forward longer than the
    masked kernel takes (a prefill), and with autograd recording through the weights."""
    model = _model("llama")
    cache = model.new_cache(2, 64)
    x, cos = torch.zeros(2, 1, 72), torch.zeros(2, 1, 1, 8)
    write = cache.prepare(1)
    assert _target(model, x, cos, cos, cache, write) is None                   # no block
    plans = native.NativePlans()
    with native.native_layers(plans), torch.no_grad():
        dense = model.new_cache(2, 16, kv=KVConfig(kind="dense"))
        assert _target(model, x, cos, cos, dense, dense.prepare(1)) is None
        t = MASKED_KERNEL_MAX_NEW + 1
        assert _target(model, torch.zeros(2, t, 72), torch.zeros(2, t, 1, 8), torch.zeros(2, t, 1, 8),
                                 cache, cache.prepare(t)) is None
    with native.native_layers(plans), torch.enable_grad():
        assert _target(model, x, cos, cos, cache, write) is None                # autograd records
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(native.ENV, "0")
        with native.native_layers(plans), torch.no_grad():
            assert _target(model, x, cos, cos, cache, write) is None
        mp.setenv(native.ENV, "maybe")                          # not a setting read as one: one error naming it
        with pytest.raises(BadInput, match="TLTLIB_NATIVE_LAYERS='maybe'"):
            with native.native_layers(plans):
                pass
    with native.native_layers(plans), torch.no_grad():                                   # the control: it runs
        assert _target(model, x, cos, cos, cache, write) is not None


def test_a_stale_packed_copy_is_refused_and_a_replaced_parameter_is_noticed():
    """A weight updated in place after its copy was packed: the forward refuses (as dispatch.linear does), nothing
    half-computed returned. A parameter replaced by another tensor: the next forward makes a new plan and reads it
    (its output equals the Python layers' with the new parameter)."""
    model = _model()
    prompts = torch.randint(0, 60, (2, 4), generator=torch.Generator().manual_seed(3))
    packs = dispatch.pack_weights(model)
    plans = native.NativePlans()
    with kernel_table.using(kernel_table.Forced(linear="packed")), dispatch.packed_weights(packs):
        _run(model, prompts, plans, steps=1)
        with torch.no_grad():
            model.layers[1].mlp.down.weight.mul_(1.5)
        with pytest.raises(Refused, match="changed in place after it was packed"):
            _run(model, prompts, plans, steps=1)
    with kernel_table.using(kernel_table.Forced(linear="linear")):
        before = _run(model, prompts, plans, steps=1)[0]
        model.layers[2].attn.o.weight = torch.nn.Parameter(model.layers[2].attn.o.weight.detach() * 0.5)
        want = _run(model, prompts, None, steps=1)[0]
        got = _run(model, prompts, plans, steps=1)[0]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(before[0], got[0])


def test_closing_the_plans_frees_them():
    """After close, the C++ side holds no plan of them (a call on a dropped handle is an error naming it); a later
    forward makes its plans again."""
    model = _model()
    plans = native.NativePlans()
    _run(model, torch.randint(0, 60, (1, 4)), plans, steps=1)
    handles = list(plans._handles)
    assert handles
    plans.close()
    with pytest.raises(RuntimeError, match="no plan"):
        plans.module.decode_stack(handles[0], *[torch.empty(0)] * 9, 0)
    want = _run(model, torch.randint(0, 60, (1, 4), generator=torch.Generator().manual_seed(1)), None, steps=1)[0]
    got = _run(model, torch.randint(0, 60, (1, 4), generator=torch.Generator().manual_seed(1)), plans, steps=1)[0]
    assert plans._handles and all(torch.equal(a, b) for a, b in zip(got, want))     # usable again after close


def test_rollouts_and_the_cost_model_run_the_layers_in_cpp_by_default():
    """On by default (since a chain's drafting steps run in C++ too, rollouts are faster with and without SD, and SD
    still pays: ``bench native_rollout``), and the cost model the tuner reads is measured the same way unless told
    otherwise."""
    import inspect

    from tltlib.sim.measure import measure_costs
    assert RolloutConfig().native_layers is True
    assert inspect.signature(measure_costs).parameters["native_layers"].default is RolloutConfig().native_layers
