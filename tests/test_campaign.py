"""The GPU campaign (bench/gpu/campaign.py) run on this CPU at tiny sizes, so that it cannot rot between GPU
sessions: every stage in order writes its JSON and markdown and the files later stages read; a stage run without
what an earlier one makes is refused, naming that stage, and writes nothing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CAMPAIGN = ROOT / "bench" / "gpu" / "campaign.py"
sys.path.insert(0, str(CAMPAIGN.parent))

from campaign import STAGES, with_keys  # noqa: E402


def _stage(stage, out, work):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(CAMPAIGN), stage, "--tiny", "--out", str(out), "--work", str(work)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_a_stage_without_its_prerequisite_names_the_stage_that_makes_it(tmp_path):
    for stage, need in (("long_tail", "model"), ("grpo", "model"), ("drafter", "model"), ("notebooks", "drafter")):
        res = _stage(stage, tmp_path / "out", tmp_path / "work")
        assert res.returncode == 2, res.stderr
        assert f"stage {stage} needs what stage {need} makes" in res.stderr and f"campaign.sh {need}" in res.stderr
        assert not list((tmp_path / "out").glob(f"campaign-{stage}.*"))


def test_the_whole_campaign_runs_at_tiny_sizes_stage_by_stage(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    for stage in STAGES:
        res = _stage(stage, out, work)
        assert res.returncode == 0, f"{stage}: {res.stdout[-2000:]} {res.stderr[-2000:]}"
        d = json.loads((out / f"campaign-{stage}.json").read_text())
        assert d["status"] == "done" and d["tiny"] and d["versions"]["torch"]
        assert all(c["rc"] == 0 for c in d["commands"]), d["commands"]
        assert f"Campaign stage {stage}" in (out / f"campaign-{stage}.md").read_text()
    assert list(out.glob("long_tail_rollout-cpu-*.json")) and list(out.glob("e2e_grpo-cpu-*.json"))
    assert (work / "drafter" / "drafter.safetensors").exists() and (out / "drafter-README.md").exists()
    params = (work / "params.yaml").read_text()
    assert f"DRAFTER_PATH: \"{work / 'drafter'}\"" in params                  # stage notebooks read stage d's
    assert list((out / "notebooks").rglob("01_*.ipynb"))


def test_with_keys_sets_or_adds_top_level_settings():
    text = "MODEL_PATH: a\nDEVICE: cpu\nnotebooks:\n  \"01\":\n    DEVICE: x\n"
    got = with_keys(text, {"DEVICE": "cuda", "DRAFTER_PATH": "/d"})
    assert got == "MODEL_PATH: a\nDEVICE: \"cuda\"\nDRAFTER_PATH: \"/d\"\nnotebooks:\n  \"01\":\n    DEVICE: x\n"
