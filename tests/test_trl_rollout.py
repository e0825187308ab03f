"""TLT behind TRL's GRPOTrainer (tltlib.integrations): two real TRL steps on the tiny reasoner whose completions and
log-probs are checked against tltlib's training forward and TRL's own model, the drafter trained and its state in
TRL's checkpoints, and one clear error for each input the rollout cannot serve."""
from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from tltlib.fileio import resolve  # noqa: E402
from tltlib.integrations import TRL_SUPPORTED, check_trl_version, tlt_rollout_func  # noqa: E402
from tltlib.integrations.trl_checks import check_tokenizer, groups, sampling_of  # noqa: E402
from tltlib.integrations.trl_weights import first_difference, hf_tensors  # noqa: E402
from tltlib.model import load  # noqa: E402
from tltlib.model.drafter import load_drafter  # noqa: E402
from tltlib.model.logprobs import SequenceBatch, response_logprobs  # noqa: E402
from tltlib.rl import TLTConfig, accuracy_reward  # noqa: E402
from tltlib.tasks import generate_task, load_tokenizer  # noqa: E402

TINY, DRAFTER = str(resolve("data/tiny-reasoner")), str(resolve("data/tiny-reasoner-drafter"))
os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"


def dataset(n: int = 64) -> Dataset:
    return Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in generate_task("chain", n, seed=3)])


def trainer_with(rollout, out, max_steps: int = 2, rows: int = 8, G: int = 4, **kw) -> GRPOTrainer:
    kw = {"temperature": 1.0, **kw}
    args = GRPOConfig(output_dir=str(out), max_steps=max_steps, num_generations=G, per_device_train_batch_size=rows,
                      max_completion_length=96, learning_rate=1e-4, bf16=False, use_cpu=True,
                      logging_steps=1, report_to=[], save_strategy="steps", save_steps=1, seed=0, **kw)
    return GRPOTrainer(model=TINY, reward_funcs=[accuracy_reward], args=args, train_dataset=dataset(),
                       rollout_func=rollout)


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 20)])
def test_two_trl_steps_return_tltlib_samples_with_exact_logprobs_and_train_the_drafter(tmp_path, temperature, top_k):
    rollout = tlt_rollout_func(TINY, DRAFTER, tlt=TLTConfig(drafter_steps=2))
    seen = []

    def spy(prompts, trainer):
        out = rollout(prompts, trainer)
        model = rollout.model
        assert first_difference(model, hf_tensors(trainer.model)) is None      # synced with TRL's policy
        n = len(prompts)
        assert len(out["prompt_ids"]) == len(out["completion_ids"]) == len(out["logprobs"]) == n
        assert out["prompt_ids"] == [list(r) for r in trainer._tokenize_prompts(prompts)[0]]   # as TRL tokenizes
        batch = SequenceBatch.build(out["prompt_ids"], out["completion_ids"], range(n), 0, "cpu")
        with torch.no_grad():
            ours = response_logprobs(model, batch, rollout.sampling)            # tltlib's training forward
            logits = trainer.model(batch.tokens).logits.float()                 # TRL's model
        theirs = torch.log_softmax(logits / temperature, -1)
        for i, (ids, lp) in enumerate(zip(out["completion_ids"], out["logprobs"])):
            assert len(lp) == len(ids) >= 1
            assert ids[-1] in trainer.eos_token_ids or len(ids) == trainer.args.max_completion_length
            got = torch.tensor(lp)
            torch.testing.assert_close(got, ours[i, : len(ids)].float(), atol=1e-4, rtol=0)
            if top_k == 0:                       # TRL's log-probs are temperature-only: equal without truncation
                p0 = int(batch.prompt_lens[i])
                ref = theirs[i, p0 - 1: p0 - 1 + len(ids)].gather(-1, torch.tensor(ids)[:, None])[:, 0]
                torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
        seen.append((trainer.state.global_step, rollout.drafter.version))
        return out

    trainer = trainer_with(spy, tmp_path, temperature=temperature, top_k=top_k)
    start = load(TINY, DRAFTER).drafter.state_dict()           # the drafter the rollout starts from
    trainer.train()
    assert seen == [(0, 1), (1, 2)]                        # a rollout per step; the drafter trained after each
    moved = [k for k, v in rollout.drafter.state_dict().items() if k in start and not torch.equal(v, start[k])]
    assert moved, "the online drafter did not train"
    logged = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
    for k in ("spec/accept_len_mean", "spec/time_frac", "drafter/loss", "drafter/version", "time/rollout_s",
              "time/weight_sync_s", "rollout/len_mean"):
        assert k in logged, k
    assert any(e.get("spec/steps", 0) > 0 for e in trainer.state.log_history), "no SD step ran"
    assert not any(k.startswith("spec/accept_ge_") for k in logged)
    saved = tmp_path / "checkpoint-2" / "tlt_rollout" / "rank-0"
    assert (saved / "drafter" / "drafter.safetensors").is_file() and (saved / "state.pt").is_file()


@pytest.mark.long
def test_resume_restores_the_drafter_from_trls_checkpoint_and_refuses_one_without_it(tmp_path):
    first = tlt_rollout_func(TINY, DRAFTER, tlt=TLTConfig(drafter_steps=2))
    trainer_with(first, tmp_path, max_steps=1).train()
    assert first.drafter.version == 1
    again = tlt_rollout_func(TINY, DRAFTER, tlt=TLTConfig(drafter_steps=2))
    trainer_with(again, tmp_path, max_steps=2).train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert again.drafter.version == 2                      # 1 restored + 1 trained (a fresh drafter would be at 1)
    frozen = tlt_rollout_func(TINY, DRAFTER, tlt=TLTConfig(online_drafter=False))   # restores, never trains
    trainer_with(frozen, tmp_path, max_steps=2).train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    saved = load_drafter(tmp_path / "checkpoint-1" / "tlt_rollout" / "rank-0" / "drafter", frozen.model)
    assert all(torch.equal(v, saved.state_dict()[k]) for k, v in frozen.drafter.state_dict().items())
    assert frozen.drafter.version == 1
    # drafter_train's gate resumes too: a gate resting at a best far above anything measured trains at once
    state_pt = tmp_path / "checkpoint-1" / "tlt_rollout" / "rank-0" / "state.pt"
    state = torch.load(state_pt, weights_only=False)
    assert state["drafter_drift"] == first.drift.state_dict()
    state["drafter_drift"] = {"best": {"chain-4": 99.0, "chain-8": 99.0, "chain-16": 99.0, "tree-6x4-24": 99.0},
                              "learning": False, "anchor": None, "curve": []}
    torch.save(state, state_pt)
    drift = tlt_rollout_func(TINY, DRAFTER, tlt=TLTConfig(drafter_steps=2, drafter_train="on_drift"))
    trainer_with(drift, tmp_path, max_steps=2).train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert drift.drift.learning and drift.drift.ratio < 0.2 and drift.drafter.version == 2
    shutil.rmtree(tmp_path / "checkpoint-1" / "tlt_rollout")
    third = tlt_rollout_func(TINY, DRAFTER)
    with pytest.raises(FileNotFoundError, match="holds no TLT rollout state"):
        trainer_with(third, tmp_path, max_steps=2).train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))


def test_a_skipped_drafter_training_fires_the_stale_alarm_at_trls_next_weight_sync(tmp_path, monkeypatch):
    from tltlib.rl import online
    from tltlib.rollout.alarms import AlarmWarning
    rollout = tlt_rollout_func(TINY, DRAFTER, tlt=TLTConfig(drafter_steps=1))
    monkeypatch.setattr(online, "train_drafter", lambda *a, **k: {})     # the drafter's training skipped on purpose
    trainer = trainer_with(rollout, tmp_path)
    with pytest.warns(AlarmWarning, match="drafter_stale"):
        trainer.train()
    assert rollout.drafter.version == 0 and len(rollout.alarms.fired_at["drafter_stale"]) == 1
    assert any(e.get("alarm/drafter_stale", 0) > 0 for e in trainer.state.log_history)


def first_call(rollout, trainer):
    """The rollout's first call on the trainer's first generation batch (where every check runs)."""
    prompts = [p for p in dataset(2)["prompt"] for _ in range(trainer.num_generations)]
    return rollout(prompts, trainer)


def test_a_trl_model_whose_weights_differ_is_refused_naming_the_tensor(tmp_path):
    rollout = tlt_rollout_func(TINY, DRAFTER)
    trainer = trainer_with(rollout, tmp_path)
    with torch.no_grad():
        trainer.model.model.layers[1].mlp.up_proj.weight[0, 0] += 1.0
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight differs"):
        first_call(rollout, trainer)


def test_a_trl_model_of_another_architecture_is_refused_naming_the_field(tmp_path):
    rollout = tlt_rollout_func(resolve("data/tiny-assistant"))
    with pytest.raises(ValueError, match="its vocab_size is|its hidden_size is"):
        first_call(rollout, trainer_with(rollout, tmp_path))


def test_peft_vllm_sharding_and_continuous_batching_are_refused_with_the_reason(tmp_path):
    for setting, match in (("use_vllm", "two generation engines"),
                           ("use_transformers_continuous_batching", "replaces")):
        rollout = tlt_rollout_func(TINY)
        trainer = trainer_with(rollout, tmp_path)
        setattr(trainer.args, setting, True)
        with pytest.raises(ValueError, match=match):
            first_call(rollout, trainer)
    rollout = tlt_rollout_func(TINY)
    trainer = trainer_with(rollout, tmp_path)
    trainer.is_fsdp_enabled = True
    with pytest.raises(ValueError, match="sharded"):
        first_call(rollout, trainer)
    rollout = tlt_rollout_func(TINY)
    trainer = trainer_with(rollout, tmp_path)
    trainer.model.peft_config = {"default": None}
    with pytest.raises(ValueError, match="PEFT-wrapped"):
        first_call(rollout, trainer)


def test_a_drafter_for_another_target_is_refused(tmp_path):
    rollout = tlt_rollout_func(TINY, resolve("data/smollm2-135m-drafter"))
    with pytest.raises(ValueError, match="does not match the target: its .* is"):
        first_call(rollout, trainer_with(rollout, tmp_path))


def test_drafter_settings_without_a_drafter_are_refused_when_the_rollout_is_made():
    for tlt, words in ((TLTConfig(speculative="ngram-4", drafter_train="on_drift"), "drafter_train: on_drift"),
                       (TLTConfig(speculative="ngram-4", accept_floor=2.0), "accept_floor: 2.0")):
        with pytest.raises(ValueError, match=f"tlt_rollout_func: tlt.{words} acts on the learned drafter.*no drafter"):
            tlt_rollout_func(TINY, tlt=tlt)


def test_a_rollout_is_bound_to_one_trainer(tmp_path):
    rollout = tlt_rollout_func(TINY, tlt=TLTConfig(speculative="off", online_drafter=False))
    first_call(rollout, trainer_with(rollout, tmp_path))
    with pytest.raises(ValueError, match="bound to another GRPOTrainer"):
        first_call(rollout, trainer_with(rollout, tmp_path / "b"))


def test_another_tokenizer_is_refused_naming_the_difference():
    ours = load_tokenizer(TINY)
    other = AutoTokenizer.from_pretrained(TINY)
    check_tokenizer(other, ours, TINY)                     # the same files: accepted
    other.add_tokens(["<extra_tok>"])
    with pytest.raises(ValueError, match="vocabularies differ"):
        check_tokenizer(other, ours, TINY)


def test_a_process_slice_of_whole_or_evenly_split_groups_is_served_and_an_uneven_one_refused():
    rows = "per_device_train_batch_size x steps_per_generation"
    assert groups(["a"] * 4 + ["b"] * 4, 4, rows) == ([0, 4], 4)
    assert groups(["a"] * 8, 4, rows) == ([0, 4], 4)                   # a prompt drawn twice in a row: two groups
    assert groups(["a"] * 2 + ["b"] * 2, 4, rows) == ([0, 2], 2)       # every group split evenly over 2 processes
    with pytest.raises(ValueError, match="unevenly.*per_device_train_batch_size x steps_per_generation"):
        groups(["a"] * 4 + ["b"] * 2, 4, rows)
    with pytest.raises(ValueError, match="unevenly"):
        groups(["a", "a", "a", "b"], 4, rows)


def test_eval_mode_samples_num_generations_eval_and_a_trl_pad_id_is_no_mismatch(tmp_path):
    rollout = tlt_rollout_func(TINY, tlt=TLTConfig(speculative="off", online_drafter=False))
    trainer = trainer_with(rollout, tmp_path, num_generations_eval=2)
    trainer.model.config.pad_token_id = 1                  # TRL sets its model's pad id from the tokenizer
    trainer.model.eval()
    prompts = [p for p in dataset(3)["prompt"] for _ in range(2)]
    out = rollout(prompts, trainer)
    assert len(out["completion_ids"]) == 6 and out["prompt_ids"][0] == out["prompt_ids"][1] != out["prompt_ids"][2]


def test_resuming_from_another_checkpoint_than_trls_is_refused(tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from tltlib.integrations.trl_state import resumed_from
    model = AutoModelForCausalLM.from_pretrained(TINY)
    trainer = SimpleNamespace(model=model, state=SimpleNamespace(global_step=3),
                              args=SimpleNamespace(output_dir=str(tmp_path)))
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    weights = {k: v.clone().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, str(folder / "model.safetensors"))
    assert resumed_from(trainer, None) == folder
    weights["model.norm.weight"] += 1
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="TRL did not resume from .*model.norm.weight"):
        resumed_from(trainer, None)
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        resumed_from(trainer, tmp_path / "elsewhere")
    trainer.state.global_step = 0
    assert resumed_from(trainer, None) is None
    with pytest.raises(ValueError, match="TRL did not resume"):
        resumed_from(trainer, folder)


def test_sampling_settings_it_cannot_honour_are_refused_not_ignored():
    base = dict(temperature=0.7, top_p=0.9, top_k=20, max_completion_length=64, min_p=None, repetition_penalty=1.0,
                generation_kwargs=None)
    s = sampling_of(SimpleNamespace(**base))
    assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens) == (0.7, 0.9, 20, 64)
    for key, value in (("min_p", 0.05), ("repetition_penalty", 1.1), ("generation_kwargs", {"num_beams": 2}),
                       ("temperature", 0.0)):
        with pytest.raises(ValueError, match=key):
            sampling_of(SimpleNamespace(**{**base, key: value}))


def test_trl_outside_the_tested_range_is_refused_naming_both_versions():
    assert check_trl_version() == trl.__version__
    with pytest.raises(ImportError, match=r"trl 1\.15\.0 is installed.*" + TRL_SUPPORTED.replace(".", r"\.")):
        check_trl_version("1.15.0")


@pytest.mark.long
def test_the_example_runs_as_two_processes_with_the_spot_trainer(tmp_path):
    """examples/trl_grpo_tlt.py under accelerate's launcher with 2 processes (gloo on a CPU): each samples its own
    groups, the process done first trains the drafter until the other's rollout ends (sched/harvested)."""
    import json
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
           str(resolve("examples/trl_grpo_tlt.py")), "--max-steps", "2", "--prompts-per-step", "2",
           "--max-completion-length", "128", "--output-dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=resolve("."), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [e for e in json.loads((tmp_path / "log_history.json").read_text()) if "sched/workers" in e]
    assert len(steps) == 2 and all(e["sched/workers"] == 2 for e in steps)
    assert all(0 <= e["sched/harvested"] <= 1 for e in steps)
    # the version moved in each step where a worker trained in its idle window (none when both rollouts ended
    # together), and each such step says so: drafter/trained is measured from before the window's sync
    assert steps[-1]["drafter/version"] == sum(e["drafter/trained"] for e in steps)
