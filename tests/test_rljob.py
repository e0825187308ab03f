"""``python -m tltlib train-grpo``: the parameter file is checked before anything loads, every step prints one JSON
line, and a run killed mid-way and resumed ends with exactly the weights of an uninterrupted run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tltlib.lab.rljob import read_job, read_metrics_log

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "params" / "train" / "smoke.yaml"
ENV = {**os.environ, "TLTLIB_NO_VENV": "1"}


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "tltlib", "train-grpo", "--quiet", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, **kw)


def _weights(folder):
    from safetensors.torch import load_file
    return load_file(str(Path(folder) / "policy.safetensors"))


def test_shipped_files_parse(tmp_path):
    import re
    for f in (ROOT / "params" / "train").glob("*.yaml"):
        if "gpu" in f.name:
            continue                                   # its paths exist only on a GPU node
        try:
            spec = read_job(f)
        except FileNotFoundError as e:                 # a model imported or warm-started on this machine only
            assert "tltlib's model cache: import it with python -m tltlib get-model" in str(e), str(e)
            local = tmp_path / f.name                  # the rest of the file still parses
            local.write_text(re.sub(r"(?m)^model: .*$", f"model: {ROOT / 'data' / 'tiny-reasoner'}", f.read_text()))
            spec = read_job(local)
        assert spec.grpo.generation_batch_size % spec.grpo.num_generations == 0


@pytest.mark.parametrize("text,error,match", [
    ("model: data/tiny-reasoner\nlearning_rate: 1\n", ValueError, "'learning_rate' is not a train-grpo setting"),
    ("model: data/tiny-reasoner\ngrpo: {learning_rat: 1.0e-5}\n", ValueError,
     "grpo: 'learning_rat' is not a GRPOConfig setting \\(did you mean learning_rate\\?\\)"),
    ("model: data/tiny-reasoner\ngrpo: {num_generations: lots}\n", ValueError, "num_generations = 'lots' is not an "
                                                                              "integer"),
    ("model: data/tiny-reasoner\ngrpo: {num_generations: 1}\n", ValueError, "num_generations must be >= 2"),
    ("model: data/tiny-reasoner\ngrpo: {num_generations: 3, generation_batch_size: 8}\n", ValueError,
     "must be a positive multiple of num_generations"),
    ("model: data/tiny-reasoner\ntlt: {drafter_steps: -1}\n", ValueError, "drafter-training budget"),
    ("model: data/tiny-reasoner\ngrpo: {max_grad_norm: .nan}\n", ValueError, "max_grad_norm = nan is not a finite"),
    ("model: data/tiny-reasoner\ngrpo: {adam_beta1: 1.5}\n", ValueError, "adam_beta1 and adam_beta2 must be in"),
    ("model: data/tiny-reasoner\ngrpo: {reward_weights: [a]}\n", ValueError, "reward_weights must be finite numbers"),
    ("model: data/tiny-reasoner\neval_steps: -1\n", ValueError, "eval_steps must be >= 0, got -1"),
    ("model: data/tiny-reasoner/config.json\n", FileNotFoundError, "config.json' is a file; give its folder"),
    ("model: data/tiny-reasoner\ntlt: {buffer_decay: -1}\n", ValueError, "buffer_decay must be in \\(0, 1\\]"),
    ("model: data/tiny-reasoner\ngrpo: {learning_rate: 1e-4}\n", ValueError, "YAML reads 1e-4 as text: write 1.0e-4"),
    ("model: data/tiny-reasoner\ntlt: {speculative: chain-4}\n", ValueError, "needs a learned drafter"),
    ("model: data/tiny-reasoner\ntlt: {speculative: adaptive}\n", ValueError, "arms need a learned drafter"),
    ("model: data/tiny-reasoner\ntlt: {speculative: hybrid-6x4-0}\n", ValueError, "tlt.speculative = "
     "'hybrid-6x4-0' verifies 84 draft tokens per step \\(budget 0: every drafted node\\), more than the rollout's "
     "cache leaves room for \\(71\\): give a budget of at most 71 \\(e.g. hybrid-6x4-32\\)"),
    ("model: data/tiny-reasoner\ntlt: {speculative: tree-10x8-90}\n", ValueError, "tree-10x8-90' verifies 90"),
    ("model: data/tiny-reasoner\ntlt: {arms: ['off', chain-4, tree-10x8-90]}\n", ValueError,
     "tlt.arms\\[2\\] = 'tree-10x8-90' verifies 90"),
    ("model: data/tiny-reasoner\ntlt: {arms: ['off', chian-4]}\n", ValueError,
     "tlt.arms\\[1\\]: cannot read speculative strategy 'chian-4'"),
    ("model: data/tiny-reasoner\ntlt: {arms: [off, chain-4]}\n", ValueError,
     "tlt.arms\\[0\\] = False: YAML reads an unquoted off .* write 'off'"),
    ("model: /nope\n", FileNotFoundError, "model '/nope' does not exist"),
    ("drafter: data/tiny-reasoner-drafter\n", ValueError, "'model' is missing"),
    ("model: data/tiny-reasoner\ngrpo:\n  max_completion_length: 48\n  max_completion_length: 5\n", ValueError,
     "line 4: 'max_completion_length' is given twice in the same mapping"),
    ("model: data/tiny-reasoner\ngrpo: {seed: -1}\n", ValueError, "seed must lie in \\[0, 2\\*\\*63 - 1\\]"),
    ("model: data/tiny-reasoner\ngrpo: {seed: 18446744073709551616}\n", ValueError,
     "job.yaml: grpo: seed must lie in \\[0, 2\\*\\*63 - 1\\] .*got 18446744073709551616; choose a smaller seed"),
    ("model: data/tiny-reasoner\ngrpo: {temperature: 0}\n", ValueError, "temperature 0 .* RL learns nothing"),
    ("model: data/tiny-reasoner\nscheduler: {pairs: all}\n", ValueError, "scheduler.pairs was renamed "
                                                                        "scheduler.train_on: write train_on: all"),
    ("model: data/tiny-reasoner\ntask: gsm8k\n", ValueError, "task 'gsm8k' is not a generated task; choose one of "
                                                             "chain, words"),
    ("model: data/tiny-reasoner\ntask: words\ntask_config: {max_step: 4}\n", ValueError,
     "task_config: 'max_step' is not a WordTaskConfig setting \\(did you mean max_steps\\?\\)"),
    ("model: data/tiny-reasoner\nrewards: [accuracy, formatting]\n", ValueError,
     "rewards: unknown reward function 'formatting'; choose from accuracy, format"),
    ("model: data/tiny-reasoner\nrewards: accuracy\n", ValueError, "rewards = 'accuracy' has the wrong type"),
    ("model: data/tiny-reasoner\nrewards: [accuracy, format]\ngrpo: {reward_weights: [1.0]}\n", ValueError,
     "grpo.reward_weights has 1 values for the 2 rewards \\['accuracy', 'format'\\]"),
    ("model: data/tiny-reasoner\ncurriculum: {levels: [1, 1]}\n", ValueError, "curriculum levels must be distinct"),
    ("model: data/tiny-reasoner\nlengths: data/tiny-reasoner/config.json\n", ValueError,
     "config.json: a measured-lengths file holds .*notebook 01"),
    ("model: data/tiny-reasoner\nlengths: /nope.json\n", FileNotFoundError, "lengths '/nope.json' does not exist"),
    ("model: data/tiny-reasoner\ncurriculum: {level: [1]}\n", ValueError,
     "curriculum: 'level' is not a CurriculumConfig setting \\(did you mean levels\\?\\)"),
    # settings that act only on a learned drafter, in a job without one (they were ignored without a word)
    ("model: data/tiny-reasoner\ntlt: {speculative: ngram-4, drafter_train: on_drift}\n", ValueError,
     "tlt.drafter_train: on_drift acts on the learned drafter.*this run has no drafter"),
    ("model: data/tiny-reasoner\ntlt: {speculative: ngram-4, accept_floor: 2.0}\n", ValueError,
     "tlt.accept_floor: 2.0 acts on the learned drafter.*has no drafter"),
    ("model: data/tiny-reasoner\ndrafter: data/tiny-reasoner-drafter\ntlt: {online_drafter: false, "
     "drafter_train: on_drift}\n", ValueError, "drafter_train: on_drift decides when the online drafter trains, but "
     "online_drafter is false"),
    ("model: data/tiny-reasoner\nlengths: ZEROS\n", ValueError, "at least its EOS token"),
    ("model: data/tiny-reasoner\ntlt: {speculative: 'off', prior: p.json}\n", ValueError,
     "tlt.prior 'p.json' would not be read: .*this run has SD off"),
    ("model: data/tiny-reasoner\ntlt: {speculative: ngram-4, alarms: false, prior: p.json}\n", ValueError,
     "the fixed strategy ngram-4 and alarms off"),
])
def test_bad_files_are_refused_before_anything_loads(tmp_path, text, error, match):
    f = tmp_path / "job.yaml"
    (tmp_path / "zeros.json").write_text('{"lengths": [0, 0, 0, 0], "max_new_tokens": 64}')
    f.write_text(text.replace("ZEROS", str(tmp_path / "zeros.json")))
    with pytest.raises(error, match=match):
        read_job(f)


def test_a_strategy_larger_than_the_cache_leaves_room_for_is_refused_when_python_builds_the_config():
    """GRPOTrainer users get the job file's check when they build TLTConfig, not a late "raise
    RolloutConfig.draft_margin" (a setting the trainer does not expose) at the first SD step."""
    from tltlib.rl.config import TLTConfig
    from tltlib.spec.strategy import SpecStrategy
    with pytest.raises(ValueError, match=r"tlt.arms\[1\] = 'tree-10x8-90' verifies 90 .*\(e.g. tree-8x8-32\)"):
        TLTConfig(arms=("off", "tree-10x8-90"))
    with pytest.raises(ValueError, match="tlt.speculative = 'chain-80' verifies 80 .*chain-8"):
        TLTConfig(speculative="chain-80")
    assert TLTConfig(arms=("off", SpecStrategy.parse("chain-4"))).arms[1].name == "chain-4"


@pytest.mark.parametrize("speculative", ["suffix-6-12", "ngram-4", "off"])
def test_a_model_free_strategy_needs_no_drafter(tmp_path, speculative):
    f = tmp_path / "job.yaml"
    f.write_text(f"model: data/tiny-reasoner\ntlt: {{speculative: '{speculative}'}}\n")
    assert read_job(f).tlt.speculative == speculative


def test_adaptive_with_model_free_arms_needs_no_drafter_and_keeps_every_arm(tmp_path):
    from tltlib.model import load
    from tltlib.rl.online import adaptive_controller
    f = tmp_path / "job.yaml"
    f.write_text("model: data/tiny-reasoner\ntlt: {speculative: adaptive, arms: ['off', ngram-4, suffix-4-8]}\n")
    tlt = read_job(f).tlt
    ctl = adaptive_controller(load("data/tiny-reasoner", device="cpu").model, None, tlt, 4, 0)
    assert {a.name for arms in ctl.config.tuner.arms_per_bucket() for a in arms} == {"off", "ngram-4", "suffix-4-8"}


def test_a_word_task_job_with_a_curriculum_and_two_rewards_reads_and_a_missing_level_is_named(tmp_path):
    from tltlib.lab.rljob import job_problems
    from tltlib.tasks.datasets import save_problems
    f = tmp_path / "job.yaml"
    f.write_text("model: data/tiny-reasoner\ntask: words\ntask_config: {max_steps: 3, zipf_exponent: 0.0}\n"
                 "rewards: [accuracy, format]\ncurriculum: {levels: [1, 3], steps_per_level: 4}\n"
                 "train_problems: 64\neval_problems: 16\ngrpo: {reward_weights: [1.0, 0.1]}\ntlt: null\n")
    job = read_job(f)
    assert job.curriculum.levels == (1, 3) and job.rewards == ["accuracy", "format"]
    train, held = job_problems(job)
    assert {p.meta["steps"] for p in train + held} <= {1, 2, 3}
    assert not {p.prompt[0]["content"] for p in train} & {p.prompt[0]["content"] for p in held}
    assert all(isinstance(p.prompt, tuple) for p in train)          # chat messages: the model's template applies
    save_problems(train[:40], tmp_path / "two.jsonl")
    f.write_text(f"model: data/tiny-reasoner\ndataset: {tmp_path / 'two.jsonl'}\ncurriculum: {{levels: [1, 9]}}\n"
                 "train_problems: 30\neval_problems: 8\ntlt: null\n")
    with pytest.raises(ValueError, match="job.yaml: the training problems of .*two.jsonl: no problem of curriculum "
                                         "level steps = 9; the levels there are 1, 2, 3"):
        job_problems(read_job(f))


def _absent_folders_recipe(tmp_path) -> Path:
    """params/train/cpu-smollm2.yaml with a model and a drafter folder that are not on this machine."""
    import re
    text = (ROOT / "params" / "train" / "cpu-smollm2.yaml").read_text()
    text = re.sub(r"(?m)^model: .*$", f"model: {tmp_path / 'absent-sft'}", text)
    f = tmp_path / "recipe.yaml"
    f.write_text(re.sub(r"(?m)^drafter: .*$", f"drafter: {tmp_path / 'absent-drafter'}", text))
    return f


def test_flags_replace_a_recipes_folders_before_they_are_checked(tmp_path):
    """``--model``/``--drafter`` (the benches', check's) replace the file's folders first: a recipe naming folders
    absent here runs on the flags' folders, and a flag's missing folder is the one error, naming the flag."""
    f = _absent_folders_recipe(tmp_path)
    with pytest.raises(FileNotFoundError, match="model '.*absent-sft' does not exist"):
        read_job(f)
    job = read_job(f, {"model": "data/tiny-reasoner", "drafter": "data/tiny-reasoner-drafter"})
    assert (job.model, job.drafter, job.task) == ("data/tiny-reasoner", "data/tiny-reasoner-drafter", "words")
    with pytest.raises(FileNotFoundError, match="drafter '.*absent-drafter' does not exist"):
        read_job(f, {"model": "data/tiny-reasoner", "drafter": None})            # None: the file's
    with pytest.raises(FileNotFoundError, match=r"^--model 'no/such/model' \(replacing .*recipe.yaml's model\) "
                                                "does not exist"):
        read_job(f, {"model": "no/such/model", "drafter": "data/tiny-reasoner-drafter"})


@pytest.mark.long
def test_killed_run_resumes_to_the_weights_of_an_uninterrupted_one(tmp_path):
    straight = _cli("--params", str(SMOKE), "--output-dir", str(tmp_path / "a"))
    assert straight.returncode == 0, straight.stderr
    lines = [json.loads(x) for x in straight.stdout.splitlines()]
    assert [x["rl/step"] for x in lines] == [1, 2, 3] and "eval/accuracy" in lines[-1]
    assert sum(x["rl/grad_norm"] > 0 for x in lines) >= 2   # the policy really moves: equal weights mean something
    # the second run is killed (SIGKILL: no clean-up at all) once its first checkpoint exists
    proc = subprocess.Popen([sys.executable, "-m", "tltlib", "train-grpo", "--quiet", "--params", str(SMOKE),
                             "--output-dir", str(tmp_path / "b")], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 900                             # a bound on a hang, not on this machine's speed
    while time.time() < deadline and not (tmp_path / "b" / "trainer_state.json").is_file():
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (tmp_path / "b" / "trainer_state.json").is_file()
    again = _cli("--params", str(SMOKE), "--output-dir", str(tmp_path / "b"))
    assert again.returncode == 1 and "already holds a training run; continue it with --params" in again.stderr
    other = tmp_path / "other.yaml"                     # same GRPO settings, other data: refused on resume
    other.write_text(SMOKE.read_text().replace("train_problems: 64", "train_problems: 32"))
    refused = _cli("--params", str(other), "--resume", str(tmp_path / "b"))
    assert refused.returncode == 1 and "other data or files (train_problems: 64 there, 32 in" in refused.stderr
    resumed = _cli("--params", str(SMOKE), "--resume", str(tmp_path / "b"))
    assert resumed.returncode == 0, resumed.stderr
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    steps = [m["rl/step"] for m in read_metrics_log(tmp_path / "b")]
    assert steps == [1, 2, 3], steps                    # no step logged twice
    done = _cli("--params", str(SMOKE), "--resume", str(tmp_path / "b"))
    assert done.returncode == 0 and "nothing to do: the run in" in done.stderr and not done.stdout
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # no temporary folder left


def test_resume_refuses_a_second_output_folder(tmp_path):
    r = _cli("--params", str(SMOKE), "--resume", str(tmp_path / "a"), "--output-dir", str(tmp_path / "b"))
    assert r.returncode == 1 and "drop --output-dir" in r.stderr and not (tmp_path / "b").exists()


def test_a_missing_job_file_lists_the_job_files():
    with pytest.raises(FileNotFoundError, match=r"'missing.yaml' not found; available in params/train/: "
                                                r"\[.*'smoke.yaml'"):
        read_job("missing.yaml")


# ---------------------------------------------------------------------------- damaged and unfinished run folders
TINY = """model: data/tiny-reasoner
train_problems: 16
eval_problems: 0
device: cpu
grpo: {num_generations: 2, generation_batch_size: 4, max_completion_length: 24, learning_rate: 1.0e-4, max_steps: 1,
       save_steps: 1, seed: 3}
tlt: null
"""


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
    """A job file and the folder of its finished one-step run."""
    from tltlib.lab.rljob import run_job
    d = tmp_path_factory.mktemp("run")
    (d / "job.yaml").write_text(TINY)
    run_job(d / "job.yaml", d / "out", progress=False, out=open(os.devnull, "w"))
    return d / "job.yaml", d / "out"


def _copy(run, tmp_path):
    import shutil
    params, out = run
    shutil.copytree(out, tmp_path / "out")
    return params, tmp_path / "out"


def _resume(params, out, **kw):
    from tltlib.lab.rljob import run_job
    return run_job(params, out, resume=True, progress=False, out=open(os.devnull, "w"), **kw)


def test_a_torn_last_metrics_line_is_dropped_on_resume_and_a_torn_middle_one_named(one_step, tmp_path):
    params, out = _copy(one_step, tmp_path)
    log = out / "metrics.jsonl"
    log.write_text(log.read_text() + '{"rl/step": 2, "rl/rew')            # killed while writing step 2's line
    _resume(params, out)                                                 # at its last step: nothing to train
    assert [m["rl/step"] for m in read_metrics_log(out)] == [1]
    log.write_text('{"rl/st\n' + log.read_text())
    with pytest.raises(ValueError, match="metrics.jsonl, line 1: not a JSON line of metrics"):
        _resume(params, out)


def test_a_torn_line_of_the_checkpoints_own_step_is_written_back_with_a_note(one_step, tmp_path, capsys):
    """The checkpoint holds step 1, so step 1 does not re-run: its torn line was dropped without a word and the log
    lacked the step for good. The checkpoint's history holds the line's metrics: they are written back."""
    params, out = _copy(one_step, tmp_path)
    log = out / "metrics.jsonl"
    whole = log.read_text()
    log.write_text(whole[:40])                                           # step 1's line, torn
    _resume(params, out)
    assert json.loads(log.read_text()) == json.loads(whole)
    assert "lacked the line of step 1 (a last line torn by a killed write)" in capsys.readouterr().err


@pytest.mark.parametrize("damage,match", [
    ("truncate", "policy.safetensors is not a readable safetensors file"),
    ("nan", "policy.safetensors: tensor .* holds 1 non-finite values"),
    ("state", "state.pt is not readable .* the checkpoint is damaged"),
])
def test_a_damaged_checkpoint_is_named_at_resume(one_step, tmp_path, damage, match):
    from safetensors.torch import load_file, save_file
    params, out = _copy(one_step, tmp_path)
    f = out / "policy.safetensors"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[:100])
    elif damage == "nan":
        t = load_file(str(f))
        t["norm.weight"][0] = float("nan")
        save_file(t, str(f))
    else:
        (out / "state.pt").write_bytes((out / "state.pt").read_bytes()[:200])
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        _resume(params, out, max_steps=2)


def test_resume_accepts_the_same_model_written_as_an_absolute_path(one_step, tmp_path):
    params, out = _copy(one_step, tmp_path)
    absolute = tmp_path / "abs.yaml"
    absolute.write_text(TINY.replace("model: data/tiny-reasoner", f"model: {ROOT / 'data' / 'tiny-reasoner'}"))
    _resume(absolute, out)                                                 # nothing to do, and no refusal


def test_a_run_stopped_before_its_first_checkpoint_can_be_started_again(one_step, tmp_path):
    from tltlib.lab.rljob import run_job
    params, out = _copy(one_step, tmp_path)
    for f in ("trainer_state.json", "policy.safetensors", "state.pt", "README.md"):
        (out / f).unlink()                                                 # save_steps: 0, killed before the end
    with pytest.raises(FileNotFoundError, match="stopped before its first checkpoint .* start it again without "
                                                "--resume"):
        _resume(params, out)
    run_job(params, out, progress=False, out=open(os.devnull, "w"))
    assert [m["rl/step"] for m in read_metrics_log(out)] == [1] and (out / "trainer_state.json").is_file()


@pytest.mark.parametrize("writer", ["dead", "alive again"])
def test_a_save_killed_between_its_renames_is_recovered_at_resume(one_step, tmp_path, writer):
    """Whether the writer's PID lives does not matter: a restarted container reuses PIDs (PID 1 first)."""
    params, out = _copy(one_step, tmp_path)
    dead = "1" if writer == "alive again" else subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    out.rename(tmp_path / f".out.{dead}.tmp-old")                           # the old checkpoint, moved aside
    (tmp_path / f".out.{dead}.tmp-k2j4").mkdir()                            # the new one, half written
    _resume(params, out)
    assert (out / "trainer_state.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_workers_that_cannot_split_the_groups_are_refused_before_torchrun(tmp_path):
    f = tmp_path / "two.yaml"
    f.write_text(TINY)                                                     # 4 completions / 2 = 2 prompts per step
    r = subprocess.run([sys.executable, "-m", "tltlib", "train-grpo", "--params", str(f), "--workers", "3",
                        "--output-dir", str(tmp_path / "o")], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.count("error:") == 1
    assert "3 workers but only 2 prompts per step" in r.stderr and "torch.distributed" not in r.stderr


def test_under_torchrun_a_world_that_cannot_split_the_groups_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """Every rank of a torchrun world of 3 refuses a step of 2 prompts after checking the file, before it touches
    the output folder or loads a model (a real 3-rank launch: tests/test_scheduler.py)."""
    from tltlib.errors import BadInput
    from tltlib.lab import rljob
    from tltlib.rl.world import World

    class ThreeRanks(World):                                            # World's own shard, at rank 1 of 3
        size, rank = 3, 1

        def __init__(self, device, timeout):
            super().__init__(device)

        def barrier(self):
            raise AssertionError("reached the output folder's barrier")

    def loaded(*a, **k):
        raise AssertionError("loaded a model")

    f = tmp_path / "two.yaml"
    f.write_text(TINY)                                                     # 4 completions / 2 = 2 prompts per step
    monkeypatch.setattr(rljob, "launched_by_torchrun", lambda: True)
    monkeypatch.setattr(rljob, "DistributedWorld", ThreeRanks)
    monkeypatch.setattr(rljob, "load", loaded)
    with pytest.raises(BadInput, match="3 workers but only 2 prompts per step"):
        rljob.run_job(f, output_dir=tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()
