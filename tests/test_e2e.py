"""The end-to-end comparison: Amdahl's bound, the summary of two policies' histories, TRL's phases from a bench
file, one tiny comparison run, and one long run with the drafters' drift."""
from __future__ import annotations

import json

import pytest
import torch

from tltlib.lab.e2e import amdahl_bound, compare, frozen_copy, long_run, summarize, trl_peer, trl_phases


def _run(seed, rollout, update, drafter, rewards, acc):
    steps = [{"time/rollout_s": rollout, "time/reward_s": 0.0, "time/logprob_s": 0.0, "time/update_s": update,
              "time/drafter_s": drafter, "time/step_s": rollout + update + drafter, "rl/reward_mean": r}
             for r in rewards]
    return {"seed": seed, "steps": steps, "eval/accuracy": acc}


def test_amdahl_bound():
    assert amdahl_bound(0.5, 2.0) == pytest.approx(1 / 0.75)
    assert amdahl_bound(1.0, 3.0) == pytest.approx(3.0) and amdahl_bound(0.0, 9.0) == 1.0


def test_summary_of_two_policies():
    runs = {"baseline": [_run(0, 6.0, 4.0, 0.0, [0.5, 0.6], 0.70), _run(1, 6.0, 4.0, 0.0, [0.4, 0.7], 0.72)],
            "tlt": [_run(0, 3.0, 4.0, 0.5, [0.5, 0.65], 0.71), _run(1, 3.0, 4.0, 0.5, [0.45, 0.6], 0.69)]}
    s = summarize(runs, trl_step_s=100.0)
    c = s["comparison"]
    assert c["rollout_share_baseline"] == pytest.approx(0.6) and c["rollout_speedup"] == pytest.approx(2.0)
    assert c["amdahl_bound"] == pytest.approx(1 / 0.7) and c["step_speedup"] == pytest.approx(10 / 7.5)
    assert c["of_bound"] == pytest.approx((10 / 7.5) * 0.7)
    assert c["drafter_share_of_tlt_step"] == pytest.approx(0.5 / 7.5)
    assert c["reward_curves_overlap_frac"] == 1.0 and 0 < c["held_out_welch_p"] <= 1
    assert c["baseline_vs_trl_step"] == pytest.approx(10.0)
    assert s["baseline"]["reward_by_step"] == [[0.5, 0.4], [0.6, 0.7]]


def test_welch_p_with_one_policy_tied_across_seeds_is_quiet_and_valid():
    """Two seeds of one policy may reach the same held-out accuracy (notebook 05 on the main job's settings):
    scipy warns of precision loss there, which must not reach the notebook; the p-value is still computed."""
    import warnings
    runs = {"baseline": [_run(0, 6.0, 4.0, 0.0, [0.5], 0.4375), _run(1, 6.0, 4.0, 0.0, [0.6], 0.4375)],
            "tlt": [_run(0, 3.0, 4.0, 0.5, [0.5], 0.4583), _run(1, 3.0, 4.0, 0.5, [0.6], 0.3958)]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = summarize(runs)["comparison"]["held_out_welch_p"]
    assert 0.5 < p < 1.0
    runs["tlt"] = [_run(0, 3.0, 4.0, 0.5, [0.5], 0.4375), _run(1, 3.0, 4.0, 0.5, [0.6], 0.4375)]
    assert summarize(runs)["comparison"]["held_out_welch_p"] is None      # no spread at all: no test


def test_trl_phases_from_a_bench_file(tmp_path):
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"trl": {"step_s": [300.0, 250.0, 280.0], "generate_s": [200.0, 180.0, 190.0]}}))
    assert trl_phases(f, "defaults") == {"rollout": 190.0, "update": 90.0}             # medians over the steps
    assert trl_phases(f) is None                                                          # no tuned run in the file
    f.write_text(json.dumps({"trl": {"step_s": [300.0]}, "trl_tuned": {
        "step_s": [100.0, 80.0], "generate_s": [60.0, 40.0], "generate_and_score_s": [62.0, 42.0]}}))
    assert trl_phases(f) == {"rollout": 50.0, "reward": 2.0, "update": 38.0}
    f.write_text(json.dumps({"trl": None}))
    assert trl_phases(f, "defaults") is None
    with pytest.raises(ValueError, match="TRL run 'fast': choose tuned, defaults"):
        trl_phases(f, "fast")


def test_trl_peer_keeps_the_bench_workload_beside_its_baseline(tmp_path):
    """TRL's phases come with the workload they were measured on and the bench's own baseline of that workload (a
    notebook of another workload must not put them beside its runs); older files name the group size 'group'."""
    f = tmp_path / "r.json"
    base = {"rollout": 6.0, "reward": 0.01, "logprob": 0.0, "update": 4.0, "drafter": 0.0, "step": 10.0,
            "spread": {"step": [9.0, 11.0]}}
    trl = {"step_s": [100.0, 80.0], "generate_s": [60.0, 40.0]}
    f.write_text(json.dumps({"settings": {"prompts": 16, "group": 8, "max_new": 720},
                             "summary": {"baseline": base}, "trl_tuned": trl}))
    peer = trl_peer(f)
    assert peer["workload"] == (16, 8, 720) and peer["phases"]["TRL tuned"] == {"rollout": 50.0, "update": 40.0}
    assert peer["phases"]["tltlib baseline"] == {k: v for k, v in base.items() if k != "spread"}
    f.write_text(json.dumps({"settings": {"prompts": 6, "num_generations": 8, "max_new": 720},
                             "summary": {"baseline": base}, "trl_tuned": trl}))
    assert trl_peer(f)["workload"] == (6, 8, 720)
    f.write_text(json.dumps({"settings": {}, "summary": {}, "trl": None}))
    assert trl_peer(f) is None


def test_a_tiny_comparison_runs_both_policies_and_probes_the_drafters():
    from tltlib.model.loading import load
    from tltlib.rl.config import TLTConfig
    from tltlib.rl.curriculum import CurriculumConfig
    from tltlib.rl.grpo import GRPOConfig, accuracy_reward
    from tltlib.tasks.chain import ChainTaskConfig, generate_problems

    def length_reward(prompts, completions, **kw):
        return [-len(c) / 100 for c in completions]

    model, tok, drafter = load("data/tiny-reasoner", "data/tiny-reasoner-drafter")
    train = generate_problems(ChainTaskConfig(max_steps=4), 20, seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = compare(model, tok, drafter, train, train[:3], lambda s: GRPOConfig(
        num_generations=2, generation_batch_size=4, max_completion_length=40, learning_rate=1e-4, seed=s),
        TLTConfig(speculative="chain-2", drafter_steps=1, drafter_batch=2), seeds=1, steps=2, probe=train[:2],
        probe_strategy="chain-2", log=lambda s: None,
        trainer_kwargs={"reward_funcs": [accuracy_reward, length_reward],
                        "curriculum": CurriculumConfig(levels=(2, 4), steps_per_level=1)})
    assert [len(r["steps"]) for r in out["runs"]["tlt"]] == [2] and len(out["runs"]["baseline"]) == 1
    assert 0.0 <= out["before"]["eval/accuracy"] <= 1.0
    for policy in ("baseline", "tlt"):                    # both arms got the recipe's rewards and curriculum
        steps = out["runs"][policy][0]["steps"]
        assert [m["rl/curriculum_level"] for m in steps] == [2.0, 4.0]
        assert all(m["rl/reward/length_reward"] < 0 for m in steps)
    lengths = summarize(out["runs"])["tlt"]["lengths_first_last"]
    assert len(lengths) == 1 and lengths[0][1]["len_max"] >= lengths[0][1]["len_p50"] > 0
    assert [a["step"] for a in out["acceptance"]] == [1, 2] and out["acceptance"][0]["frozen"] >= 1.0
    assert all((before[k] == v).all() for k, v in model.state_dict().items())     # the input model is untouched


def test_one_step_slowed_by_a_neighbour_does_not_decide_the_summary():
    """12 steps per policy (2 seeds x 6), one baseline rollout 28 s and one TLT update 20 s among 1-5 s ones, as a
    busy machine made them: the medians keep the typical step, the spread shows the outliers."""
    def run(seed, rollouts, updates):
        steps = [{"time/rollout_s": r, "time/reward_s": 0.0, "time/logprob_s": 0.0, "time/update_s": u,
                  "time/drafter_s": 0.0, "time/step_s": r + u, "rl/reward_mean": 0.5} for r, u in zip(rollouts,
                                                                                                      updates)]
        return {"seed": seed, "steps": steps, "eval/accuracy": 0.5 + seed / 10}
    typical = [3.0, 3.2, 2.8, 3.1, 2.9, 3.0]
    runs = {"baseline": [run(0, [28.0, *typical[1:]], [1.0] * 6), run(1, typical, [1.0] * 6)],
            "tlt": [run(0, [1.5] * 6, [1.0] * 6), run(1, [1.5] * 6, [20.0, *[1.0] * 5])]}
    s = summarize(runs)
    assert s["baseline"]["rollout"] == pytest.approx(3.0) and s["tlt"]["update"] == pytest.approx(1.0)
    assert s["comparison"]["rollout_speedup"] == pytest.approx(2.0)
    assert s["comparison"]["step_speedup"] == pytest.approx(4.0 / 2.5)
    lo, hi = s["baseline"]["spread"]["rollout"]
    assert 2.9 <= lo <= 3.0 <= hi <= 3.2


def test_a_long_run_measures_accuracy_and_the_drift_of_frozen_copies():
    """Evaluations at 0, every 2 steps and the last; probes at 0, every 2 steps, the snapshot step and the last; the
    snapshot equals the online drafter when taken (same accepted length), then stays as it was while the online
    drafter trains; the warm drafter never changes; no copy of the model is made."""
    from tltlib.model.loading import load
    from tltlib.rl.config import TLTConfig
    from tltlib.rl.grpo import GRPOConfig
    from tltlib.rl.trainer import GRPOTrainer
    from tltlib.tasks.chain import ChainTaskConfig, generate_problems
    model, tok, drafter = load("data/tiny-reasoner", "data/tiny-reasoner-drafter")
    train = generate_problems(ChainTaskConfig(max_steps=3), 16, seed=1)
    tr = GRPOTrainer(model, tok, train, GRPOConfig(num_generations=2, generation_batch_size=4,
                                                   max_completion_length=32, learning_rate=1e-4, seed=0),
                     drafter=drafter.attach(model), tlt=TLTConfig(speculative="chain-2", drafter_steps=2,
                                                                   drafter_batch=2))
    warm = frozen_copy(drafter, model)
    assert warm.target is model and warm is not drafter
    start = {k: v.clone() for k, v in drafter.state_dict().items()}
    evals = []
    frozen = {"frozen": warm}
    out = long_run(tr, drafter, frozen, train[:3], train[:2], "chain-2,chain-3", steps=3, eval_every=2,
                   probe_every=2, snapshots={1}, log=lambda s: None, on_eval=lambda o: evals.append(len(o["eval"])))
    assert [e["step"] for e in out["eval"]] == [0, 2, 3] and evals == [1, 2, 3] and len(out["steps"]) == 3
    assert [r["step"] for r in out["acceptance"]] == [0, 1, 2, 3]
    first, snap = out["acceptance"][0], out["acceptance"][1]
    assert "online@1" not in first and first["online"] == first["frozen"]          # same weights before training
    assert snap["online@1"] == snap["online"] and snap["online@1:chain-3"] == snap["online:chain-3"]
    assert len(snap["online@1:chain-3:ge"]) == 3
    assert all(torch.equal(v, warm.state_dict()[k]) for k, v in start.items())      # the frozen drafter never trains
    assert any(not torch.equal(v, start[k]) for k, v in drafter.state_dict().items())       # the online one did,
    later = frozen["online@1"].state_dict()                                                  # also after the snapshot
    assert out["snapshots"] == [1] and frozen["online@1"].target is model
    assert any(not torch.equal(v, later[k]) for k, v in drafter.state_dict().items())


def test_update_speed_synchronises_the_trainers_device_around_each_timed_update(monkeypatch):
    import copy

    import tltlib.lab.e2e as e2e
    from tltlib.model.loading import load
    from tltlib.rl.grpo import GRPOConfig
    from tltlib.rl.trainer import GRPOTrainer
    from tltlib.tasks.chain import ChainTaskConfig, generate_problems
    from tltlib.tasks.prompts import encode_prompts
    model, tok, _ = load("data/tiny-reasoner", device="cpu")
    problems = generate_problems(ChainTaskConfig(min_steps=2, max_steps=3), 4, seed=1)
    tr = GRPOTrainer(copy.deepcopy(model), tok, problems, GRPOConfig(num_generations=2, generation_batch_size=4,
                                                                     max_completion_length=16, seed=1))
    calls = []
    monkeypatch.setattr(e2e, "device_sync", lambda device: calls.append(device) or (lambda: calls.append("sync")))
    out = e2e.update_speed(tr, encode_prompts(problems[:2], tok), rows=2, repeats=2)
    assert calls == [tr.device] + ["sync"] * 2 * 2 * 2                      # before and after: 2 plans x 2 repeats
    assert out["length-bucketed"]["seconds"] > 0


class _Bars:
    """Stands in for a module's tqdm: keeps every bar it makes (drawn into a buffer) to check its total, its count
    and whether it was shown."""

    def __init__(self):
        self.bars, self.disabled = [], []

    def __call__(self, *args, **kwargs):
        import io

        from tqdm.std import tqdm
        self.bars.append(tqdm(*args, **{**kwargs, "file": io.StringIO()}))
        self.disabled.append(bool(kwargs.get("disable")))          # a closed bar reads as disabled
        return self.bars[-1]

    def shown(self, desc: str) -> list:
        return [b for b, off in zip(self.bars, self.disabled) if not off and b.desc.startswith(desc)]


def test_measure_acceptance_shows_its_rollouts_bar_only_when_asked(monkeypatch, capsys):
    import tltlib.rollout.engine as engine
    from tltlib.drafting.warmup import measure_acceptance
    from tltlib.model.loading import load
    from tltlib.spec.strategy import SpecStrategy
    from tltlib.tasks.chain import ChainTaskConfig, generate_problems

    model, tok, drafter = load("data/tiny-reasoner", "data/tiny-reasoner-drafter", device="cpu")
    problems = generate_problems(ChainTaskConfig(max_steps=2), 3, seed=1)
    run = lambda progress: measure_acceptance(model, drafter, tok, problems, SpecStrategy("chain", 2),  # noqa: E731
                                              max_new_tokens=16, progress=progress)
    counts = lambda stats: {k: v for k, v in stats.items() if not k.endswith("_time_s")}  # noqa: E731
    quiet = run(False)
    assert capsys.readouterr().err == ""                                   # the library's default prints nothing
    run(True)
    assert "rollout" in capsys.readouterr().err                            # a bar on stderr outside a notebook
    bars = _Bars()
    monkeypatch.setattr(engine, "tqdm", bars)
    assert counts(run(True)) == counts(quiet)                              # the bar changes nothing but times
    (bar,) = bars.shown("rollout")
    assert (bar.total, bar.n) == (3, 3)                                    # one count per finished response


def test_compare_with_progress_counts_its_rl_steps_in_one_bar(monkeypatch, capsys):
    import tltlib.lab.e2e as e2e
    import tltlib.rollout.engine as engine
    from tltlib.model.loading import load
    from tltlib.rl.config import TLTConfig
    from tltlib.rl.grpo import GRPOConfig
    from tltlib.tasks.chain import ChainTaskConfig, generate_problems

    model, tok, drafter = load("data/tiny-reasoner", "data/tiny-reasoner-drafter", device="cpu")
    train = generate_problems(ChainTaskConfig(max_steps=2), 8, seed=1)
    steps, rollouts = _Bars(), _Bars()
    monkeypatch.setattr(e2e, "tqdm", steps)
    monkeypatch.setattr(engine, "tqdm", rollouts)
    run = lambda progress: compare(  # noqa: E731
        model, tok, drafter, train, train[:3], lambda s: GRPOConfig(
            num_generations=2, generation_batch_size=4, max_completion_length=16, learning_rate=1e-4, seed=s),
        TLTConfig(speculative="chain-2", drafter_steps=1, drafter_batch=2), seeds=1, steps=2, probe=train[:2],
        probe_strategy="chain-2", log=lambda s: None, progress=progress)
    run(True)
    (bar,) = steps.shown("RL steps")
    assert (bar.total, bar.n) == (4, 4)                                    # 1 seed x 2 steps x (baseline, TLT)
    assert bar.postfix == "seed 0: held-out accuracy of tlt"               # its last words: what ran last
    assert rollouts.bars and not rollouts.shown("rollout")                 # nothing drawn inside the timed phases
    run(False)
    assert not steps.shown("RL steps")[1:] and capsys.readouterr().err == ""
