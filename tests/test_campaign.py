"""The GPU campaign for a 15-minute loan (bench/gpu/campaign.py, bench/gpu/payload.py), rehearsed on this CPU so that
a device call cannot fail on anything testable here: every GPU-size command parses with its bench's own parser;
the calls run at tiny sizes as the GPU machine would run them (its missing packages unimportable from this venv,
pip with no index, the carried files in their own folder, the stash between calls); each payload is checked against
64 MiB; bad input (a corrupt GGUF part, a missing model, an oversized call, a dirty data/) is one clear error."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "bench" / "gpu"
sys.path.insert(0, str(GPU))
sys.path.insert(0, str(ROOT / "bench"))

import campaign  # noqa: E402
import payload  # noqa: E402


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_gpu_size_command_parses_with_its_benchs_own_parser(tmp_path, monkeypatch):
    """What calls a, b, b2 and c run on the GPU, at the GPU's sizes, parsed as the benches and the CLI parse them
    (models and drafters: the tiny reasoner's folders standing in for what the calls carry)."""
    from _common import MALLOC
    from tltlib.cli.parser import build_parser
    for k, v in MALLOC.items():                 # set: the benches' parse re-execs the process without them
        monkeypatch.setenv(k, v)
    model, drafter = ROOT / "data" / "tiny-reasoner", ROOT / "data" / "tiny-reasoner-drafter"
    seen = set()
    for call, spec in campaign.CALLS.items():
        ctx = campaign.Context(call, tmp_path, tmp_path, tmp_path, tiny=False, model=model, drafter=drafter)
        for step in spec.steps:
            if step in ("graphs", "long_tail", "grpo", "kv_cache"):
                args = campaign.bench_args(ctx, step)
                assert args[0] == "bench"
                dev = ["--device", "cuda"] if step == "graphs" else campaign.device_flags(False)
                parsed = _bench_module(args[1]).parse_args([*args[2:], *dev, "--out", str(tmp_path)])
                assert parsed.device == "cuda"
                seen.add((call, step))
            elif step == "attention":
                _bench_module("triton_attention").parse_args(campaign.bench_args(ctx, step))
                seen.add((call, step))
    assert {("a", "graphs"), ("b", "long_tail"), ("b", "grpo"), ("b2", "long_tail"), ("c", "kv_cache"),
            ("c", "attention")} <= seen
    ctx = campaign.Context("b", tmp_path, tmp_path, tmp_path, tiny=False, model=model, drafter=drafter)
    assert "--recipe" in campaign.bench_args(ctx, "grpo")                  # the words recipe, SmolLM2's prompts
    cli = build_parser()
    cli.parse_args(["import-gguf", "x.gguf", str(tmp_path / "m")])
    cli.parse_args(["warm-start", "--model", str(model), "--out", str(tmp_path / "w"), "--overwrite", "--quiet"])
    for spec in campaign.CALLS.values():                    # the device tool's limits
        assert spec.timeout_s <= 600 and len(spec.carry) <= 8 and set(spec.steps) <= set(campaign.STEP_TIMEOUT)
    a, b = campaign.CALLS["a"].timeout_s, campaign.CALLS["b"].timeout_s
    assert (a + b) / 60 < 15 - 1.5               # both calls and a machine start fit the 15-minute loan


def test_a_call_never_runs_past_its_budget(tmp_path):
    """Each step is cut to what the call has left (``--budget``), and one that could not start is skipped, so the
    tarball always comes back (on a fake clock: nothing here judges this machine's speed)."""
    now = [1000.0]
    ctx = campaign.Context("c", tmp_path, tmp_path, tmp_path, True, deadline=1035.0, clock=lambda: now[0])
    assert ctx.seconds_for("kv_cache") == 35 and ctx.seconds_for("stash") == campaign.STEP_TIMEOUT["stash"] == 30
    ctx.slack = campaign.REHEARSAL_SLACK                       # a rehearsal's caps: still cut to the budget
    assert ctx.seconds_for("stash") == 35
    now[0] = 1032.0
    rec = campaign.run_step(ctx, "kv_cache")
    assert rec == {"step": "kv_cache", "status": "skipped", "seconds": 0.0,
                   "note": "3 s left in the call's budget: not started"}


def _call(call, root, tmp, timeout=900):
    """``campaign.py CALL --tiny`` as the device runs it: the GPU image's missing packages hidden, pip offline."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "device_site"), str(ROOT)]),
           "PIP_NO_INDEX": "1", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run([sys.executable, str(GPU / "campaign.py"), call, "--tiny", "--carried", str(root),
                           "--stash", str(tmp / "stash"), "--out", str(tmp / "out"), "--scratch",
                           str(tmp / f"scratch-{call}")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _summary(tmp, call) -> dict:
    with tarfile.open(tmp / "out" / f"call-{call}.tgz") as tar:
        names = tar.getnames()
        assert f"call-{call}/call-{call}.log" in names and f"call-{call}/probe.json" in names, names
        return json.load(tar.extractfile(f"call-{call}/summary.json"))


def _status(summary) -> dict:
    return {r["step"]: r["status"] for r in summary["steps"]}


@pytest.mark.long
def test_the_calls_run_at_tiny_sizes_as_the_gpu_machine_runs_them(tmp_path):
    """a stashes GGUF part 0 (its GPU steps fail on a CPU, recorded, and the call goes on to its tarball); b installs
    the carried gguf wheel (the venv's own hidden), joins the stashed and the carried part, checks both hashes,
    imports and warm-starts the model, runs the long-tail and GRPO benches (on the tiny reasoner as b2 carries it:
    b2 is those two steps); c runs its paged-vs-dense bench. Every call ends with one tarball, its tables last."""
    carried = tmp_path / "carried"
    manifest = payload.prepare_tiny(carried)
    a = _call("a", carried, tmp_path)
    st = _summary(tmp_path, "a")
    assert _status(st) == {"probe": "ok", "stash": "ok", "gpu_tests": "failed", "graphs": "failed"}, a.stdout
    notes = {r["step"]: r["note"] for r in st["steps"]}
    assert "no GPU test ran" in notes["gpu_tests"] and "needs a CUDA device" in notes["graphs"]
    assert (tmp_path / "stash" / "gguf.part0").read_bytes() == (carried / ".gpu" / "gguf.part0").read_bytes()
    assert a.returncode == 1 and a.stdout.rstrip().endswith("|") and "| stash | ok |" in a.stdout

    os.remove(carried / ".gpu" / "gguf.part0")               # b finds part 0 only in a's stash
    b = _call("b", carried, tmp_path)
    st = _summary(tmp_path, "b")
    assert set(_status(st).values()) == {"ok"}, b.stdout[-3000:]
    assert (tmp_path / "stash" / "smollm2-135m" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "stash" / "smollm2-135m" / "tltlib-import.json").read_text())["source"]
    assert manifest["gguf"] == "tiny.gguf" and st["carried"] == list(campaign.CALLS["b"].carry)
    assert any(g.startswith("long tail: adaptive") for g in st["goals"]) and any(g.startswith("GRPO: step")
                                                                                 for g in st["goals"])
    assert "tiny-reasoner" in b.stdout            # its benches ran on the tiny reasoner as b2 carries it (.gpu/)
    c = _call("c", carried, tmp_path)
    assert _status(_summary(tmp_path, "c"))["kv_cache"] == "ok", c.stdout[-3000:]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"call-{x}.tgz" for x in ("a", "b", "c")]


def test_a_corrupt_or_missing_gguf_part_is_one_clear_error(tmp_path):
    """A part whose bytes are not the manifest's is refused before anything is joined; without call a's stash,
    call b says to run b2."""
    carried = tmp_path / "carried"
    payload.prepare_tiny(carried)
    part = carried / ".gpu" / "gguf.part0"
    part.write_bytes(part.read_bytes()[:-1] + b"\0")
    ctx = campaign.Context("a", tmp_path / "out", tmp_path / "s", tmp_path / "stash", True, carried=carried)
    with pytest.raises(campaign.StepFailed, match="gguf.part0 has sha256 .* not .* as .gpu/manifest.json says: a "
                                                  "part from another split or cut short"):
        campaign.step_stash(ctx)
    assert not (tmp_path / "stash").exists()
    part.unlink()
    ctx.call = "b"
    with pytest.raises(campaign.StepFailed, match="call a's machine was given back before this call .* run call b2"):
        campaign.step_model(ctx)


def test_without_the_carried_wheel_call_b_names_it_and_installs_nothing(tmp_path, monkeypatch):
    """The GPU image has no gguf: call b without ``.whl`` fails its wheels step, then its import names the wheel to
    carry (the child processes see the device's imports, pip has no index)."""
    carried = tmp_path / "carried"
    payload.prepare_tiny(carried)
    for w in (carried / ".whl").iterdir():
        w.unlink()
    (tmp_path / "stash").mkdir()
    (carried / ".gpu" / "gguf.part0").rename(tmp_path / "stash" / "gguf.part0")
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests" / "device_site"))
    ctx = campaign.Context("b", tmp_path / "out", tmp_path / "scratch", tmp_path / "stash", True,
                           env=campaign.call_env(), carried=carried)
    ctx.results.mkdir(parents=True)
    ctx.log.touch()
    wheels, model = campaign.run_step(ctx, "wheels"), campaign.run_step(ctx, "model")
    assert wheels["status"] == "failed" and ".whl/ holds no wheel: carry .whl" in wheels["note"]
    assert model["status"] == "failed" and model["note"].startswith("exit status 1: error: reading a GGUF file needs "
                                                                    "gguf") and "gguf-0.19.0-py3-none-any.whl" in \
        model["note"], model
    assert not (tmp_path / "stash" / "smollm2-135m").exists()


def test_the_joined_parts_must_decompress_to_the_manifests_file(tmp_path):
    manifest = payload.split_xz(b"gguf" * 1000, "0" * 64, "x.gguf", tmp_path, first=10)
    assert [p["bytes"] for p in manifest["parts"]][0] == 10
    with pytest.raises(campaign.StepFailed, match="decompress to a file of sha256 .* not the manifest's 0000"):
        campaign.join_parts([tmp_path / "gguf.part0", tmp_path / "gguf.part1"], tmp_path / "x.gguf", manifest)
    assert not (tmp_path / "x.gguf").exists()
    import hashlib
    good = payload.split_xz(b"gguf" * 1000, hashlib.sha256(b"gguf" * 1000).hexdigest(), "x.gguf", tmp_path)
    campaign.join_parts([tmp_path / "gguf.part0", tmp_path / "gguf.part1"], tmp_path / "x.gguf", good)
    assert (tmp_path / "x.gguf").read_bytes() == b"gguf" * 1000


def test_a_bench_step_without_its_model_folder_says_what_to_carry(tmp_path):
    ctx = campaign.Context("b2", tmp_path, tmp_path, tmp_path, True, carried=tmp_path / "nowhere")
    campaign.inputs(ctx)
    ctx.log.parent.mkdir(parents=True, exist_ok=True)
    rec = campaign.run_step(ctx, "long_tail")
    assert rec["status"] == "failed" and "no model at" in rec["note"] and "tiny-reasoner" in rec["note"] \
        and "payload.py plan" in rec["note"]
    rec = campaign.run_step(campaign.Context("c", tmp_path, tmp_path, tmp_path / "stash", False), "kv_cache")
    assert rec["status"] == "failed" and "no model at None" in rec["note"]


def _repo(tmp_path) -> Path:
    root = tmp_path / "repo"
    (root / "data" / "m").mkdir(parents=True)
    (root / "data" / "m" / "w.bin").write_bytes(b"x" * 1000)
    (root / "README.md").write_text("hi\n")
    (root / ".gitignore").write_text("/.gpu/\n/.whl/\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([*git, "add", "-A"], cwd=root, check=True)
    subprocess.run([*git, "commit", "-qm", "x"], cwd=root, check=True)
    return root


def test_a_call_over_64_mib_is_refused_naming_its_biggest_parts(tmp_path, monkeypatch):
    root = _repo(tmp_path)
    (root / ".gpu").mkdir()
    for name in ("manifest.json", "gguf.part0"):
        (root / ".gpu" / name).write_bytes(b"{}")
    parts = payload.check_call(root, "a")
    assert parts["carry: .gpu/gguf.part0"] == 2 and parts["tree: data/"] == 1000
    assert "carry: .gpu/manifest.json" in parts and sum(parts.values()) < payload.LIMIT
    monkeypatch.setattr(payload, "LIMIT", 1010)
    with pytest.raises(payload.Refused, match=r"call a would carry 0.0 MiB, over the device tool's 64 MiB: tree: "
                                              r"data/ 0.0 MiB.*move data/ out of the tree first"):
        payload.check_call(root, "a")
    with pytest.raises(payload.Refused, match="call b carries .gpu/gguf.part1, .gpu/smollm2-135m-drafter, .whl, "
                                              "which this checkout lacks: run `python bench/gpu/payload.py prepare`"):
        payload.check_call(root, "b")
    out = subprocess.run([sys.executable, str(GPU / "payload.py"), "plan", "a", "--root", str(root)],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "run: command 'bash bench/gpu/call.sh a', carry [\".gpu/manifest.json\"" in \
        out.stdout
    bad = subprocess.run([sys.executable, str(GPU / "payload.py"), "plan", "z", "--root", str(root)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip() == "payload: no call z: the calls are a, b, b2, c"


def test_stage_moves_data_out_of_the_tree_and_restore_brings_it_back(tmp_path):
    root = _repo(tmp_path)
    assert "data/ moved" in payload.stage(root)
    assert not (root / "data").exists() and "tree: data/" not in payload.payload(root, "c")
    with pytest.raises(payload.Refused, match="an earlier stage not restored"):
        (root / "data").mkdir()
        payload.stage(root)
    (root / "data").rmdir()
    assert payload.restore(root) == "data/ is back" and (root / "data" / "m" / "w.bin").read_bytes() == b"x" * 1000
    (root / "data" / "m" / "w.bin").write_bytes(b"changed")
    with pytest.raises(payload.Refused, match="data/ has uncommitted changes .* commit them first"):
        payload.stage(root)
    assert (root / "data").is_dir()
