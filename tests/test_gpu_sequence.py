"""The README's GPU sequence, run as written on the CPU: the same commands in the same order, the GPU examples'
parameter files with the tiny reasoner, the CPU and tiny sizes substituted (the notebooks' sizes from
params/smoke.yaml), and the drafter, notebook 01's lengths and the checkpoints each handed on as the README says."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from test_notebooks import EXPECTED
from tltlib.fileio import ROOT
from tltlib.lab.notebook import read_metrics
from tltlib.model.drafter import is_drafter_folder
from tltlib.rl.memory import MeasuredLengths
from tltlib.tasks.chain import ChainTaskConfig, generate_problems
from tltlib.tasks.datasets import save_problems

MODEL = "/models/Qwen2.5-1.5B-Instruct"
MODEL05 = "/models/Qwen2.5-0.5B-Instruct"                # notebook 05's (its two trainers share the GPU)
TINY_GRPO = {"num_generations": 2, "generation_batch_size": 4, "max_completion_length": 48, "max_steps": 1,
             "save_steps": 1, "micro_batch_tokens": 256}
TINY_TLT = {"threshold": 4, "arms": ["chain-2", "ngram-2"], "drafter_steps": 1, "drafter_batch": 2}
TINY_TOP = {"train_problems": 16, "eval_problems": 4, "eval_steps": 0, "device": "cpu", "dtype": "float32"}
TINY_DRAFTER = "--steps 4 --n-train 8 --n-eval 4 --n-accept 2 --max-new-tokens 48 --quiet"


def gpu_commands() -> list[str]:
    """The commands of the README's GPU block (the one that trains the drafter), continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    block = next(b for b in blocks if "train-drafter" in b and "gpu-example" in b)
    lines = block.replace("\\\n", " ").splitlines()
    return [line.split("  #")[0].strip() for line in lines if line.strip() and not line.startswith("#")]


def cpu_files(tmp: Path) -> dict[str, str]:
    """The GPU examples' paths -> this test's, with the parameter files and datasets written there."""
    save_problems(generate_problems(ChainTaskConfig(), 48, seed=0), tmp / "train.jsonl")
    save_problems(generate_problems(ChainTaskConfig(), 24, seed=1), tmp / "test.jsonl")
    subs = {f"{MODEL}-drafter": str(tmp / "drafter"), f"{MODEL05}-drafter": str(tmp / "drafter05"),
            MODEL: str(ROOT / "data" / "tiny-reasoner"), MODEL05: str(ROOT / "data" / "tiny-reasoner"),
            "/data/gsm8k/train.parquet": str(tmp / "train.jsonl"),
            "/data/gsm8k/test.parquet": str(tmp / "test.jsonl")}
    smoke = yaml.safe_load((ROOT / "params" / "smoke.yaml").read_text())
    nb = yaml.safe_load(_sub((ROOT / "params" / "gpu-example.yaml").read_text(), subs))
    nb.update(DEVICE="cpu", DTYPE="float32")
    for name, values in nb["notebooks"].items():
        values.update(smoke["notebooks"].get(name, {}))            # the smoke tier's sizes
    (tmp / "nb").mkdir()
    (tmp / "nb" / "gpu-example.yaml").write_text(yaml.safe_dump(nb))
    job = yaml.safe_load(_sub((ROOT / "params" / "train" / "gpu-example.yaml").read_text(), subs))
    assert set(TINY_GRPO) <= set(job["grpo"]) and set(TINY_TLT) <= set(job["tlt"]) and "lengths" in job
    job.update(TINY_TOP, lengths=str(tmp / "runs" / "gpu-example" / "01_profile_long_tail" / "lengths.json"))
    job["grpo"].update(TINY_GRPO)
    job["tlt"].update(TINY_TLT)
    job["scheduler"].update(max_micro_steps=10, hang_timeout_s=600)
    (tmp / "train").mkdir()
    (tmp / "train" / "gpu-example.yaml").write_text(yaml.safe_dump(job))
    return {**subs, "params/train/gpu-example.yaml": str(tmp / "train" / "gpu-example.yaml"),
            "params/gpu-example.yaml": str(tmp / "nb" / "gpu-example.yaml"),
            "--workers 8": "--workers 2", "--nproc-per-node 8": "--nproc-per-node 2"}


def _sub(text: str, subs: dict[str, str]) -> str:
    for old, new in subs.items():                       # longest first: the drafter's path before the model's
        text = text.replace(old, new)
    return text


@pytest.mark.notebooks
@pytest.mark.long
def test_the_readme_gpu_sequence_runs_as_written_on_the_cpu(tmp_path):
    commands = gpu_commands()
    assert [c.split()[0] for c in commands] == [".venv/bin/python"] * 5 + [".venv/bin/torchrun", ".venv/bin/python"]
    assert "train-drafter" in commands[0] and "train-drafter" in commands[1]   # the drafters first: others read them
    subs = cpu_files(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    grpo_runs = 0
    for command in commands:
        if "pytest -m gpu" in command:
            continue                                    # the GPU tier itself (skipped without CUDA)
        cmd = _sub(command, subs)
        if "train-drafter" in cmd:
            cmd += f" {TINY_DRAFTER}"
        elif " run " in cmd:
            cmd += f" --out {tmp_path / 'runs'} --quiet"
        elif "train-grpo" in cmd:
            grpo_runs += 1
            cmd += f" --output-dir {tmp_path / f'grpo{grpo_runs}'} --quiet"
        done = subprocess.run(shlex.split(cmd), cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{cmd}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        if "train-grpo" in cmd:                         # the pool sized from notebook 01's lengths, and said so
            assert "memory: KV page pool" in done.stderr and "01_profile_long_tail/lengths.json" in done.stderr, \
                done.stderr[-2000:]
    assert is_drafter_folder(tmp_path / "drafter") and is_drafter_folder(tmp_path / "drafter05")
    runs = tmp_path / "runs" / "gpu-example"
    assert sorted(p.name for p in runs.iterdir() if p.is_dir()) == sorted(EXPECTED)   # every notebook, none failed
    assert (runs / "run.log").is_file()                     # the notebooks' own output, kept beside them
    for name, keys in EXPECTED.items():                # what the smoke tier checks of each notebook
        metrics = read_metrics(runs / name)
        assert all(k in metrics for k in keys), (name, [k for k in keys if k not in metrics])
        assert list((runs / name).glob("*.png")), f"{name} wrote no figure"
    assert MeasuredLengths.load(runs / "01_profile_long_tail" / "lengths.json").max_new_tokens == 120
    for n in (1, 2, 3):
        lines = (tmp_path / f"grpo{n}" / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 1 and "rl/reward_mean" in json.loads(lines[0])
