"""Kernel choices by measurement on the machine that runs them (tltlib.kernels.table, tltlib.kernels.search): the
chooser picks what a (fake) timer says is fastest and keeps the starting point in a near-tie; a busy machine's
timings choose nothing; every candidate computes the same function, so a model decodes the same tokens whatever the
table picked; a table from another machine or torch is ignored with one warning and measured again; a machine's
table is measured once and read back."""
from __future__ import annotations

import json
import re
import warnings
from dataclasses import replace

import pytest
import torch

from tltlib.errors import BadInput
from tltlib.kernels import dispatch as K
from tltlib.kernels import search as ks
from tltlib.kernels import table as kt
from tltlib.kernels.dispatch import attention_with, linear, linear_with
from tltlib.machine import Machine, this_machine
from tltlib.model.decoder import ModelConfig, Transformer

FAST = ks.SearchConfig(rounds=3, sample_s=1e-5, retries=0, context=16)


@pytest.fixture
def fresh_tables(tmp_path, monkeypatch):
    """A private kernel-table cache and no table loaded in this process (restored after the test)."""
    monkeypatch.setenv("TLTLIB_CACHE", str(tmp_path))
    monkeypatch.delenv(kt.ENV, raising=False)
    monkeypatch.setattr(kt, "_tables", {})
    monkeypatch.setattr(ks, "_attempted", set())
    return tmp_path


def small_model(seed: int = 0) -> Transformer:
    cfg = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                      max_position_embeddings=128, tie_word_embeddings=True, eos_token_ids=(1,))
    torch.manual_seed(seed)
    return Transformer(cfg, init_std=0.3).eval()


def fake_timer(fastest: dict, noise: float = 0.0, seed: int = 0):
    """A timer that never runs the call: ``fastest`` (a kind per table part: "linear" for projections, "attention")
    takes 1 us, every other candidate 2 us (3 us for PyTorch's defaults, so a start that is not fastest loses by
    more than MIN_GAIN); ``noise``: each timing scaled by a uniform factor in [1 - noise, 1 + noise]."""
    g = torch.Generator().manual_seed(seed)

    def timer(name, fn):
        part = "linear" if name in kt.LINEAR_KERNELS else "attention"
        base = 1e-6 if name == fastest.get(part) else 3e-6 if name in ("linear", "sdpa") else 2e-6
        return base * (1 + noise * (2 * float(torch.rand((), generator=g)) - 1))
    return timer


# ---------------------------------------------------------------------------------------------- the chooser
def test_the_chooser_picks_the_fastest_and_keeps_the_starting_point_in_a_near_tie():
    times = lambda **ms: kt.Timing({k: v * 1e-3 for k, v in ms.items()}, {k: 0.01 for k in ms})   # noqa: E731
    every = set(kt.LINEAR_KERNELS)
    assert kt.choose(times(linear=3.0, mm=1.0, packed=2.0), every, "packed") == "mm"
    assert kt.choose(times(linear=3.0, mm=1.0, packed=1.02), every, "packed") == "packed"     # within 3%: kept
    assert kt.choose(times(linear=3.0, mm=1.0, packed=1.05), every, "packed") == "mm"        # 5% faster: replaced
    assert kt.choose(times(linear=3.0, mm=1.0, packed=0.5), every - {"packed"}, "mm") == "mm"  # not available
    assert kt.choose(times(linear=3.0), {"mm"}, "mm") is None                     # nothing measured: the default
    noisy = kt.Timing({"linear": 3e-3, "mm": 1e-3}, {"linear": 0.01, "mm": 0.6})
    assert kt.choose(noisy, every, "linear") is None                              # the pick spread 60%: no choice


def test_a_cell_is_timed_in_interleaved_rounds_after_a_warm_up():
    calls, order = {"a": 0, "b": 0}, []

    def fn(name):
        return lambda: calls.__setitem__(name, calls[name] + 1)
    timing = ks.measure_cell({"a": fn("a"), "b": fn("b")},
                             lambda name, f: order.append(name) or {"a": 2.0, "b": 1.0}[name], FAST)
    assert calls == {"a": 1, "b": 1}                        # the warm-up runs each; the fake timer runs nothing
    assert order == ["a", "b", "b", "a", "a", "b"]          # rotated each round
    assert timing.seconds == {"a": 2.0, "b": 1.0} and timing.spread == {"a": 0.0, "b": 0.0}


def test_the_search_over_a_model_picks_what_the_timer_says_is_fastest(fresh_tables):
    model = small_model()
    # without a packed copy at hand (or the ragged kernel for several queries) the rest cost 2 us but PyTorch's
    # defaults 3 us: the starting point stays where it is one of the 2 us ones, else the fastest (mm) replaces it
    unpacked = {1: "mm-pad", 2: "mm", 5: "mm", 64: "mm", 300: "mm", 5000: "mm"}
    for want_linear, want_attention in (("mm", "matmul"), ("packed", "ragged"), ("linear", "sdpa"),
                                        ("mkl-packed", "sdpa")):
        if want_attention == "ragged" and ks.ragged_kernel() is None:
            continue
        if want_linear == "mkl-packed" and not K.mkl_packing_available():
            continue
        lin, att = ks.search(model, None, timer=fake_timer({"linear": want_linear, "attention": want_attention}),
                             config=FAST, progress=False)
        table = kt.KernelTable(this_machine(), lin, att)
        assert table.noisy() == []
        for (n, k) in ks.projection_weights(model):
            for rows in unpacked:
                assert table.linear_kernel(n, k, rows, packed=True) == want_linear
                assert table.linear_kernel(n, k, rows, packed=False) == (
                    want_linear if want_linear not in kt.PACKED else unpacked[rows])
        for rows, queries, ragged in ((1, 1, False), (40, 1, True), (8, 5, True)):
            got = table.attention_kernel(4, 2, 8, queries, rows, ragged, kernel=True)
            assert got == (want_attention if want_attention != "ragged" or queries == 1 else "matmul")
        assert table.attention_kernel(4, 2, 8, 64, 8, True, True) is None         # prefill-sized: SDPA


def test_a_busy_machine_chooses_nothing_says_so_in_one_quiet_line_and_settles(fresh_tables, monkeypatch):
    """Cells too noisy to choose keep PyTorch's default, said by the progress bar's last line (no warning); they
    count as measured, so the next process does not measure them again (a busy laptop's table settles)."""
    model = small_model()
    busy = fake_timer({"linear": "mm", "attention": "matmul"}, noise=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                       # no warning: one quiet line
        table = ks.ensure(model, config=FAST, timer=busy, progress=False)
    assert table.noisy()
    n, k = next(iter(ks.projection_weights(model)))
    undecided = [c for c in range(kt.MAX_ROW_BAND + 1) if not table.decided(kt.linear_key(n, k, c))]
    assert undecided and all(None in (table.linear_kernel(n, k, kt.band_size(c), True),
                                      table.linear_kernel(n, k, kt.band_size(c), False)) for c in undecided)
    line = ks.summary(table, set(table.linear) | set(table.attention))
    assert re.fullmatch(r"tltlib: measured this machine's kernels \(\d+ cells\); \d+ too noisy to choose \(the "
                        r"machine was busy\): PyTorch's defaults there; `python -m tltlib bench kernels` on a quiet "
                        r"machine measures them again", line), line
    monkeypatch.setattr(ks, "_attempted", set())                             # a later process: nothing measured
    calls = []
    ks.ensure(model, config=FAST, timer=lambda name, fn: calls.append(name) or 1e-3, progress=False)
    assert calls == [] and ks.missing_cells(kt.current(), model) == {"linear": {}, "attention": {}}


# ------------------------------------------------------------------------------------- same function whatever
@pytest.mark.parametrize("rows", [1, 2, 7, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_every_projection_kernel_computes_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(33, 20, generator=g)
    b = torch.randn(33, generator=g) if bias else None
    x = torch.randn(rows, 20, generator=g)
    want = torch.nn.functional.linear(x, w, b)
    entry = ks.pack_weights_of([w])
    with torch.inference_mode():
        for kind in kt.LINEAR_KERNELS:
            if kind in kt.PACKED and not entry or kind == "mkl-packed" and not K.mkl_packing_available():
                continue
            got = linear_with(kind, x.view(rows, 1, 20), w, b, entry[0] if kind in kt.PACKED else None)
            assert got.shape == (rows, 1, 33) and got.is_contiguous(), kind
            torch.testing.assert_close(got.view(rows, 33), want, atol=1e-5, rtol=1e-5, msg=kind)
    with pytest.raises(ValueError, match="unknown projection kernel 'fast'"):
        linear_with("fast", x, w)
    with pytest.raises(ValueError, match="packed kernel needs this weight's packed copy"):
        linear_with("packed", x, w)


def test_the_stream_kernel_on_two_threads_computes_f_linear_and_the_same_bits_as_on_one():
    """Big enough to be split over the threads (more weights than STREAM_SERIAL; the tests' one thread never splits
    it): 203 weight rows are shares of 104 and 99 rows on two threads, 203 on one, each read as 4 streams with 0, 3 or
    3 rows left over, 203 columns end in a scalar tail; 1-9 input rows take every tile and a second pass. Whichever
    thread and stream read a row, its sums are the same bits."""
    module = ks.ragged_kernel()
    if module is None:
        pytest.skip("the CPU kernels cannot be built here")
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(203, 203, generator=g), torch.randn(203, generator=g)
    threads = torch.get_num_threads()
    try:
        for rows in range(1, 10):
            x = torch.randn(rows, 203, generator=g)
            torch.set_num_threads(1)
            one = module.stream_linear(x, w, b)
            torch.set_num_threads(2)
            two = [module.stream_linear(x, w, b) for _ in range(3)]
            torch.testing.assert_close(two[0], torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-5)
            assert all(torch.equal(t, one) for t in two), rows
    finally:
        torch.set_num_threads(threads)


def test_the_stream_kernel_gives_two_threads_shares_within_8_weight_rows():
    """The split the kernel runs: one contiguous range per thread, together every row once, the shares within one
    unit of 8 rows (SmolLM2's 576 rows split in whole 64-row blocks went 320:256); one thread below STREAM_SERIAL
    weights."""
    module = ks.ragged_kernel()
    if module is None:
        pytest.skip("the CPU kernels cannot be built here")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for n, k in [(576, 576), (960, 576), (3072, 576), (576, 1536), (200, 203), (49152, 576), (13, 4096)]:
            shares = module.stream_shares(n, k).tolist()
            assert shares[0][0] == 0 and shares[-1][1] == n and all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
            sizes = [end - first for first, end in shares]
            assert len(sizes) == 2 and max(sizes) - min(sizes) <= 8, (n, k, sizes)
        assert module.stream_shares(64, 64).tolist() == [[0, 64]]          # 4,096 weights: one thread
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("queries,ragged", [(1, False), (1, True), (4, True)])
def test_every_attention_kernel_computes_the_masked_softmax(queries, ragged):
    g = torch.Generator().manual_seed(queries)
    q, k, v, mask, mask_from, limits = ks.attention_inputs(6, 3, 16, 5, queries, ragged, 20, g)
    full = mask if mask is not None else torch.ones(5, 1, queries, k.shape[2], dtype=torch.bool)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=full, enable_gqa=True)
    for kind in kt.ATTENTION_KERNELS:
        if kind == "ragged" and (queries > 1 or ks.ragged_kernel() is None):
            continue
        got = attention_with(kind, q, k, v, mask, mask_from, {}, limits)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=kind)
    with pytest.raises(ValueError, match="unknown attention kernel 'flash'"):
        attention_with("flash", q, k, v, mask)


def test_linear_keeps_autograd_and_f_linear_outside_cpu_float32_inference():
    w = torch.randn(5, 3, requires_grad=True)
    x = torch.randn(2, 3, requires_grad=True)
    table = kt.KernelTable(None, {kt.linear_key(5, 3, b): kt.Timing({"mm": 1e-6, "linear": 3e-6}, {"mm": 0,
                                                                                                   "linear": 0})
                                  for b in range(kt.MAX_ROW_BAND + 1)})
    with kt.using(table):
        assert table.linear_kernel(5, 3, 2, False) == "mm"
        linear(x, w).square().sum().backward()                  # autograd: F.linear, gradients to both
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.nn.functional.linear(xr, wr).square().sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)


def test_the_model_decodes_the_same_tokens_whatever_the_table_picked(fresh_tables):
    """Greedy generation of the shipped tiny reasoner under tables that force each projection kernel and each
    attention kernel: identical tokens (every kernel computes the same function; greedy picks the same argmax)."""
    from tltlib.model.loading import load
    from tltlib.model.sampling import SamplingConfig
    from tltlib.rollout.engine import RolloutConfig, RolloutEngine
    from tltlib.tasks.chain import ChainTaskConfig, generate_problems
    from tltlib.tasks.prompts import encode_prompts
    model, tok, _ = load("data/tiny-reasoner", None)
    prompts = encode_prompts(generate_problems(ChainTaskConfig(), 3, seed=5), tok)
    config = RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=48), num_generations=2)
    tokens = []
    kinds = (("linear", "sdpa"), ("mm", "matmul"), ("mm-pad", "ragged"), ("packed", "ragged"), ("mkl-packed", "sdpa"),
             ("stream", "ragged"))
    for lin, att in kinds:
        if lin == "mkl-packed" and not K.mkl_packing_available():
            continue
        lin_t, att_t = ks.search(model, None, timer=fake_timer({"linear": lin, "attention": att}), config=FAST,
                                 progress=False)
        with kt.using(kt.KernelTable(this_machine(), lin_t, att_t)):
            out = RolloutEngine(model, config).generate(prompts)
        tokens.append(out.tokens)
    assert all(torch.equal(tokens[0], t) for t in tokens[1:])
    assert not (fresh_tables / "kernels").exists()              # a forced table is neither measured nor written


def test_the_stream_kernel_is_measured_and_chosen_up_to_its_band_only(fresh_tables):
    """``stream`` (a weight read once for a few rows) is a candidate of the bands up to STREAM_MAX_BAND (1-16 rows),
    where the CPU kernels are built: a timer that makes it fastest makes it the choice there, and beyond it the
    choice is another kernel's (a table cannot pick it for 64 rows even if a cell said it was fastest)."""
    if ks.ragged_kernel() is None:
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here")
    assert kt.band_size(kt.STREAM_MAX_BAND) == 16
    assert ["stream" in ks.linear_names(b, True) for b in range(kt.MAX_ROW_BAND + 1)] == [
        b <= kt.STREAM_MAX_BAND for b in range(kt.MAX_ROW_BAND + 1)]
    model = small_model()
    lin, att = ks.search(model, None, timer=fake_timer({"linear": "stream", "attention": "ragged"}), config=FAST,
                         progress=False)
    table = kt.KernelTable(this_machine(), lin, att)
    n, k = next(iter(ks.projection_weights(model)))
    for rows in (1, 2, 3, 5, 8, 9, 16):
        assert table.linear_kernel(n, k, rows, packed=True) == "stream"
        assert table.linear_kernel(n, k, rows, packed=False) == "stream"
    for rows in (17, 64, 300):
        assert table.linear_kernel(n, k, rows, packed=True) not in ("stream", None)
    forged = {key: kt.Timing({**t.seconds, "stream": 1e-9}, {**t.spread, "stream": 0.0}) for key, t in lin.items()}
    assert kt.KernelTable(this_machine(), forged, att).linear_kernel(n, k, 64, packed=True) != "stream"


@pytest.mark.skipif(not K.mkl_packing_available(), reason="no MKL in this torch build")
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 16, 17, 64, 65, 200])
def test_mkl_packed_serves_every_row_count_from_one_copy(rows, monkeypatch):
    """One copy packed for MKL_PACK_ROWS rows, run at other row counts: F.linear's result within float rounding, and
    the first call's check passes (no fallback recorded)."""
    monkeypatch.setattr(K, "_MKL_CHECKED", {})
    g = torch.Generator().manual_seed(rows)
    for n, k in ((96, 64), (57, 131)):
        w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
        entry = K.PackedWeight(w)
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("error")
            got = linear_with("mkl-packed", x.view(1, rows, k), w, None, entry)
        torch.testing.assert_close(got.view(rows, n), torch.nn.functional.linear(x, w), atol=1e-4, rtol=1e-4)
        assert K._MKL_CHECKED[(n, k, rows)] is True


@pytest.mark.skipif(not K.mkl_packing_available(), reason="no MKL in this torch build")
def test_an_mkl_copy_that_does_not_serve_the_rows_falls_back_to_f_linear_with_one_warning(monkeypatch):
    """Stands in for an MKL whose packing depends on the rows: a copy that computes another product is caught by the
    first call's check; that call and every later one of the shape and rows give F.linear's result, one warning."""
    monkeypatch.setattr(K, "_MKL_CHECKED", {})
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 32, generator=g), torch.randn(4, 32, generator=g)
    entry = K.PackedWeight(w)
    entry._mkl = torch.ops.mkl._mkl_reorder_linear_weight(torch.randn(48, 32, generator=g), K.MKL_PACK_ROWS)
    with torch.inference_mode():
        with pytest.warns(UserWarning, match=r"MKL's packed product for a \(48, 32\) weight at 4 rows differs"):
            first = linear_with("mkl-packed", x, w, None, entry)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            second = linear_with("mkl-packed", x, w, None, entry)
    want = torch.nn.functional.linear(x, w)
    assert torch.equal(first, want) and torch.equal(second, want)
    assert K._MKL_CHECKED == {(48, 32, 4): False}


def test_a_table_measured_before_a_candidate_existed_keeps_its_choices_and_is_measured_again(fresh_tables):
    """A cell without a timing of a candidate this machine can run (a table from before mkl-packed) is missing for
    the next measurement; until then its old choice holds."""
    model = small_model()
    lin, att = ks.search(model, None, timer=fake_timer({"linear": "mm", "attention": "matmul"}), config=FAST,
                         progress=False)
    n, k = next(iter(ks.projection_weights(model)))
    old = {key: kt.Timing({c: s for c, s in t.seconds.items() if c != "mkl-packed"},
                          {c: s for c, s in t.spread.items() if c != "mkl-packed"}) for key, t in lin.items()}
    table = kt.KernelTable(this_machine(), old, att)
    assert table.linear_kernel(n, k, 16, True) == "mm"
    missing = ks.missing_cells(table, model)
    if K.mkl_packing_available() and torch.backends.mkldnn.is_available():
        assert missing["linear"] and all(b == list(range(kt.MAX_ROW_BAND + 1)) for b in missing["linear"].values())
    else:
        assert missing["linear"] == {}
    assert missing["attention"] == {} and ks.missing_cells(kt.KernelTable(this_machine(), lin, att), model) == {
        "linear": {}, "attention": {}}


# --------------------------------------------------------------------------------------------- the cache file
def test_a_machine_measures_once_and_reads_its_table_back(fresh_tables):
    model = small_model()
    calls = []
    timer = fake_timer({"linear": "mm", "attention": "matmul"})
    counting = lambda name, fn: calls.append(name) or timer(name, fn)           # noqa: E731
    table = ks.ensure(model, config=FAST, timer=counting, progress=False)
    measured = len(calls)
    assert measured and table.size and kt.current() is table
    path = kt.cache_path(this_machine())
    assert path.is_file() and json.loads(path.read_text())["machine"] == this_machine().as_dict()
    ks.ensure(model, config=FAST, timer=counting, progress=False)
    assert len(calls) == measured                                # nothing more to measure
    kt._tables.clear()                                           # a new process: read from the file
    again = kt.current()
    assert again is not table and again.linear == table.linear and again.attention == table.attention
    n, k = next(iter(ks.projection_weights(model)))
    assert again.linear_kernel(n, k, 16, True) == "mm"
    ks.ensure(small_model(seed=1), config=FAST, timer=counting, progress=False)    # same shapes: measured already
    assert len(calls) == measured


@pytest.mark.parametrize("what", ["cpu", "torch", "schema"])
def test_a_table_from_another_machine_or_torch_is_ignored_with_one_line_and_measured_again(fresh_tables, what):
    model = small_model()
    here = this_machine()
    ks.ensure(model, config=FAST, timer=fake_timer({"linear": "mm", "attention": "matmul"}), progress=False)
    path = kt.cache_path(here)
    d = json.loads(path.read_text())
    if what == "schema":
        d["schema"] = kt.SCHEMA + 1
    else:
        d["machine"] = replace(here, **({"flags": "0123456789ab"} if what == "cpu" else {"torch": "2.99.0"})).as_dict()
    path.write_text(json.dumps(d))
    kt._tables.clear()
    ks._attempted.clear()
    why = {"cpu": "another machine or torch \\(CPU flags '0123456789ab' there", "torch": "torch '2.99.0' there",
           "schema": "another tltlib version"}[what]
    with pytest.warns(UserWarning, match=f"kernel table .* ignored.*{why}") as seen:
        table = kt.current()
    assert len(seen) == 1 and table.size == 0                    # one line; PyTorch's defaults until measured
    ks.ensure(model, config=FAST, timer=fake_timer({"linear": "linear", "attention": "sdpa"}), progress=False)
    fixed = json.loads(path.read_text())
    assert fixed["machine"] == here.as_dict() and fixed["schema"] == kt.SCHEMA       # measured again, replaced
    n, k = next(iter(ks.projection_weights(model)))
    assert kt.current().linear_kernel(n, k, 16, True) == "linear"


def test_an_unreadable_table_is_ignored_with_one_line(fresh_tables):
    path = kt.cache_path(this_machine())
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="kernel table .* ignored \\(.* is not valid JSON"):
        assert kt.current().size == 0


def test_a_cache_that_cannot_be_written_is_one_warning_and_the_table_is_used(fresh_tables, monkeypatch):
    (fresh_tables / "kernels").write_text("a file where the folder should be")
    model = small_model()
    with pytest.warns(UserWarning, match="the kernel table could not be saved to .*set TLTLIB_CACHE to a writable"):
        table = ks.ensure(model, config=FAST, timer=fake_timer({"linear": "mm", "attention": "matmul"}),
                          progress=False)
    n, k = next(iter(ks.projection_weights(model)))
    assert kt.current() is table and table.linear_kernel(n, k, 16, True) == "mm"


def test_the_switch_keeps_pytorch_defaults_and_measures_nothing(fresh_tables, monkeypatch):
    monkeypatch.setenv(kt.ENV, "0")
    model = small_model()
    table = ks.ensure(model, config=FAST, timer=lambda n, f: pytest.fail("measured although switched off"),
                      progress=False)
    assert table is kt.EMPTY and not (fresh_tables / "kernels").exists()
    assert table.linear_kernel(96, 32, 1, True) is None


@pytest.mark.parametrize("text, mode", [("0", "off"), ("off", "off"), ("false", "off"), ("No", "off"),
                                        ("1", "on"), ("on", "on"), ("TRUE", "on"), ("measure", "measure")])
def test_the_switch_reads_the_words_people_write(monkeypatch, text, mode):
    monkeypatch.setenv(kt.ENV, text)
    assert kt.mode() == mode and kt.enabled() == (mode != "off")


def test_a_switch_setting_that_is_no_setting_is_one_clear_error(fresh_tables, monkeypatch):
    monkeypatch.setenv(kt.ENV, "fast")
    with pytest.raises(BadInput, match=r"TLTLIB_KERNELS='fast' is not a setting: use 0 \(or off.*measure"):
        kt.current()


def test_an_engine_reads_the_table_and_says_once_how_to_measure_what_it_lacks(fresh_tables, capsys):
    """Nothing is measured inside a rollout (a notebook's teaching cell, a training run): the cells the table lacks
    run PyTorch's defaults and one quiet line per process names the command; an explicit call measures."""
    from tltlib.rollout.engine import RolloutEngine
    model = small_model()
    never = lambda n, f: pytest.fail("measured inside a rollout engine")              # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ks.ensure(model, config=FAST, timer=never, measure=None, progress=False).size == 0
        RolloutEngine(model)
        RolloutEngine(model)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(r"tltlib: this machine's kernel table lacks \d+ cells of these shapes: "
                                          r"PyTorch's default kernels there; `python -m tltlib kernels` measures them "
                                          r"once \(~10-30 s\), or set TLTLIB_KERNELS=measure", err[0]), err
    assert not (fresh_tables / "kernels").exists()
    table = ks.ensure(model, config=FAST, timer=fake_timer({"linear": "mm", "attention": "matmul"}), progress=False)
    assert table.size > 0 and ks.missing_cells(table, model) == {"linear": {}, "attention": {}}


def test_measure_in_the_switch_measures_when_an_engine_is_made(fresh_tables, monkeypatch):
    monkeypatch.setenv(kt.ENV, "measure")
    model = small_model()
    table = ks.ensure(model, config=FAST, timer=fake_timer({"linear": "mm", "attention": "matmul"}), measure=None,
                      progress=False)
    assert ks.missing_cells(table, model) == {"linear": {}, "attention": {}}


@pytest.mark.parametrize("bad", [{"linear": []}, {"attention": []}, {"cell": {"ms": [1.0], "spread": {}}},
                                 {"cell": {"ms": {"mm": "fast"}, "spread": {"mm": 0.1}}}, {"key": "5x5"},
                                 {"machine": None}])
def test_a_table_of_the_wrong_shape_is_ignored_with_one_line_naming_the_file(fresh_tables, bad):
    """A hand-edited or truncated table never reaches a rollout (every rollout on the machine failed without naming
    the file): one warning naming it, PyTorch's defaults, and the command that measures it again."""
    model = small_model()
    here = this_machine()
    ks.ensure(model, config=FAST, timer=fake_timer({"linear": "mm", "attention": "matmul"}), progress=False)
    path = kt.cache_path(here)
    d = json.loads(path.read_text())
    key = next(iter(d["linear"]))
    if "cell" in bad:
        d["linear"][key] = bad["cell"]
    elif "key" in bad:
        d["linear"][bad["key"]] = d["linear"].pop(key)
    else:
        d.update(bad)
    path.write_text(json.dumps(d))
    kt._tables.clear()
    with pytest.warns(UserWarning, match=f"kernel table {re.escape(str(path))} ignored .*`python -m tltlib kernels` "
                                         "measures this machine again") as seen:
        table = kt.current()
    assert len(seen) == 1 and table.size == 0
    x, w = torch.randn(3, 32), torch.randn(96, 32)
    torch.testing.assert_close(linear(x, w), torch.nn.functional.linear(x, w))     # calls still run (the default)


def test_the_kernels_command_measures_the_shipped_pair_once(fresh_tables, monkeypatch, capsys):
    """``python -m tltlib kernels`` (what the set-up runs): the tiny reasoner's and its drafter's cells measured and
    saved; run again, nothing is measured; switched off, one line."""
    from tltlib.cli import main
    monkeypatch.setattr(ks, "WallTimer", lambda sample_s: fake_timer({"linear": "mm", "attention": "matmul"}))
    assert main(["kernels", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"measured this machine's kernels \(\d+ cells, kept in .*\) for data/tiny-reasoner and "
                     r"data/tiny-reasoner-drafter", out), out
    assert kt.cache_path(this_machine()).is_file()
    monkeypatch.setattr(ks, "WallTimer", lambda sample_s: pytest.fail("measured again"))
    assert main(["kernels", "--quiet"]) == 0
    assert "already measured" in capsys.readouterr().out
    monkeypatch.setenv(kt.ENV, "off")
    assert main(["kernels"]) == 1
    assert capsys.readouterr().err.startswith("error: TLTLIB_KERNELS=off turns this machine's kernel table off")


def test_the_kernels_command_pairs_the_tiny_drafter_only_with_the_tiny_reasoner():
    """``kernels --model OTHER`` measured OTHER with the tiny reasoner's drafter and failed (hidden 192 against
    SmolLM2's 576); now another model has no drafter unless one is given."""
    from tltlib.cli.commands import kernels_drafter
    from tltlib.cli.parser import build_parser
    args = build_parser().parse_args(["kernels", "--model", "/models/smollm2-135m"])
    assert kernels_drafter(args.model, args.drafter) is None
    args = build_parser().parse_args(["kernels"])
    assert kernels_drafter(args.model, args.drafter) == "data/tiny-reasoner-drafter"
    assert kernels_drafter("data/tiny-reasoner", "") is None
    assert kernels_drafter("/m", "/m-drafter") == "/m-drafter"


def test_the_set_up_says_in_one_line_when_it_could_not_measure_the_kernels(monkeypatch, capsys, tmp_path):
    """A measurement that fails or runs past its bound leaves the set-up standing, with one line naming the command
    that measures later."""
    from tltlib.cli import bootstrap
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\nexit 3\n")
    script.chmod(0o755)
    monkeypatch.setattr(bootstrap, "_venv_python", lambda: script)
    monkeypatch.delenv(kt.ENV, raising=False)
    assert bootstrap.measure_kernels() is False
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "failed (exit status 3" in out[0] and "python -m tltlib kernels" in out[0]
    script.write_text("#!/bin/sh\nsleep 30\n")
    assert bootstrap.measure_kernels(timeout_s=0.5) is False
    assert "did not finish within 0.5 s" in capsys.readouterr().out
    monkeypatch.setenv(kt.ENV, "0")
    assert bootstrap.measure_kernels() is False and capsys.readouterr().out == ""


def test_the_machine_names_what_differs():
    a = Machine("AMD EPYC", "abc", 2, 2, "2.13.0")
    assert a.differences(a) == []
    assert a.differences(replace(a, cpu="Intel Xeon", threads=1)) == ["CPU 'AMD EPYC' there, 'Intel Xeon' here",
                                                                      "threads 2 there, 1 here"]
    assert a.slug == "amd-epyc-2t" and Machine.from_dict(a.as_dict()) == a
    assert replace(a, cpu="Intel(R) Xeon(R) Processor").slug == "intel-xeon-processor-2t"
    with pytest.raises(ValueError, match="a machine record needs exactly the keys"):
        Machine.from_dict({"cpu": "x"})


@pytest.mark.parametrize("flags, isa", [("fpu sse2 avx avx2 fma", "avx2"), ("avx2 avx512f avx512bw", "avx512"),
                                         ("avx2 avx512f amx_tile amx_bf16", "avx512-amx"), ("fp asimd sve", "sve"),
                                         ("fp asimd", "neon"), ("fpu sse2", "")])
def test_a_results_file_names_the_widest_vector_instructions(flags, isa):
    # two VMs both called "AMD EPYC" decoded SmolLM2 at 42 and 34 tok/s one row (the second with AVX2 only): the name
    # alone does not say which machine a number came from
    from tltlib.machine import vector_isa
    assert vector_isa(flags) == isa


def test_bad_search_settings_are_one_clear_error():
    with pytest.raises(ValueError, match="rounds must be >= 3"):
        ks.SearchConfig(rounds=2)
    with pytest.raises(ValueError, match="retries must be >= 0"):
        ks.SearchConfig(retries=-1)
    with pytest.raises(ValueError, match="context must be >= 8"):
        ks.SearchConfig(context=4)
