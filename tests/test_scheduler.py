"""The data-parallel workers and the spot trainer: pure pieces in process, the rest under real torchrun launches
(2 gloo workers on the CPU, each bounded in time)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tltlib.rl.scheduler import SchedulerConfig, schedule_metrics
from tltlib.rl.world import shard, torchrun_command

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "dist_job.py"


# ------------------------------------------------------------------------------------------------- pure pieces
def test_shard_gives_whole_groups_and_refuses_bad_worlds():
    assert [shard(8, 4, r) for r in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    with pytest.raises(ValueError, match=r"world size 3 does not divide the 4 prompts.*\[1, 2, 4\]"):
        shard(4, 3, 0)
    with pytest.raises(ValueError, match="8 workers but only 4 prompts"):
        shard(4, 8, 0)


def test_scheduler_config_refuses_a_zero_budget_and_unknown_pairs():
    with pytest.raises(ValueError, match="spot trainer is on but its budget max_micro_steps is 0"):
        SchedulerConfig(max_micro_steps=0)
    SchedulerConfig(spot_trainer=False, max_micro_steps=0)        # no spot trainer: no budget needed
    with pytest.raises(ValueError, match="train_on must be one of"):
        SchedulerConfig(train_on="mine")
    with pytest.raises(ValueError, match="hang_timeout_s"):
        SchedulerConfig(hang_timeout_s=0)
    with pytest.raises(ValueError, match="micro_step_pairs"):
        SchedulerConfig(micro_step_pairs=-1)


def test_schedule_metrics_by_hand():
    # rank 0 rolls out 0-10 s; rank 1 ends at 4, trains 4.5-10.2 (preempted 0.2 s late, last micro-step 0.5 s)
    w0 = {"start": 0.0, "end": 10.0, "train": None, "stop": None, "steps": 0, "micro": [], "sync_s": 0.3,
          "signal_s": 0.01, "events": [("rollout", 0.0, 10.0), ("sync", 10.0, 10.3)]}
    w1 = {"start": 0.0, "end": 4.0, "train": 4.5, "stop": 10.2, "steps": 12, "micro": [0.4] * 11 + [0.5],
          "sync_s": 0.1, "signal_s": None, "events": [("rollout", 0.0, 4.0), ("training", 4.5, 10.2),
                                                      ("sync", 10.2, 10.3)]}
    m = schedule_metrics([w0, w1])
    assert m["sched/idle_s"] == pytest.approx(6.0)
    assert m["sched/idle_frac"] == pytest.approx(6.0 / 20.0)
    assert m["sched/train_s"] == pytest.approx(5.5)                # only the part inside the idle window counts
    assert m["sched/harvested"] == pytest.approx(5.5 / 6.0)
    assert m["sched/preempt_s"] == pytest.approx(0.2)
    assert m["sched/preempt_micro_steps"] == pytest.approx(0.4)
    assert m["sched/overhead_s"] == pytest.approx(0.3)             # rank 0 waited for rank 1's micro-step + sync
    assert m["sched/micro_steps"] == 12
    assert m["sched/timeline"][1] == [("rollout", 0.0, 4.0), ("training", 4.5, 10.2), ("sync", 10.2, 10.3)]


def test_pair_buffer_export_and_ingest_move_one_steps_sequences():
    from tltlib.drafting.pairs import PairBuffer
    a, b = PairBuffer(4), PairBuffer(4)
    g = torch.Generator().manual_seed(0)
    for buf, step in ((a, 0), (a, 1), (b, 0)):
        pids, first = buf.begin([[1, 2, 3]], num_generations=2, rl_step=step)
        buf.add(torch.tensor([pids[0]] * 2), torch.arange(2), torch.randn(2, 4, generator=g), torch.tensor([2, 3]))
        for s in (first, first + 1):
            buf.add(torch.tensor([s] * 3), torch.arange(3), torch.randn(3, 4, generator=g), torch.tensor([5, 6, 7]))
    part = a.export_step(1)
    assert len(part["seq_prompt"]) == 2 and part["tok"].numel() == 2 + 2 * 3
    n = len(b)
    b.ingest(part)
    assert len(b) == n + 2
    new = b.sequences()[-1]
    h, t, plen = b.pairs_of(new)
    h_src, t_src, plen_src = a.pairs_of(a.sequences()[-1])
    assert plen == plen_src and torch.equal(t, t_src) and torch.equal(h, h_src)
    assert b.seq_step[new] == 1


def test_torchrun_command_and_read_job_scheduler_section(tmp_path):
    cmd = torchrun_command(2, ["train-grpo", "--params", "x.yaml"], max_restarts=1, python="py")
    assert cmd == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
                   "-m", "tltlib", "train-grpo", "--params", "x.yaml"]
    from tltlib.lab.rljob import read_job
    p = _params(tmp_path, scheduler={"max_micro_steps": 0})
    with pytest.raises(ValueError, match="max_micro_steps is 0"):
        read_job(p)
    p = _params(tmp_path, scheduler={"spot": True})
    with pytest.raises(ValueError, match="spot"):
        read_job(p)


def test_all_reduce_flat_buckets_keep_values_and_dtypes():
    """One gloo rank: the sum is the identity, so what comes back shows the bucketing and copy-back are right."""
    import torch.distributed as dist

    from tltlib.rl.world import DistributedWorld
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        w = DistributedWorld.__new__(DistributedWorld)
        ts = [torch.randn(5, 3), torch.randn(7).bfloat16(), torch.randn(2, 2, 2)]
        before = [t.clone() for t in ts]
        w.all_reduce_flat(ts, bucket=16)                  # 15 | 7 | 8 elements: three buckets
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(ts, before))
    finally:
        dist.destroy_process_group()


def test_max_restarts_without_workers_is_refused(capsys):
    from tltlib.cli import main
    assert main(["train-grpo", "--params", "params/train/smoke.yaml", "--max-restarts", "2"]) == 1
    assert "--max-restarts goes with --workers" in capsys.readouterr().err


@pytest.fixture
def one_gpu(monkeypatch):
    """This machine as a node with one CUDA GPU (no real CUDA: nothing may touch it or start a process)."""
    import torch.distributed as dist

    def touched(*a, **k):
        raise AssertionError(f"CUDA, a process group or a process was started: {a}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for mod, name in ((torch.cuda, "set_device"), (dist, "init_process_group"), (dist, "TCPStore"),
                      (subprocess, "run"), (subprocess, "Popen")):
        monkeypatch.setattr(mod, name, touched)


def test_more_workers_than_gpus_is_refused_before_any_worker_starts(one_gpu, tmp_path, monkeypatch, capsys):
    """Notebook 06's WORKERS: 2 on one GPU, ``train-grpo --workers 2``, a torchrun rank: one error (workers, GPUs,
    the fix) before anything starts, never gloo over CUDA tensors."""
    from tltlib.cli import main
    from tltlib.lab.notebook import notebook_paths
    from tltlib.lab.params import plan_run
    from tltlib.lab.rljob import launch
    from tltlib.rl.world import DistributedWorld, check_one_gpu_per_worker
    for workers, device in ((1, "cuda"), (1, "auto"), (2, "cpu")):
        check_one_gpu_per_worker(workers, device)
    words = ["2 data-parallel workers on device 'auto' but this node has 1 GPU", "at most 1 worker (", "on the CPU"]
    with pytest.raises(ValueError, match="8 data-parallel workers on device 'cuda:0' but this node has 1 GPU"):
        check_one_gpu_per_worker(8, "cuda:0")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**yaml.safe_load((ROOT / "params/train/smoke.yaml").read_text()), "device": "auto"}))
    assert main(["train-grpo", "--params", str(job), "--workers", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and all(w in err for w in words), err
    with pytest.raises(ValueError) as e:
        launch(job, 2, tmp_path / "run", progress=False)
    assert all(w in str(e.value) for w in words) and not (tmp_path / "run").exists()
    monkeypatch.setenv("RANK", "1"), monkeypatch.setenv("WORLD_SIZE", "2"), monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=words[0]):
        DistributedWorld("auto")
    (tmp_path / "nb.yaml").write_text("DEVICE: auto\nWORKERS: 2\n")
    with pytest.raises(ValueError, match="notebook 06_idle_time_drafter_training: " + words[0]):
        plan_run(tmp_path / "nb.yaml", notebook_paths(), notebook_paths(["06"]))
    (tmp_path / "nb.yaml").write_text("DEVICE: cpu\nWORKERS: 2\n")
    plan_run(tmp_path / "nb.yaml", notebook_paths(), notebook_paths(["06"]))
    (tmp_path / "nb.yaml").write_text("DEVICE: auto\nnotebooks: {\"01\": {WORKERS: 8}}\n")   # an estimate's count
    plan_run(tmp_path / "nb.yaml", notebook_paths(), notebook_paths(["01"]))


def test_workers_outside_torchrun_say_how_to_launch(monkeypatch):
    from tltlib.rl.world import DistributedWorld
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node"):
        DistributedWorld("cpu")


# -------------------------------------------------------------------------------------------- torchrun launches
def _params(tmp_path, name="job.yaml", tlt=None, scheduler=None, **grpo) -> Path:
    d = yaml.safe_load((ROOT / "params/train/smoke.yaml").read_text())
    d["grpo"].update(grpo)
    if tlt is not None:
        d["tlt"] = tlt
    if scheduler is not None:
        d["scheduler"] = scheduler
    p = tmp_path / name
    p.write_text(yaml.safe_dump(d))
    return p


def _torchrun(args, workers=2, max_restarts=0, env=None, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
           f"--max-restarts={max_restarts}", "--monitor-interval=0.2", *map(str, args)]
    t = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "TLTLIB_NO_VENV": "1", **(env or {})})
    return proc, time.time() - t


@pytest.mark.parametrize("pairs", ["own", "all"])
@pytest.mark.long
def test_two_workers_end_each_step_with_identical_weights(tmp_path, pairs):
    # drafter_steps 0: with the spot trainer on 2 workers the idle windows are the whole budget
    params = _params(tmp_path, scheduler={"train_on": pairs}, tlt={"speculative": "chain-4", "drafter_steps": 0,
                                                                "drafter_batch": 2})
    proc, _ = _torchrun([WORKER, "check", params, tmp_path])
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = json.loads((tmp_path / "check.json").read_text())
    r0, r1 = d["ranks"]
    assert r0["policy"] == r1["policy"]                            # the data-parallel update
    assert r0["drafter"] == r1["drafter"] and r0["drafter_version"] == r1["drafter_version"] == 2
    assert all(s["target_unchanged"] for r in d["ranks"] for s in r["syncs"])
    assert not set(r0["problems"]) & set(r1["problems"])           # each rank its own groups
    m = d["metrics"][-1]
    assert m["sched/workers"] == 2 and m["sched/micro_steps"] >= 1
    assert 0 < m["sched/harvested"] <= 1 and m["sched/idle_frac"] > 0
    assert len(m["sched/timeline"]) == 2
    if pairs == "all":                                             # every rank holds every rank's sequences
        assert r0["buffer_sequences"] == r1["buffer_sequences"] == 2 * 16
    else:
        assert r0["buffer_sequences"] == r1["buffer_sequences"] == 16


@pytest.mark.long
def test_killed_rank_restarts_and_resumes_exactly(tmp_path):
    """A rank SIGKILLed in step 3 (after the step-2 checkpoint): torchrun restarts the group, the job resumes from
    the checkpoint and ends with the same weights as an uninterrupted run (the rollout does not use the drafter,
    so the spot trainer's timing cannot change the samples)."""
    params = _params(tmp_path, tlt={"speculative": "off", "drafter_steps": 2, "drafter_batch": 2})
    plain, _ = _torchrun([WORKER, "job", params, tmp_path / "plain"])
    assert plain.returncode == 0, plain.stderr[-3000:]
    killed, _ = _torchrun([WORKER, "job", params, tmp_path / "killed"], max_restarts=1, env={"DIST_KILL_STEP": "3"})
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "exitcode: -9" in killed.stderr                            # it did die (and was restarted)
    a = (tmp_path / "plain/policy.safetensors").read_bytes()
    b = (tmp_path / "killed/policy.safetensors").read_bytes()
    assert a == b
    steps = [json.loads(x)["rl/step"] for x in (tmp_path / "killed/metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


@pytest.mark.parametrize("env, what", [
    ({"DIST_HANG_STEP": "2"}, "reached the all-gather of rewards and statistics"),     # hung in its reward function
    ({"DIST_HANG_ROLLOUT_STEP": "2"}, "finished their rollout"),                       # named by the idle rank
])
@pytest.mark.long
def test_hung_rank_is_named_within_the_timeout(tmp_path, env, what):
    params = _params(tmp_path, scheduler={"hang_timeout_s": 3})
    proc, _ = _torchrun([WORKER, "job", params, tmp_path / "hang"], env=env)      # bounded by _torchrun's timeout
    assert proc.returncode != 0
    assert f"rank(s) [1] have not {what} 3 s after this one" in proc.stderr + proc.stdout   # our wait named it


@pytest.mark.long
def test_mismatched_configs_across_ranks_are_refused(tmp_path):
    proc, _ = _torchrun([WORKER, "mismatch", ROOT / "params/train/smoke.yaml", tmp_path])
    assert proc.returncode != 0
    assert "rank(s) [1] were started with another configuration than rank 0" in proc.stderr + proc.stdout


@pytest.mark.long
def test_a_world_that_does_not_divide_the_groups_is_refused(tmp_path):
    proc, _ = _torchrun(["-m", "tltlib", "train-grpo", "--params", ROOT / "params/train/smoke.yaml",
                         "--output-dir", tmp_path / "out", "--quiet"], workers=3)
    assert proc.returncode != 0
    assert "world size 3 does not divide the 4 prompts" in proc.stderr + proc.stdout
