"""The GPU campaign (issue 39): what a session with a lent GPU runs first, in stages of one device call each.

    bash bench/gpu/campaign.sh STAGE                     # on the lent GPU machine (through the device tool)
    python bench/gpu/campaign.py STAGE --tiny            # the same stage on this CPU at tiny sizes (the tests do)

Stages, in priority order (a stage that needs what an earlier one makes refuses, naming that stage):

    tests       a: ``pytest -m gpu`` (the CUDA tests)
    model       the SmolLM2-135M target, imported from its GGUF file carried under .gpu/ (the GPU machine cannot
                download; see bench/gpu/NOTES.md); tiny: the shipped tiny reasoner
    long_tail   b: the long-tail rollout (64 prompts x 8, up to 2,048 new tokens, bf16, CUDA graphs, paged KV):
                adaptive SD vs no SD (bench long_tail_rollout); needs model
    grpo        c: GRPO with TLT vs the baseline on the warm-started target, 8 steps each (bench e2e_grpo: step
                time by phase, speedup and its Amdahl bound, reward curves); needs model
    drafter     d: the target's drafter trained towards its goal (depth-1 top-1 >= 70%): its own responses sampled,
                then train-drafter; the drafter folder is kept in the work folder for stage notebooks; needs model
    notebooks   e: the notebooks through papermill with a GPU parameter file, the stage-d drafter as DRAFTER_PATH
                (papermill and jupyter installed from wheels carried under .whl/); needs drafter

Every stage writes ``campaign-STAGE.json`` and ``.md`` to ``--out`` when it ends (status, seconds, the commands,
device and versions, the files it made), so a call cut off by the device tool's limit keeps what finished; the
benches' own results land beside them. Sizes are in :data:`SIZES` (``gpu`` and ``tiny``); each stage's commands fit
one call of under 10 minutes at the ``gpu`` sizes by the H100 rates in bench/gpu/NOTES.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("tests", "model", "long_tail", "grpo", "drafter", "notebooks")
NEEDS = {"long_tail": "model", "grpo": "model", "drafter": "model", "notebooks": "drafter"}
GGUF_SHA = "b179c9523d0e6a0f98a3"                  # the carried SmolLM2-135M-Instruct.Q4_1.gguf, first 20 hex

SIZES = {
    "gpu": {"device": ["--device", "cuda", "--dtype", "bfloat16"], "pytest": ["-m", "gpu", "tests/"],
            "long_tail": ["--task", "words", "--prompts", "64", "--num-generations", "8", "--max-new", "2048",
                          "--arms", "off;chain-4;chain-8;tree-6x4-24", "--ngram-arms", "off;ngram-4",
                          "--repeats", "1", "--tune-rollouts", "1", "--no-always", "--no-identity"],
            "warm": ["--steps", "60", "--batch", "8"],
            "grpo": ["--steps", "8", "--seeds", "2", "--prompts", "16", "--num-generations", "8", "--max-new", "512",
                     "--trl-steps", "0", "--held-out", "64", "--probe", "8"],
            "sample": ["--n", "16384", "--batch", "512", "--max-new-tokens", "512"],
            "train": ["--dataset", "words", "--n-train", "100000", "--n-eval", "64", "--n-accept", "16",
                      "--max-new-tokens", "512", "--steps", "6000", "--minutes", "8", "--batch", "32",
                      "--unroll", "3", "--ce-positions", "1024", "--draft-vocab", "4096"],
            "params": "params/cpu-smollm2.yaml", "only": []},     # SmolLM2's sizes, on CUDA in bf16
    "tiny": {"device": ["--device", "cpu"], "pytest": ["-m", "gpu", "tests/test_cudagraph.py"],
             "long_tail": ["--task", "chain", "--prompts", "2", "--num-generations", "2", "--max-new", "24",
                           "--arms", "off;chain-4", "--ngram-arms", "off;ngram-4", "--repeats", "1",
                           "--tune-rollouts", "0", "--no-always", "--no-identity", "--threshold", "4",
                           "--fixed-threshold", "4"],
             "warm": None,
             "grpo": ["--steps", "1", "--seeds", "1", "--prompts", "2", "--num-generations", "2", "--max-new", "16",
                      "--trl-steps", "0", "--held-out", "4", "--probe", "0"],
             "sample": None,
             "train": ["--dataset", "chain", "--n-train", "8", "--n-eval", "4", "--n-accept", "2",
                       "--max-new-tokens", "32", "--steps", "2", "--batch", "4"],
             "params": "params/smoke.yaml", "only": ["--only", "01"]},
}


class StageMissing(SystemExit):
    pass


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="The GPU campaign of issue 39, one stage per call.")
    ap.add_argument("stage", choices=STAGES)
    ap.add_argument("--tiny", action="store_true", help="tiny sizes on this machine's CPU (the tests run these)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"), help="results folder (default $OUT)")
    ap.add_argument("--work", default=os.environ.get("CAMPAIGN_WORK", "/tmp/campaign"),
                    help="where stages keep what later stages read: the model, the drafter (default /tmp/campaign)")
    return ap.parse_args(argv)


def _made(work: Path, stage: str) -> Path | None:
    """What ``stage`` made in ``work`` (the folder a later stage reads), or None."""
    mark = work / f"{stage}.done"
    return Path(mark.read_text().strip()) if mark.exists() else None


def _need(work: Path, stage: str) -> Path:
    need = NEEDS.get(stage)
    if need is None:
        return work
    made = _made(work, need)
    if made is None or not made.exists():
        raise StageMissing(f"error: stage {stage} needs what stage {need} makes, and {work} has none: run "
                           f"`campaign.sh {need}` first (same --work)")
    return made


def _run(cmd: list[str], log: Path, timeout: int, record: list) -> int:
    """Run ``cmd`` from the project root with its output appended to ``log``; record it; its exit status."""
    t0 = time.time()
    with open(log, "a") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    record.append({"command": shlex.join(cmd), "rc": rc, "seconds": round(time.time() - t0, 1)})
    return rc


def _tltlib(*args: str) -> list[str]:
    return [sys.executable, "-m", "tltlib", *args]


def stage_tests(size, work, out, log, rec) -> dict:
    rc = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *size["pytest"]], log, 420, rec)
    tail = [line for line in log.read_text().splitlines() if " passed" in line or " skipped" in line
            or " failed" in line or "deselected" in line]
    return {"ok": rc in (0, 5), "summary": tail[-1] if tail else ""}


def stage_model(size, work, out, log, rec, tiny) -> dict:
    if tiny:
        model = ROOT / "data" / "tiny-reasoner"
    else:
        model, parts = work / "smollm2-135m", sorted((ROOT / ".gpu").glob("gguf.part*"))
        if not model.exists():
            import hashlib
            blob = b"".join(p.read_bytes() for p in parts)
            if hashlib.sha256(blob).hexdigest()[:20] != GGUF_SHA:
                raise SystemExit(f"error: stage model needs SmolLM2's GGUF file carried as .gpu/gguf.part* "
                                 f"({len(parts)} part(s) here do not make it; see bench/gpu/NOTES.md)")
            gguf = work / "SmolLM2-135M-Instruct.Q4_1.gguf"
            gguf.write_bytes(blob)
            if _run(_tltlib("import-gguf", str(gguf), str(model)), log, 300, rec):
                return {"ok": False}
            gguf.unlink()
    (work / "model.done").write_text(str(model))
    return {"ok": True, "model": str(model)}


def _drafter(work: Path, tiny: bool) -> str:
    made = _made(work, "drafter")
    if made is not None and made.exists():
        return str(made)
    return str(ROOT / "data" / ("tiny-reasoner-drafter" if tiny else "smollm2-135m-drafter"))


def stage_long_tail(size, work, out, log, rec, tiny) -> dict:
    model = _need(work, "long_tail")
    rc = _run(_tltlib("bench", "long_tail_rollout", "--model", str(model), "--drafter", _drafter(work, tiny),
                      *size["device"], *size["long_tail"], "--out", str(out)), log, 560, rec)
    return {"ok": rc == 0}


def stage_grpo(size, work, out, log, rec, tiny) -> dict:
    model = _need(work, "grpo")
    warm = model
    if size["warm"] is not None:
        warm = work / "warm"
        if not warm.exists() and _run(_tltlib("warm-start", "--model", str(model), "--out", str(warm),
                                               *size["warm"], "--quiet"), log, 240, rec):
            return {"ok": False}
    rc = _run(_tltlib("bench", "e2e_grpo", "--model", str(warm), "--drafter", _drafter(work, tiny),
                      *size["device"], *size["grpo"], "--out", str(out)), log, 560, rec)
    return {"ok": rc == 0, "warm_start": str(warm)}


def stage_drafter(size, work, out, log, rec, tiny) -> dict:
    model = _need(work, "drafter")
    drafter = work / "drafter"
    extra = []
    if size["sample"] is not None:
        responses = work / "responses.jsonl"
        if _run(_tltlib("sample-responses", "--model", str(model), "--out", str(responses), *size["sample"],
                        "--device", "cuda", "--quiet"), log, 300, rec):
            return {"ok": False}
        extra = ["--responses", str(responses)]
    rc = _run(_tltlib("train-drafter", "--model", str(model), "--out", str(drafter), "--overwrite",
                      *size["train"], *extra, *size["device"][:2], "--quiet"), log, 560, rec)
    if rc == 0:
        for name in ("README.md", "train_log.json"):
            if (drafter / name).exists():
                shutil.copy(drafter / name, out / f"drafter-{name}")
        (work / "drafter.done").write_text(str(drafter))
    return {"ok": rc == 0, "drafter": str(drafter)}


def stage_notebooks(size, work, out, log, rec, tiny) -> dict:
    drafter = _need(work, "notebooks")
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if wheels:                                   # papermill, jupyter: absent from the GPU image
        site = work / "site"
        if _run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                 *map(str, wheels)], log, 240, rec):
            return {"ok": False}
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(site)]))
    env_params = work / "params.yaml"
    keys = {"DRAFTER_PATH": str(drafter)}
    if not tiny:
        keys.update(MODEL_PATH=str(_made(work, "model")), DEVICE="cuda", DTYPE="bfloat16")
    env_params.write_text(with_keys((ROOT / size["params"]).read_text(), keys))
    rc = _run(_tltlib("run-notebooks", "--params", str(env_params), *size["only"], "--out",
                      str(out / "notebooks"), "--quiet"), log, 560, rec)
    return {"ok": rc == 0}


def with_keys(text: str, keys: dict) -> str:
    """A parameter file's ``text`` with the top-level settings ``keys`` set: a ``KEY: value`` line replaced, or
    added before the ``notebooks:`` mapping."""
    lines = text.splitlines()
    for key, value in keys.items():
        at = [i for i, line in enumerate(lines) if line.startswith(f"{key}:")]
        if at:
            lines[at[0]] = f"{key}: {json.dumps(value)}"
        else:
            lines.insert(lines.index("notebooks:") if "notebooks:" in lines else len(lines),
                         f"{key}: {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def versions() -> dict:
    import torch
    v = {"python": platform.python_version(), "torch": torch.__version__,
         "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"}
    try:
        import transformers
        v["transformers"] = transformers.__version__
    except ImportError:
        pass
    return v


def main(argv=None) -> int:
    args = parse_args(argv)
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    size = SIZES["tiny" if args.tiny else "gpu"]
    log, rec, t0 = out / f"campaign-{args.stage}.log", [], time.time()
    fn = globals()[f"stage_{args.stage}"]
    try:
        result = fn(size, work, out, log, rec) if args.stage == "tests" else fn(size, work, out, log, rec, args.tiny)
    except StageMissing as e:
        print(e, file=sys.stderr)
        return 2
    payload = {"stage": args.stage, "status": "done" if result.pop("ok") else "failed", "tiny": args.tiny,
               "seconds": round(time.time() - t0, 1), "commands": rec, "versions": versions(), **result}
    tmp = out / f".campaign-{args.stage}.json"
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(out / f"campaign-{args.stage}.json")
    lines = [f"Campaign stage {args.stage} ({'tiny, CPU' if args.tiny else 'GPU'}): {payload['status']} in "
             f"{payload['seconds']} s on {payload['versions']['device']} (torch {payload['versions']['torch']})",
             "", "| command | exit | seconds |", "|---|---|---|"]
    lines += [f"| `{r['command']}` | {r['rc']} | {r['seconds']} |" for r in rec]
    (out / f"campaign-{args.stage}.md").write_text("\n".join(lines) + "\n")
    print(lines[0])
    return 0 if payload["status"] == "done" else 1


if __name__ == "__main__":
    sys.exit(main())
