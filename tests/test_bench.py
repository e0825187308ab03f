"""The bench scripts' command line: a bad flag stops a bench before anything loads with one line naming the flag and
the fix (never a traceback), also after the re-exec that sets the malloc environment; the shared flag checks."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import _common  # noqa: E402


def bench(out: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m tltlib bench ARGS --out OUT`` as a user runs it (without the malloc settings: it re-executes).
    The timeout bounds a hang, never the machine's speed: a busy machine may take several times the quiet ~10-60 s."""
    env = {k: v for k, v in os.environ.items() if k not in _common.MALLOC}
    env["TLTLIB_NO_VENV"] = "1"
    return subprocess.run([sys.executable, "-m", "tltlib", "bench", *args, "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)


def test_the_smollm2_benches_look_for_the_model_where_get_model_puts_it(tmp_path):
    """``python -m tltlib get-model`` imports into ``$TLTLIB_CACHE/models`` where the variable is set: the SmolLM2
    benches' default model is there too (it was ~/.cache/tltlib whatever the variable said), else under ~/.cache."""
    code = "import sys; sys.path.insert(0, 'bench'); import _common; print(_common.SMOLLM2)"
    for env, want in (({"TLTLIB_CACHE": str(tmp_path)}, tmp_path / "models" / "smollm2-135m"),
                      ({}, Path.home() / ".cache" / "tltlib" / "models" / "smollm2-135m")):
        base = {k: v for k, v in os.environ.items() if k != "TLTLIB_CACHE"}
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**base, **env}, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == str(want)
    from tltlib.model.importers import cache_dir
    assert Path(_common.SMOLLM2).parent == cache_dir()


def assert_one_line_error(out: subprocess.CompletedProcess, *expected: str) -> None:
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    first = out.stderr.strip().splitlines()[0]
    assert first.startswith("error: "), out.stderr
    for text in expected:
        assert text in first, out.stderr


@pytest.mark.parametrize("args, expected", [
    (["decode", "--batches", "a,b"], ["argument --batches", "'a' is not a positive integer", "such as 1,16,64"]),
    (["decode", "--batches", "0"], ["argument --batches", "'0' is not a positive integer"]),
    (["decode", "--repeats", "0"], ["argument --repeats", "'0' is not a positive integer"]),
    (["verify_cost", "--tokens", "2,x"], ["argument --tokens", "'x' is not a positive integer"]),
    (["speculative", "--temperatures", "0,-1"], ["argument --temperatures", "'-1' is not a temperature"]),
    (["speculative", "--strategies", "chain-4;chain"], ["argument --strategies", "cannot read speculative strategy",
                                                        "';'-separated list"]),
    (["long_tail_rollout", "--arms", "off;ngram-4"], ["argument --arms", "no chain or tree strategy"]),
    (["graphs", "--batches", "1,,4"], ["argument --batches", "'' is not a positive integer"]),
    (["sampling", "--vocabs", "74,0"], ["argument --vocabs", "'0' is not a positive integer"]),
    (["sampling", "--scale", "1e39"], ["argument --scale", "'1e39' is more than 1000: the logits would overflow"]),
    (["sampling", "--scale", "nan"], ["argument --scale", "'nan' is not a number > 0"]),
    (["kv_cache", "--kv", "paged,flat"], ["argument --kv", "'flat' is not a KV cache", "such as paged,dense"]),
    (["decode", "--model", "no/such/model"], ["argument --model", "no model folder 'no/such/model'"]),
    (["speculative", "--drafter", "no/such/drafter"], ["argument --drafter", "data/tiny-reasoner-drafter"]),
    (["e2e_grpo", "--replot", "no/such.json"], ["argument --replot", "no file 'no/such.json'"]),
    (["e2e_grpo", "--recipe", "params/train/cpu-smollm2.yaml", "--lr", "0.001"],
     ["--lr is set by the recipe params/train/cpu-smollm2.yaml: change it there"]),
    (["e2e_grpo", "--recipe", "params/train/cpu-smollm2.yaml", "--trl-steps", "2"],
     ["give --trl-steps 0 with --recipe"]),
    (["kernels", "--rounds", "2"], ["argument --rounds", "2 is too few; give at least 3"]),
    (["kv_cache", "--group", "4"], ["argument --group: renamed --num-generations; write --num-generations 4"]),
    (["e2e_grpo", "--num-generations", "0"], ["argument --num-generations", "'0' is not a positive integer"]),
    (["drafters", "--model", "data/tiny-reasoner", "--drafters", "data/tiny-reasoner-drafter;no/such",
      "--responses", "README.md"], ["argument --drafters", "no drafter folder 'no/such'", "';'-separated list"]),
    (["update_memory", "--model", "data/tiny-reasoner", "--budget-gib", "-5"],
     ["argument --budget-gib", "'-5' is not a number > 0"]),
    (["update_memory", "--model", "data/tiny-reasoner", "--rows", "2"],
     ["argument --rows", "2 completions cannot form the update's groups of 4; give a multiple of 4"]),
    (["update_memory", "--model", "data/tiny-reasoner", "--length", "5000"],
     ["argument --length", "5000 tokens per completion leave no room for a prompt in the model's context of 1024"]),
])
def test_a_bad_flag_is_one_line_before_anything_loads(args, expected, tmp_path):
    assert_one_line_error(bench(tmp_path, *args), *expected)
    assert not any(tmp_path.iterdir())                              # nothing ran


def test_the_kernels_bench_calls_a_machine_busy_only_when_many_cells_are_noisy():
    import kernels as kernels_bench
    kernels_bench.check_quiet([], 115)
    kernels_bench.check_quiet([("384x192/r6", 0.34)], 115)                 # one hiccup of ~110 cells: kept, named
    with pytest.raises(ValueError, match="spread is too high to choose at 6 of 100 cells \\(worst 90% at a; the "
                                         "limit is 25% per cell, in at most 5% of the cells\\).*rerun on a quiet"):
        kernels_bench.check_quiet([("a", 0.9)] + [("b", 0.5)] * 5, 100)


@pytest.mark.long
def test_the_kernels_bench_writes_the_table_and_its_results_from_the_timings(tmp_path, monkeypatch, capsys):
    """bench kernels in this process on a fake timer (a busy machine cannot change what it decides): every cell of
    the tiny reasoner's shapes chosen as the timer says, the table saved for this machine, the results named after
    its CPU; the switch off is one line."""
    import kernels as kernels_bench
    from tltlib.kernels import ragged_attention as ra
    from tltlib.kernels import search as ks
    from tltlib.kernels import table as kt
    from tltlib.machine import this_machine

    class FakeTimer:                                        # mm fastest, PyTorch's defaults slowest, no noise
        def __init__(self, sample_s):
            pass

        def __call__(self, name, fn):
            return {"mm": 1e-6, "matmul": 1e-6, "linear": 3e-6, "sdpa": 3e-6}.get(name, 2e-6)
    ra.kernel()                          # loaded from the user's cache before TLTLIB_CACHE points elsewhere
    monkeypatch.setattr(_common, "ensure_malloc_env", lambda: None)
    monkeypatch.setattr(ks, "WallTimer", FakeTimer)
    monkeypatch.setenv("TLTLIB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TLTLIB_KERNELS", "1")
    monkeypatch.setattr(kt, "_tables", {})
    monkeypatch.setattr(sys, "argv", ["kernels.py", "--drafter", "", "--rounds", "3", "--context", "64", "--out",
                                      str(tmp_path)])
    kernels_bench.main()
    here = this_machine()
    result = json.loads((tmp_path / f"kernels-cpu-{here.slug}.json").read_text())
    assert result["machine"]["cpu"] == here.cpu and result["table"]["machine"]["flags"] == here.flags
    assert len(result["table"]["linear"]) == 5 * 10 and result["table"]["attention"] and result["cells"] > 50
    table = kt.load(tmp_path / "cache" / "kernels" / f"{here.slug}.json", here)
    assert table is not None and table.noisy() == [] and table.linear_kernel(96, 96, 16, False) in ("mm", None)
    assert {table.linear_kernel(n, k, 16, False) for n, k in (tuple(map(int, key.split("/")[0].split("x")))
                                                            for key in table.linear)} == {"mm"}
    assert [f["rows"] for f in result["decode_forward"]] == [1, 16, 64]
    md = (tmp_path / f"kernels-cpu-{here.slug}.md").read_text()
    assert f"Machine: {here.cpu}" in md and "dev-VM constants" in md and "The one-row floor" in md
    monkeypatch.setenv("TLTLIB_KERNELS", "0")
    assert_one_line_error(bench(tmp_path / "off", "kernels"), "TLTLIB_KERNELS=0 turns this machine's kernel table off")


@pytest.mark.timing
def test_the_kernels_bench_measures_this_machine_names_its_cpu_and_saves_the_table(tmp_path, monkeypatch):
    """bench kernels on the tiny reasoner (no drafter), with its own kernel cache, timed for real (the timing tier:
    a quiet machine): every cell of the model's shapes timed, the table saved for this machine, the decode forward
    under the table, PyTorch's defaults and the development VM's constants; the switch off is one line."""
    from tltlib.machine import this_machine
    monkeypatch.setenv("TLTLIB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TLTLIB_KERNELS", "1")
    out = bench(tmp_path, "kernels", "--drafter", "", "--rounds", "5", "--context", "64")
    here = this_machine()
    if out.returncode == 1 and "rerun on a quiet machine" in out.stderr:      # a busy moment of a shared machine:
        errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]   # after the search's bar
        assert "Traceback" not in out.stderr and len(errors) == 1, out.stderr
        assert "the timings' spread is too high to choose" in errors[0] and "(nothing was written)" in errors[0]
        assert not list(tmp_path.glob("kernels-*")) and not (tmp_path / "cache" / "kernels").exists()
        return
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / f"kernels-cpu-{here.slug}.json").read_text())
    assert result["machine"]["cpu"] == here.cpu and result["table"]["machine"]["flags"] == here.flags
    assert len(result["table"]["linear"]) == 5 * 10 and result["table"]["attention"]
    assert [f["rows"] for f in result["decode_forward"]] == [1, 16, 64]
    assert all(f[k] > 0 for f in result["decode_forward"] for k in ("chosen_ms", "defaults_ms", "constants_ms"))
    assert (tmp_path / "cache" / "kernels" / f"{here.slug}.json").is_file()
    md = (tmp_path / f"kernels-cpu-{here.slug}.md").read_text()
    assert f"Machine: {here.cpu}" in md and "dev-VM constants" in md and "The one-row floor" in md
    assert result["weights_floor"]["read_gb_s"] > 0 and result["search_s"] > 0 and result["cells"] > 50
    monkeypatch.setenv("TLTLIB_KERNELS", "0")
    assert_one_line_error(bench(tmp_path / "off", "kernels"), "TLTLIB_KERNELS=0 turns this machine's kernel table off")


@pytest.mark.parametrize("tied", [True, False])
def test_the_one_row_floor_counts_every_weight_once_and_the_embedding_only_as_the_head(tied):
    import kernels as kernels_bench
    from tltlib.model.decoder import ModelConfig, Transformer
    model = Transformer(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                                    num_kv_heads=2, tie_word_embeddings=tied))
    floor = kernels_bench.weights_floor(model, repeats=3)
    every = sum(p.numel() * 4 for p in model.parameters())
    assert floor["weight_bytes"] == (every if tied else every - 64 * 32 * 4)
    assert floor["buffer_bytes"] >= 1 << 30 and floor["read_gb_s"] > 0
    assert floor["floor_ms"] == pytest.approx(1e3 * floor["weight_bytes"] / (floor["read_gb_s"] * 1e9))


def test_a_library_error_after_the_malloc_reexec_is_still_one_line(tmp_path):
    # the re-exec runs `python -m tltlib bench ...` again, so tltlib's CLI still turns tltlib's error into a line
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    out = bench(tmp_path, "e2e_grpo", "--replot", str(bad))
    assert_one_line_error(out, f"{bad} is not valid JSON", "e2e_grpo-*.json")
    assert len(out.stderr.strip().splitlines()) == 2               # the error and the --debug hint


@pytest.mark.long
def test_an_error_in_the_update_memory_child_is_the_parents_one_line(tmp_path):
    """The update runs in a child process: its error (a completion longer than the context leaves after the prompt)
    is printed by the parent as one line naming the configuration, not under the child's traceback."""
    out = bench(tmp_path, "update_memory", "--model", "data/tiny-reasoner", "--rows", "4", "--length", "1020",
                "--micro", "512", "--chunks", "2048", "--chunk-micro", "512")
    assert_one_line_error(out, "the update at micro_batch_tokens 512, logprob_chunk 2048 (--rows 4, --length 1020): "
                               "lengths[0] = 1020 is outside 1..")


def test_list_flags_keep_their_text_and_parse_their_items():
    batches = _common.listed(_common.positive_int, "1,4")("1, 16,64")
    assert batches == "1, 16,64" and batches.items == (1, 16, 64)
    assert json.dumps({"batches": batches}, indent=1) == '{\n "batches": "1, 16,64"\n}'   # settings as typed
    temps = _common.listed(_common.temperature, "0,0.9")("0,0.9")
    assert temps.items == (0.0, 0.9) and all(isinstance(t, float) for t in temps.items)
    strategies = _common.listed(_common.strategy, "chain-4", sep=";")("off;chain-4;tree-6x4-24")
    assert [s.name for s in strategies.items][1:] == ["chain-4", "tree-6x4-24"]
    assert not strategies.items[0].enabled
    with pytest.raises(argparse.ArgumentTypeError, match=r"'x' is not a positive integer; give a comma-separated "
                                                         r"list such as 1,4$"):
        _common.listed(_common.positive_int, "1,4")("2,x")
    with pytest.raises(argparse.ArgumentTypeError, match="';'-separated list such as chain-4"):
        _common.listed(_common.strategy, "chain-4", sep=";")("chain-4;chain-0")


@pytest.mark.parametrize("check, good, bad", [
    (_common.positive_int, [("1", 1), ("64", 64)], ["0", "-2", "1.5", "x", ""]),
    (_common.nonnegative_int, [("0", 0), ("7", 7)], ["-1", "x"]),
    (_common.temperature, [("0", 0.0), ("0.9", 0.9)], ["-0.1", "nan", "inf", "warm"]),
    (_common.positive_float, [("1e-4", 1e-4)], ["0", "-1", "nan", "inf", "x"]),
])
def test_number_checks(check, good, bad):
    for text, value in good:
        assert check(text) == value
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=repr(text)):
            check(text)


def test_parser_errors_are_one_line_with_exit_status_1(capsys):
    ap = _common.bench_parser("A bench.\n\nMore.")
    ap.add_argument("--batches", default="1,4", type=_common.listed(_common.positive_int, "1,4"))
    assert ap.parse_args([]).batches.items == (1, 4)                # string defaults are checked and parsed too
    with pytest.raises(SystemExit) as e:
        ap.parse_args(["--batches", "1,0"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err == "error: argument --batches: '0' is not a positive integer; give a comma-separated list such as " \
                  "1,4 (see --help)\n"


def test_settling_waits_for_a_quiet_machine_and_no_longer_than_its_limit(monkeypatch):
    now = [0.0]                                              # a fake clock: nothing here judges this machine's speed
    clock, sleep = (lambda: now[0]), (lambda s: now.__setitem__(0, now[0] + s))
    readings = iter([(0, 100), (90, 200)] * 3 + [(500, 1000), (501, 1100)])   # 90% busy three times, then 1%
    monkeypatch.setattr(_common, "_cpu_times", lambda: next(readings))
    _common.settle_down(0.01, limit=2.0, window=0.01, clock=clock, sleep=sleep)
    assert next(readings, "done") == "done" and now[0] == pytest.approx(0.05)     # stopped at the quiet reading
    busy = iter(range(0, 10**6, 100))
    monkeypatch.setattr(_common, "_cpu_times", lambda: (next(busy) * 2, next(busy) * 2 + 1))  # always busy
    now[0] = 0.0
    _common.settle_down(0.01, limit=0.2, window=0.01, clock=clock, sleep=sleep)
    assert 0.2 < now[0] < 0.23                                                    # the limit, then on
    now[0] = 0.0
    monkeypatch.setattr(_common, "_cpu_times", lambda: pytest.fail("read the CPU though told not to settle"))
    _common.settle_down(0.0, clock=clock, sleep=sleep)
    assert now[0] == 0.0


def test_malloc_reexec_repeats_the_command_that_started_the_bench(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/r/bench/decode.py", "--batches", "1"])
    monkeypatch.setattr(sys, "orig_argv", ["py", "-u", "-m", "tltlib", "bench", "decode", "--batches", "1"])
    assert _common._command_args() == ["-u", "-m", "tltlib", "bench", "decode", "--batches", "1"]
    monkeypatch.setattr(sys, "orig_argv", ["py", "/r/bench/decode.py", "--batches", "1"])
    assert _common._command_args() == ["/r/bench/decode.py", "--batches", "1"]
    monkeypatch.setattr(sys, "orig_argv", ["py", "-m", "pytest", "tests"])   # run in-process from another tool
    assert _common._command_args() == ["/r/bench/decode.py", "--batches", "1"]


# ------------------------------------------------------------------ e2e_grpo's TRL peer: its settings and its tables
import _trl_peer as trl_peer  # noqa: E402
import e2e_grpo  # noqa: E402


def test_trl_runs_defaults_then_one_change_each_up_to_tuned():
    runs = trl_peer.trl_settings(128, 9 + 720)
    assert list(runs) == list(trl_peer.TRL_RUNS)
    assert runs["defaults"] == {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 16}  # TRL's own
    assert runs["no-bf16"] == {**runs["defaults"], "bf16": False, "fp16": False}
    assert runs["no-bf16-no-ckpt"] == {**runs["no-bf16"], "gradient_checkpointing": False}
    assert runs["tuned"] == {**runs["no-bf16-no-ckpt"], "per_device_train_batch_size": 32,
                             "gradient_accumulation_steps": 4, "use_transformers_continuous_batching": True,
                             "transformers_continuous_batching_config": {"num_blocks": 128 * 3,   # 729 tokens: 3 pages
                                                                         "max_batch_tokens": 1024}}
    odd = trl_peer.trl_settings(12, 100, rows=64, continuous=False)    # micro-batches divide the batch
    assert odd["defaults"] == {"per_device_train_batch_size": 6, "gradient_accumulation_steps": 2}
    assert odd["tuned"]["per_device_train_batch_size"] == 12 and odd["tuned"]["gradient_accumulation_steps"] == 1
    assert odd["tuned"]["use_transformers_continuous_batching"] is False
    assert "transformers_continuous_batching_config" not in odd["tuned"]
    assert [trl_peer.largest_divisor(n, 8) for n in (128, 12, 7, 3)] == [8, 6, 7, 3]


def test_native_bf16_flags_come_from_cpuinfo():
    info = "processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 avx512_vnni amx_tile amx_bf16\n"
    assert trl_peer.bf16_cpu_flags(info) == ["amx_bf16", "avx512_bf16"]
    assert trl_peer.bf16_cpu_flags("flags\t: fpu sse avx2 avx512f avx512bw\n") == []
    assert trl_peer.bf16_cpu_flags("") == []


def test_trl_runs_flag_and_result_keys():
    runs = _common.listed(trl_peer.trl_run_name, "defaults,tuned")("defaults,tuned")
    assert runs.items == ("defaults", "tuned")
    with pytest.raises(argparse.ArgumentTypeError, match="'fast' is not a TRL run"):
        _common.listed(trl_peer.trl_run_name, "defaults,tuned")("defaults,fast")
    assert [trl_peer.trl_key(r) for r in trl_peer.TRL_RUNS] == ["trl", "trl_no_bf16", "trl_no_bf16_no_ckpt",
                                                                "trl_tuned"]   # old files' "trl": the defaults


def _trl_result(run: str, gen: float, fwd: float, bwd: float) -> dict:
    return {"run": run, "version": "1.16.0", "step_s": [gen + fwd + bwd + 1, gen + fwd + bwd + 3],
            "generate_s": [gen, gen], "generate_and_score_s": [gen + 0.5, gen + 0.5], "loss_forward_s": [fwd, fwd],
            "backward_s": [bwd - 1, bwd + 1], "micro_batches": 16, "gradient_checkpointing": run == "defaults",
            "settings": {"bf16": run == "defaults", "per_device_train_batch_size": 8,
                         "use_transformers_continuous_batching": run == "tuned"}}


def test_trl_comparison_per_phase_against_the_baseline_and_along_the_ladder():
    baseline = {"rollout": 10.0, "reward": 0.0, "logprob": 0.0, "update": 5.0, "step": 15.0}
    runs = {"defaults": _trl_result("defaults", 100, 40, 360), "tuned": _trl_result("tuned", 20, 10, 20)}
    cmp = trl_peer.trl_comparison(baseline, runs)
    d = cmp["runs"]["defaults"]
    assert d["median"] == {"generate": 100, "score": 0.5, "loss_forward": 40, "backward": 360, "update": 400,
                           "step": 502}
    assert d["vs_baseline"] == pytest.approx({"generate": 10.0, "update": 80.0, "step": 502 / 15})
    assert cmp["runs"]["tuned"]["vs_baseline"]["step"] == pytest.approx(52 / 15)
    assert cmp["ladder"] == [pytest.approx({"from": "defaults", "to": "tuned", "generate": 5.0, "loss_forward": 4.0,
                                            "backward": 18.0, "step": 502 / 52})]
    runs["no-bf16"] = _trl_result("no-bf16", 50, 10, 100)            # the ladder follows TRL_RUNS' order
    assert [(x["from"], x["to"]) for x in trl_peer.trl_comparison(baseline, runs)["ladder"]] == [
        ("defaults", "no-bf16"), ("no-bf16", "tuned")]


def test_trl_tables_show_every_run_and_read_older_results():
    s = {"baseline": {"rollout": 10.0, "reward": 0.0, "logprob": 0.0, "update": 5.0, "step": 15.0},
         "tlt": {"rollout": 5.0, "reward": 0.0, "logprob": 0.0, "update": 5.0, "step": 10.5}}
    old = {k: v for k, v in _trl_result("defaults", 100, 40, 360).items() if k not in ("run", "settings")}
    runs = {"defaults": old, "tuned": _trl_result("tuned", 20, 10, 20)}
    args = argparse.Namespace(prompts=16, num_generations=8, trl_steps=2)
    text = trl_peer._trl_tables(runs, trl_peer.trl_comparison(s["baseline"], runs), s, args)
    assert "| defaults | ? | True | ? x 16 | ? | ? |" in text                 # settings an older file lacks
    assert "| tuned | False | False | 8 x 16 | continuous batching | ? |" in text
    assert "| TRL defaults | 100.00 | 0.50 | 40.00 | 360.00 | 400.00 | 502.00 | 33.47x |" in text
    assert "| defaults | tuned | 5.00x | 4.00x | 18.00x | 9.65x |" in text
    assert trl_peer._trl_tables({}, None, s, args) == ""


@pytest.mark.long
def test_drafters_bench_reports_depth_accuracy_and_accept_lengths_per_drafter(tmp_path):
    from tltlib import load
    from tltlib.drafting.responses import sample_responses
    from tltlib.tasks.datasets import generate_task
    target, tok, _ = load("data/tiny-reasoner", device="cpu")
    responses = tmp_path / "r.jsonl"
    sample_responses(target, tok, generate_task("chain", 4, 7), responses, max_new_tokens=24, progress=False)
    drafters = "data/tiny-reasoner-drafter;data/tiny-reasoner-drafter-short"
    out = bench(tmp_path, "drafters", "--model", "data/tiny-reasoner", "--drafters", drafters, "--task", "chain",
                "--responses", str(responses), "--n-eval", "3", "--depth", "2", "--prompts", "2", "--max-new", "24",
                "--temperatures", "0", "--strategies", "chain-3")
    assert out.returncode == 0, out.stderr
    res = json.loads((tmp_path / "drafters-cpu-float32.json").read_text())["results"]
    assert [r["drafter"] for r in res] == drafters.split(";")
    for r in res:
        assert len(r["top1_by_depth"]) == 2 and all(0 <= a <= 1 for a in r["top1_by_depth"])
        assert list(r["accept"]) == ["chain-3@T=0"] and 1 <= r["accept"]["chain-3@T=0"] <= 4
    # the short-trained drafter is the weaker one on full-length chain problems (what notebook 05 shows)
    assert res[0]["top1_by_depth"][0] > res[1]["top1_by_depth"][0]


@pytest.mark.long
def test_long_tail_bench_with_same_lengths_runs_every_policy_on_one_schedule(tmp_path):
    """``--same-lengths``: each policy is given the lengths of its round's no-SD rollout, so every policy emits the
    same number of tokens although SD at T=0.9 samples other responses; the guarantee line is reported, over the
    timed rounds and the ``--guarantee-rounds`` (no SD, best in hindsight, adaptive only), with its intervals."""
    out = bench(tmp_path, "long_tail_rollout", "--prompts", "3", "--num-generations", "3", "--max-new", "40",
                "--repeats", "2",
                "--tune-rollouts", "1", "--threshold", "4", "--fixed-threshold", "4", "--arms", "off;chain-2",
                "--ngram-arms", "off;ngram-2", "--no-always", "--no-identity", "--same-lengths",
                "--guarantee-rounds", "2")
    assert out.returncode == 0, out.stderr
    d = json.loads((tmp_path / "long_tail_rollout-cpu-float32-3x3-same-lengths.json").read_text())
    tokens = {r["policy"]: r["tokens"] for r in d["results"]}
    assert len(tokens) == 5 and len(set(tokens.values())) == 1, tokens
    g = d["summary"]["guarantee"]
    assert d["settings"]["same_lengths"] and "met" in g and g["rounds"] == 4
    for key in ("adaptive_vs_no_sd", "ngram_adaptive_vs_no_sd", "adaptive_vs_best_in_hindsight"):
        lo, hi = g[f"{key}_paired_ci95"]
        assert lo <= g[f"{key}_paired"] <= hi
    assert out.stdout.count("[guarantee ") == 2 and "bootstrap interval" in (tmp_path / "long_tail_rollout-cpu-float32"
                                                                             "-3x3-same-lengths.md").read_text()


def test_a_recipe_sets_the_comparison_from_a_train_grpo_file(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: data/tiny-reasoner\ndrafter: data/tiny-reasoner-drafter\ntask: words\n"
                      "rewards: [accuracy, format]\ncurriculum: {levels: [1, 2]}\neval_problems: 24\n"
                      "grpo: {num_generations: 4, generation_batch_size: 16, learning_rate: 3.0e-6, "
                      "reward_weights: [1.0, 0.5]}\ntlt: {drafter_steps: 3}\n")
    ns = argparse.Namespace(recipe=str(recipe), model=None, drafter=None, trl_steps=None, probe=4, steps=5,
                            **{k: None for k in e2e_grpo.RECIPE_FLAGS})
    args = e2e_grpo._with_recipe(ns, pytest.fail)
    assert (args.prompts, args.num_generations, args.lr, args.drafter_steps, args.held_out, args.trl_steps) == \
        (4, 4, 3e-6, 3, 24, 0)
    assert args.model == "data/tiny-reasoner" and args.drafter == "data/tiny-reasoner-drafter"
    assert args.train_on == "own"
    grpo = e2e_grpo._grpo(args, seed=2)
    assert (grpo.max_steps, grpo.seed, grpo.reward_weights) == (5, 2, (1.0, 0.5))
    kw = e2e_grpo._trainer_kwargs(args)
    assert [f.__name__ for f in kw["reward_funcs"]] == ["accuracy_reward", "format_reward"]
    assert kw["curriculum"].levels == (1, 2)
    train, held, probe = e2e_grpo._data(args)
    assert len(held) == 24 and len(probe) == 4 and all(p.meta["source"] == "words" for p in train[:8] + held)
    plain = e2e_grpo._with_recipe(argparse.Namespace(recipe=None, model=None, drafter=None, trl_steps=None,
                                                     **{k: None for k in e2e_grpo.RECIPE_FLAGS}), pytest.fail)
    assert plain.lr == 1e-4 and plain.model == "data/tiny-reasoner" and plain.trl_steps == 2 and plain.job is None


def test_a_recipes_absent_model_is_replaced_by_model_before_it_is_checked(tmp_path):
    """``e2e_grpo --recipe params/train/cpu-smollm2.yaml --model X`` on a machine without the recipe's model."""
    import re
    text = re.sub(r"(?m)^model: .*$", f"model: {tmp_path / 'absent-sft'}",
                  (ROOT / "params" / "train" / "cpu-smollm2.yaml").read_text())
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    ns = argparse.Namespace(recipe=str(recipe), model="data/tiny-reasoner", drafter="data/tiny-reasoner-drafter",
                            trl_steps=None, probe=4, steps=5, **{k: None for k in e2e_grpo.RECIPE_FLAGS})
    args = e2e_grpo._with_recipe(ns, pytest.fail)
    assert (args.model, args.drafter, args.job.model) == ("data/tiny-reasoner", "data/tiny-reasoner-drafter",
                                                          "data/tiny-reasoner")
    ns = argparse.Namespace(recipe=str(recipe), model=None, drafter=None, trl_steps=None,
                            **{k: None for k in e2e_grpo.RECIPE_FLAGS})
    with pytest.raises(FileNotFoundError, match="absent-sft' does not exist"):
        e2e_grpo._with_recipe(ns, pytest.fail)


@pytest.mark.long
def test_drift_bench_writes_accuracy_and_every_drafters_curve(tmp_path):
    """A 2-step drift run of a tiny recipe: held-out accuracy at 0 and 2, probes of the online, the warm and the
    snapshot drafters for both strategies with the per-depth table, the figure; a snapshot at or after the last step
    is refused before anything loads."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: data/tiny-reasoner\ndrafter: data/tiny-reasoner-drafter\neval_problems: 3\n"
                      "grpo: {num_generations: 2, generation_batch_size: 4, max_completion_length: 32}\n"
                      "tlt: {drafter_steps: 1, drafter_batch: 2}\n")
    out = bench(tmp_path, "drift", "--recipe", str(recipe), "--steps", "2", "--eval-every", "5", "--probe", "2",
                "--probe-every", "2", "--probe-strategy", "chain-2,tree-2x2-4", "--snapshot", "1")
    assert out.returncode == 0, out.stderr
    d = json.loads((tmp_path / "drift-cpu-float32.json").read_text())
    assert d["complete"] and [e["step"] for e in d["eval"]] == [0, 2] and len(d["steps"]) == 2
    assert [r["step"] for r in d["acceptance"]] == [0, 1, 2] and d["acceptance"][-1]["online@1:tree-2x2-4"] >= 1
    md = (tmp_path / "drift-cpu-float32.md").read_text()
    assert "| step | online | frozen | online@1 |" in md and "Acceptance by draft depth" in md
    assert (tmp_path / "drift-cpu-float32.png").stat().st_size > 0
    late = bench(tmp_path / "late", "drift", "--recipe", str(recipe), "--steps", "2", "--snapshot", "2")
    assert_one_line_error(late, "--snapshot 2 is not before the last step (2)")
    assert not (tmp_path / "late").exists()


@pytest.mark.long
def test_two_worker_comparison_evaluates_the_policies_after_the_workers(tmp_path):
    """``e2e_grpo --workers 2``: the three runs' held-out accuracy is measured by the launcher from the policies the
    workers wrote (inside the workers it ran out of memory on SmolLM2)."""
    out = bench(tmp_path, "e2e_grpo", "--workers", "2", "--steps", "1", "--prompts", "2", "--num-generations", "2",
                "--max-new", "24", "--held-out", "2", "--probe", "1", "--probe-strategy", "chain-2")
    assert out.returncode == 0, out.stderr
    d = json.loads((tmp_path / "e2e_grpo-cpu-float32-w2.json").read_text())
    assert sorted(d["runs"]) == ["baseline", "tlt", "tlt-frozen"]
    assert all(0.0 <= r[0]["eval/accuracy"] <= 1.0 and len(r[0]["steps"]) == 1 for r in d["runs"].values())
    assert "held-out accuracy" in out.stdout and "Held-out accuracy: baseline" in \
        (tmp_path / "e2e_grpo-cpu-float32-w2.md").read_text()


@pytest.mark.long
def test_native_rollout_bench_compares_both_layer_paths_on_the_same_tokens(tmp_path):
    """Both layer paths, without SD and with it, interleaved: the same tokens (the C++ layers compute the Python
    layers' hidden states bit for bit), a paired speedup with its interval, SD against no SD per path."""
    out = bench(tmp_path, "native_rollout", "--prompts", "2", "--num-generations", "2", "--max-new", "24",
                "--repeats", "1", "--strategies", "chain-4")
    assert out.returncode == 0, out.stderr
    d = json.loads((tmp_path / "native_rollout-cpu-float32.json").read_text())
    res = {r["strategy"]: r for r in d["results"]}
    assert set(res) == {"no SD", "chain-4"}
    assert all(r["identical_tokens"] and r["native_speedup"] > 0 for r in res.values())
    lo, hi = res["chain-4"]["native_speedup_ci95"]
    assert lo <= res["chain-4"]["native_speedup"] <= hi and res["chain-4"]["native_vs_no_sd"] > 0
    assert "python_vs_no_sd" not in res["no SD"]
    bad = bench(tmp_path, "native_rollout", "--strategies", "chain-x", "--repeats", "1")
    assert bad.returncode != 0 and "--strategies" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.long
def test_kv_cache_bench_runs_both_caches_on_one_workload_and_names_the_cpu(tmp_path):
    """Paged and dense on the same prompts and seed give the same tokens; the paged pool's peak is within a page per
    row of the tokens held, the dense allocation far above it, the memory check's estimate from the rollout's lengths
    near the paged peak; the file is named after this machine's CPU."""
    from tltlib.machine import this_machine
    out = bench(tmp_path, "kv_cache", "--prompts", "3", "--num-generations", "2", "--max-new", "24", "--repeats", "1",
                "--page-size", "4")
    assert out.returncode == 0, out.stderr
    d = json.loads((tmp_path / f"kv_cache-cpu-float32-{this_machine().slug}-3x2-24.json").read_text())
    res = {r["kv"]: r for r in d["results"]}
    assert res["paged"]["identical_tokens"] and res["dense"]["identical_tokens"]
    assert 1.0 <= res["paged"]["kv_over_held"] < res["dense"]["kv_over_held"]
    assert 0.85 < res["paged"]["estimate_over_peak"] < 1.15 and "estimate_over_peak" not in res["dense"]
    assert d["paged_over_dense_speed"] > 0


@pytest.mark.long
def test_kv_cache_attention_grid_checks_the_paged_kernels_against_the_gathered_path(tmp_path):
    """``--attention``: every cell of rows x new tokens first checks the paged kernel's output against gather + the
    dense path (a mismatch fails the run), then times both; the file names this machine's CPU."""
    from tltlib.kernels import ragged_attention as ra
    from tltlib.machine import this_machine
    if ra.kernel() is None:
        pytest.skip("no C++ compiler: the paged kernels cannot be built here")
    out = bench(tmp_path, "kv_cache", "--attention", "--repeats", "1")
    assert out.returncode == 0, out.stderr
    d = json.loads((tmp_path / f"kv_attention-cpu-float32-{this_machine().slug}.json").read_text())
    cells = {(r["rows"], r["new_tokens"]) for r in d["results"]}
    assert (2, 1) in cells and (128, 33) in cells and (d["heads"], d["kv_heads"], d["head_dim"]) == (6, 3, 32)
    assert all(r["paged_us"] > 0 and r["gathered_us"] > 0 for r in d["results"])


@pytest.mark.long
def test_decode_breakdown_adds_up_and_names_its_floor(tmp_path):
    """``bench decode_breakdown`` on the tiny reasoner: each part of a step is non-negative, the parts add up to the
    step (outside the layers is the rest), the memory floor is the weights plus the K/V read at the bandwidth
    measured around each step, each step over its own floor; the native step (the C++ stack) beside the Python
    layers' and with ``--compile`` the compiled step."""
    out = bench(tmp_path, "decode_breakdown", "--model", "data/tiny-reasoner", "--task", "chain", "--rows", "1,3",
                "--new-tokens", "16", "--repeats", "2", "--compile")
    assert out.returncode == 0, out.stderr
    d = json.loads((tmp_path / "decode_breakdown-cpu-float32.json").read_text())
    assert [r["rows"] for r in d["results"]] == [1, 3] and d["bandwidth_gb_s"] > 0
    for r in d["results"]:
        parts = [r[k] for k in ("attention_ms", "projections_ms", "small_ops_ms", "outside_ms")]
        assert r["step_ms"] > 0 and r["projections_ms"] > 0 and r["outside_ms"] >= 0
        assert sum(parts) == pytest.approx(r["step_ms"], rel=1e-6) or r["outside_ms"] == 0   # the rest, if any
        # each step over its own floor (the bandwidth read around it), the median of those
        floors = r["floors_ms"]
        assert len(floors) == len(r["probes_gb_s"]) == len(r["native_steps_ms"]) == 2
        assert all(len(p) == 4 and min(p) > 0 for p in r["probes_gb_s"])      # around eager, native, compiled
        assert r["floor_ms"] == pytest.approx(statistics.median(floors))
        assert r["step_over_floor"] == pytest.approx(statistics.median(
            s / f for s, f in zip(r["eager_steps_ms"], r["eager_floors_ms"])))
        assert r["native_over_floor"] == pytest.approx(statistics.median(
            s / f for s, f in zip(r["native_steps_ms"], floors)))
        assert r["compiled_speedup"] == pytest.approx(r["step_ms"] / r["compiled_step_ms"])
        assert r["native_step_ms"] > 0
    low, high = d["bandwidth_range_gb_s"]
    assert low <= d["bandwidth_gb_s"] <= high
    assert d["bandwidth_read"] == _common.BANDWIDTH_READS
    assert d["floor_bracketed"] and f"memory floor at the read bandwidth ({_common.BANDWIDTH_READS}) measured just " \
        "before and just after each step's rollouts" in (tmp_path / "decode_breakdown-cpu-float32.md").read_text()


def test_the_breakdown_sets_the_step_on_4_kib_pages_beside_the_step_on_huge_ones():
    """Given a copy of the model on the allocator's pages (the bench makes one where the loader placed the weights
    on huge pages), each round also times the native step on it: huge pages' speedup is the median of the rounds'
    paired ratios, and without the copy there is no such column."""
    from dataclasses import replace
    from types import SimpleNamespace

    import decode_breakdown as bd
    from tltlib.model.loading import load
    from tltlib.model.sampling import SamplingConfig
    from tltlib.rollout.engine import RolloutConfig, RolloutEngine
    loaded = load("data/tiny-reasoner", device="cpu")
    config = RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=4), ignore_eos=True)
    one = replace(config, sampling=replace(config.sampling, max_new_tokens=1))
    python, native = (lambda c: replace(c, native_layers=False)), (lambda c: replace(c, native_layers=True))
    engines = {"eager": python(config), "eager-1": python(one), "native": native(config), "native-1": native(one)}
    engines = {k: RolloutEngine(loaded.model, c) for k, c in engines.items()}
    args = SimpleNamespace(task="chain", new_tokens=4, repeats=3)
    rec = bd.measure_rows(1, args, loaded.tokenizer, engines, bandwidth=lambda: (1e10, 1 << 30))
    assert "huge_pages_speedup" not in rec
    engines.update({"native-small-pages": engines["native"], "native-small-pages-1": engines["native-1"]})
    rec = bd.measure_rows(1, args, loaded.tokenizer, engines, bandwidth=lambda: (1e10, 1 << 30))
    small, huge = rec["small_pages_steps_ms"], rec["native_steps_ms"]
    assert len(small) == len(huge) == 3 and rec["small_pages_step_ms"] == pytest.approx(statistics.median(small))
    assert rec["huge_pages_speedup"] == pytest.approx(statistics.median(a / b for a, b in zip(small, huge)))


def test_each_step_is_set_against_the_bandwidth_read_just_before_and_just_after_it():
    """Reads of 10, 20, 40, 80 GB/s around the Python layers', the native and the 4 KiB-pages steps of a round (then
    the same again): the native step's floor is the mean of its floors at 20 and 40 GB/s, the Python layers' at 10
    and 20; a floor from one read per round (80 GB/s, after all) would be a third of the native's."""
    from dataclasses import replace
    from types import SimpleNamespace

    import decode_breakdown as bd
    from tltlib.model.loading import load
    from tltlib.model.sampling import SamplingConfig
    from tltlib.rollout.engine import RolloutConfig, RolloutEngine
    loaded = load("data/tiny-reasoner", device="cpu")
    config = RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=4), ignore_eos=True)
    one = replace(config, sampling=replace(config.sampling, max_new_tokens=1))
    engines = {"eager": replace(config, native_layers=False), "eager-1": replace(one, native_layers=False),
               "native": config, "native-1": one, "native-small-pages": config, "native-small-pages-1": one}
    engines = {k: RolloutEngine(loaded.model, c) for k, c in engines.items()}
    reads = iter([10e9, 20e9, 40e9, 80e9] * 2)
    rec = bd.measure_rows(1, SimpleNamespace(task="chain", new_tokens=4, repeats=2), loaded.tokenizer, engines,
                          bandwidth=lambda: (next(reads), 1 << 30))
    assert rec["probes_gb_s"] == [[10.0, 20.0, 40.0, 80.0]] * 2
    prompts = bd.task_prompts("chain", loaded.tokenizer, 1, seed=1)
    size = bd.step_bytes(loaded.model, 1, statistics.mean(map(len, prompts)) + 2)
    assert rec["floors_ms"] == pytest.approx([(size / 20e9 + size / 40e9) / 2 * 1e3] * 2)
    assert rec["eager_floors_ms"] == pytest.approx([(size / 10e9 + size / 20e9) / 2 * 1e3] * 2)
    assert rec["native_over_floor"] == pytest.approx(statistics.median(
        s / f for s, f in zip(rec["native_steps_ms"], rec["floors_ms"])))


def test_a_bandwidth_reader_allocates_its_buffer_once_for_all_its_reads(monkeypatch):
    """``bench decode_breakdown`` reads the bandwidth around every step: one buffer for the run, not one per read."""
    import torch
    made = []
    monkeypatch.setattr(_common, "_bandwidth_buffer", lambda: made.append(1) or torch.ones(1 << 16))
    read = _common.bandwidth_reader(repeats=2)
    assert made == []                                                    # nothing until the first read
    reads = [read() for _ in range(3)]
    assert made == [1] and all(rate > 0 and size == 4 << 16 for rate, size in reads)


def test_the_bandwidth_is_the_faster_of_a_sum_and_the_stream_kernels_read(monkeypatch):
    """The floor's bandwidth: both reads go over the whole buffer (the sum's value, the stream read's row sums; a tail
    under 1,024 floats left out), and the faster one's rate is taken (a fake clock: the sum takes 2 s, the kernel 1 s;
    then the other way round)."""
    import torch
    buffer = torch.arange(5000, dtype=torch.float32)
    reads = _common.bandwidth_reads(buffer)
    if len(reads) == 1:
        pytest.skip("the CPU kernels cannot be built here: the sum alone")
    assert reads[0]() == buffer.sum()
    torch.testing.assert_close(reads[1]().view(-1), buffer[:4096].view(4, 1024).sum(1))
    for sum_s, kernel_s in ((2.0, 1.0), (1.0, 4.0)):
        clock = [0.0]
        fake = [lambda: clock.__setitem__(0, clock[0] + sum_s), lambda: clock.__setitem__(0, clock[0] + kernel_s)]
        monkeypatch.setattr(_common, "bandwidth_reads", lambda b: fake)
        monkeypatch.setattr(_common.time, "perf_counter", lambda: clock[0])
        rate, size = _common._read_rate(buffer, 3)
        assert size == 20000 and rate == pytest.approx(20000 / min(sum_s, kernel_s))


def test_the_breakdown_times_every_projection_attention_and_layer_of_a_step():
    """One cached forward of the tiny reasoner under the breakdown's timers: each layer's four projections and the
    LM head charged as projections, each layer's attention and the layer itself counted once (a timer the model
    bypasses would charge the projections' time to the small ops)."""
    import torch

    import decode_breakdown as bd
    from tltlib.model.loading import load
    model = load("data/tiny-reasoner").model
    layers = model.config.num_layers
    timers = bd.Timers()
    with torch.no_grad(), bd.instrumented(timers):
        model.forward_cached(torch.tensor([[1, 5, 6], [2, 7, 8]]), model.new_cache(2, 8))
    assert timers.calls == {"projections": 4 * layers + 1, "attention": layers, "layer": layers}
    assert all(v > 0 for v in timers.spent.values())


def test_step_bytes_counts_the_weights_once_and_the_cached_kv_per_row():
    """The weights a step reads once (an untied input embedding is a gather of a few rows: not counted) plus each
    row's K/V at the mean length."""
    import decode_breakdown as bd
    from tltlib.model.decoder import ModelConfig, Transformer
    kv_per_token = 2 * 2 * 2 * 8 * 4                                 # K and V, 2 layers, 2 KV heads, 8 dims, float32
    for tied in (True, False):
        cfg = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                          num_kv_heads=2, tie_word_embeddings=tied)
        model = Transformer(cfg)
        weights = sum(p.numel() for p in model.parameters()) * 4 - (0 if tied else 50 * 32 * 4)
        assert bd.step_bytes(model, rows=3, mean_len=10) == weights + 3 * 10 * kv_per_token


@pytest.mark.long
def test_decode_with_compile_runs_the_compiled_layers_side_by_side(tmp_path):
    """``bench decode --compile``: a fourth column, the compiled layers' speed and its ratio to tltlib eager, with
    tokens identical to transformers'; its own results file, the compile seconds recorded."""
    out = bench(tmp_path, "decode", "--batches", "1,2", "--new-tokens", "8", "--repeats", "1", "--vllm", "off",
                "--compile")
    assert out.returncode == 0, out.stderr
    d = json.loads((tmp_path / "decode-cpu-float32-compile.json").read_text())
    for r in d["results"]:
        assert r["compiled_identical"] and r["identical_tokens"]
        compiled_s = r["batch"] * r["new_tokens"] / r["compiled_tok_s"]
        assert r["ratio_compiled"] == pytest.approx(r["tltlib_s"] / compiled_s)
    assert d["compile_seconds"] > 0
