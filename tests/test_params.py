"""Parameter files: every key reaches a notebook that declares it, every value has the right type and range, and
everything else is one error naming the file, the notebook and the key, before any notebook runs."""
from __future__ import annotations

import pytest

from tltlib.fileio import ROOT
from tltlib.lab.notebook import notebook_paths
from tltlib.lab.params import SCHEMA, declared_parameters, inferred, load_params, plan_run

ALL = notebook_paths()


def _plan(tmp_path, text, only=None):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return plan_run(path, ALL, notebook_paths(only))


def test_every_notebook_parameter_has_a_schema_entry_its_default_passes():
    for nb in ALL:
        for name, default in declared_parameters(nb).items():
            assert name in SCHEMA, f"{nb.name}: add {name} to tltlib.lab.params.SCHEMA"
            if name in ("MODEL_PATH", "DRAFTER_PATH", "DATASET"):
                continue                              # existence is checked against the machine, not the default
            assert SCHEMA[name].error(default) is None, (nb.name, name, default, SCHEMA[name].error(default))
        # the runner copies figures itself after success; a notebook that wrote there by default would bypass it
        assert declared_parameters(nb).get("FIGURES_DIR", "") == "", nb.name


def test_shipped_cpu_files_plan_cleanly_and_gpu_example_fails_only_on_this_machine(tmp_path):
    for name in ("cpu-tiny", "smoke"):
        plan = plan_run(name, ALL, ALL)
        assert [nb for nb, _ in plan] == ALL
    plan = dict(plan_run("smoke", ALL, ALL))
    assert plan[ALL[0]]["N_PROMPTS"] == 8 and plan[ALL[1]]["N_PROMPTS"] == 2      # sections reach their notebook
    with pytest.raises(ValueError) as e:
        plan_run("gpu-example", ALL, ALL)
    lines = str(e.value).splitlines()[1:]
    assert lines and all("does not exist" in x or "CUDA is not available" in x for x in lines), lines


def test_the_gpu_smoke_file_plans_cleanly_but_for_cuda_and_runs_one_worker_per_gpu(tmp_path):
    """params/gpu-smoke.yaml (a lent GPU's notebooks call): every path exists, only CUDA is missing here; on the
    CPU the same file plans cleanly; notebook 06 runs one worker (the one GPU)."""
    with pytest.raises(ValueError) as e:
        plan_run("gpu-smoke", ALL, ALL)
    lines = str(e.value).splitlines()
    assert lines and all("CUDA is not available" in x for x in lines), lines
    text = (ROOT / "params" / "gpu-smoke.yaml").read_text().replace("DEVICE: cuda", "DEVICE: cpu")
    (tmp_path / "p.yaml").write_text(text)
    plan = dict(plan_run(tmp_path / "p.yaml", ALL, ALL))
    assert plan[next(nb for nb in ALL if nb.stem.startswith("06"))]["WORKERS"] == 1
    assert all(v["DTYPE"] == "bfloat16" for v in plan.values() if "DTYPE" in v)


def test_a_typo_is_refused_also_when_only_some_notebooks_run(tmp_path):
    with pytest.raises(ValueError, match="p.yaml: TEMPRATURE is declared by no notebook \\(did you mean TEMPERATURE"):
        _plan(tmp_path, "TEMPRATURE: 0.5\n", only=["01"])
    with pytest.raises(ValueError, match="TEMPRATURE under \"01\" is not a parameter of 01_profile_long_tail; no "
                                         "notebook declares it \\(did you mean TEMPERATURE"):
        _plan(tmp_path, "notebooks:\n  \"01\": {TEMPRATURE: 0.5}\n", only=["02"])


def test_an_unquoted_numeric_section_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="section 1 under 'notebooks' was read by YAML as a number.*quote it: \"01\":"):
        _plan(tmp_path, "notebooks:\n  01:\n    N_PROMPTS: 4\n")
    with pytest.raises(ValueError, match="section \"09\" matches no notebook"):
        _plan(tmp_path, "notebooks:\n  \"09\": {N_PROMPTS: 4}\n")


def test_a_key_in_the_wrong_notebook_section_is_refused(tmp_path):
    with pytest.raises(ValueError, match="N_SAMPLES under \"01\" is not a parameter of 01_profile_long_tail; it is a "
                                         "parameter of 02_speculative_decoding_explained: move it there"):
        _plan(tmp_path, "notebooks:\n  \"01\": {N_SAMPLES: 50}\n")


@pytest.mark.parametrize("text,match", [
    ("notebooks:\n  \"01\": {N_PROMPTS: lots}\n", "N_PROMPTS = 'lots' \\(notebook 01_profile_long_tail\\): not an "
                                                  "integer; expected an integer >= 1"),
    ("N_PROMPTS: 0\n", "N_PROMPTS = 0 \\(notebooks 01, 02, 04, 05, 06, 07\\): out of range"),
    ("NUM_GENERATIONS: true\n", "NUM_GENERATIONS = True .*not an integer"),
    ("DTYPE: bf16\n", "DTYPE = 'bf16' .*expected a string in 'float32', 'bfloat16', 'float16'"),
    ("DEVICE: gpu\n", "DEVICE = 'gpu' \\(notebooks 01, 02, 03, 04, 05, 06, 07\\): not a device; expected 'auto', "
                      "'cpu', 'cuda'"),
    ("TEMPERATURE: '0.9'\n", "TEMPERATURE = '0.9' .*not a number"),
    ("MODEL_PATH: /nope/model\n", "MODEL_PATH = '/nope/model' .*'/nope/model' does not exist"),
    ("DATASET: data/none.jsonl\n", "DATASET = 'data/none.jsonl' .*does not exist"),
    ("notebooks:\n  \"04\": {ARMS: [chain-4, chian-8]}\n", "ARMS = .*cannot read speculative strategy 'chian-8'"),
    ("notebooks:\n  \"04\": {FIXED: tree-4}\n", "FIXED = 'tree-4' .*cannot read speculative strategy"),
    ("OUT_DIR: /tmp/x\n", "OUT_DIR is set by the runner"),
    ("SEED: 18446744073709551616\n", "SEED = 18446744073709551616 .*out of range"),
])
def test_wrong_values_are_refused_naming_key_notebook_and_expectation(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        _plan(tmp_path, text, only=["01"])


def test_cuda_device_without_cuda_is_refused_before_running(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="DEVICE = 'cuda' .*CUDA is not available on this machine"):
        _plan(tmp_path, "DEVICE: cuda\n")


def test_several_problems_are_listed_together(tmp_path):
    with pytest.raises(ValueError, match="3 problems:\n  - ") as e:
        _plan(tmp_path, "TEMPRATURE: 1\nDTYPE: bf16\nnotebooks:\n  \"01\": {N_SAMPLES: 3}\n")
    assert str(e.value).count("\n  - ") == 3


def test_only_needs_a_prefix_and_each_prefix_must_match():
    with pytest.raises(ValueError, match="--only needs notebook prefixes"):
        notebook_paths([])
    with pytest.raises(ValueError, match="no notebook matches \\['09'\\]"):
        notebook_paths(["01", "09"])
    assert [p.stem[:2] for p in notebook_paths(["03", "01"])] == ["01", "03"]


def test_parameters_of_a_users_own_notebook_are_checked_by_their_defaults_type():
    assert inferred(3).error(4) is None and inferred(3).error("4") == "not an integer"
    assert inferred(0.5).error(1) is None and inferred(True).error(1) == "not true/false"
    assert inferred([1]).error([2, 3]) is None and "not a list" in inferred([1]).error("x")


def test_load_params_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="params file 'nope.yaml' not found; available"):
        load_params("nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        load_params(bad)
    bad.write_text("A: [1\n")
    with pytest.raises(ValueError, match="bad.yaml: not valid YAML"):
        load_params(bad)
    bad.write_text("1: 2\n")
    with pytest.raises(ValueError, match="key 1 \\(top level\\) is not a parameter name"):
        load_params(bad)


def test_a_key_given_twice_is_refused(tmp_path):
    with pytest.raises(ValueError, match="p.yaml, line 3: '01' is given twice in the same mapping"):
        _plan(tmp_path, "notebooks:\n  \"01\": {N_PROMPTS: 3}\n  \"01\": {WORKERS: 2}\n")
    with pytest.raises(ValueError, match="line 2: 'SEED' is given twice"):
        _plan(tmp_path, "SEED: 1\nSEED: 2\n")


@pytest.mark.parametrize("text,match", [
    ("notebooks:\n  \"01\": {TEMPERATURE: .nan}\n", "TEMPERATURE = nan .*not a finite number"),
    ("FIGURES_DIR: README.md\n", "FIGURES_DIR = 'README.md' .*is \\(inside\\) a file, not a folder"),
    ("n_prompts: 3\n", "n_prompts is declared by no notebook \\(did you mean N_PROMPTS\\?\\)"),
    ("PAIRS: all\n", "PAIRS is declared by no notebook \\(renamed TRAIN_ON\\)"),
    ("GROUP_SIZE: 8\n", "GROUP_SIZE is declared by no notebook \\(renamed NUM_GENERATIONS\\)"),
    ("TOP_K: 3\n", "TOP_K is declared by no notebook \\(renamed BRANCH\\)"),
    ("notebooks:\n  \"01\": {GROUP_SIZE: 8}\n", "GROUP_SIZE under \"01\" .*no notebook declares it \\(renamed "
                                                  "NUM_GENERATIONS\\)"),
    ("notebooks:\n  \"05\": {REWARDS: [accuracy, lenght]}\n", "REWARDS = .*unknown reward function 'lenght'"),
    ("notebooks:\n  \"05\": {REWARD_WEIGHTS: [a]}\n", "REWARD_WEIGHTS = \\['a'\\] .*not null or a list of finite"),
    ("notebooks:\n  \"06\": {CURRICULUM: {levels: [1, 1]}}\n", "CURRICULUM = .*curriculum levels must be distinct"),
    ("notebooks:\n  \"06\": {CURRICULUM: {level: [1]}}\n", "CURRICULUM: 'level' is not a CurriculumConfig"),
    ("notebooks:\n  \"05\": {TASK_CONFIG: 4}\n", "TASK_CONFIG = 4 .*not a mapping"),
])
def test_more_values_refused_before_running(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        _plan(tmp_path, text)


def test_an_empty_only_prefix_is_refused():
    with pytest.raises(ValueError, match="an empty prefix would match all"):
        notebook_paths([""])


def test_smollm2_file_plans_notebook_01_or_says_how_to_import_the_model(tmp_path, monkeypatch):
    from tltlib.lab.params import resolve
    from tltlib.model.importers import is_imported
    only = notebook_paths(["01"])
    if is_imported(resolve("~/.cache/tltlib/models/smollm2-135m")):
        assert dict(plan_run("cpu-smollm2", ALL, only))[only[0]]["TASK"] == "words"
    else:
        with pytest.raises(ValueError, match="import it first with python -m tltlib get-model smollm2-135m"):
            plan_run("cpu-smollm2", ALL, only)
    monkeypatch.setenv("TLTLIB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="smollm2-135m' does not exist: import it first with python -m tltlib "
                                         "get-model smollm2-135m"):
        _plan(tmp_path, f"MODEL_PATH: {tmp_path}/models/smollm2-135m\n", only=["01"])
    with pytest.raises(ValueError, match="TASK = 'gsm8k'.*expected a string in 'chain', 'words'"):
        _plan(tmp_path, "notebooks:\n  \"01\": {TASK: gsm8k}\n", only=["01"])


def test_a_missing_path_stops_only_the_notebooks_that_run(tmp_path):
    """A folder a notebook that is not selected would read (05's warm-started model while running --only 01) is not
    needed; its values are still checked, and the notebook that reads it is stopped."""
    text = "notebooks:\n  \"05\": {MODEL_PATH: /nope/sft}\n"
    assert _plan(tmp_path, text, only=["01"])
    with pytest.raises(ValueError, match="MODEL_PATH = '/nope/sft' \\(notebook 05_grpo_with_tlt\\): '/nope/sft' does "
                                         "not "
                                         "exist"):
        _plan(tmp_path, text, only=["05"])
    with pytest.raises(ValueError, match="MODEL_PATH = 5 .*not a string"):
        _plan(tmp_path, "notebooks:\n  \"05\": {MODEL_PATH: 5}\n", only=["01"])


def test_task_configs_give_the_chain_task_a_longer_held_out_and_name_a_bad_setting():
    from tltlib.lab.params import task_configs
    from tltlib.tasks.chain import ChainTaskConfig
    from tltlib.tasks.wordproblems import WordTaskConfig
    assert task_configs("chain", {}, "x") == (ChainTaskConfig(), ChainTaskConfig(zipf_exponent=0.6))
    assert task_configs("chain", {"zipf_exponent": 1.5, "max_steps": 9}, "x") == \
        (ChainTaskConfig(zipf_exponent=1.5, max_steps=9),) * 2
    words = WordTaskConfig(max_steps=4)
    assert task_configs("words", {"max_steps": 4}, "x") == (words, words)
    with pytest.raises(ValueError, match="TASK_CONFIG: 'max_step' is not a WordTaskConfig setting"):
        task_configs("words", {"max_step": 4}, "TASK_CONFIG")


def test_only_takes_prefixes_separated_by_spaces_or_commas_and_refuses_an_unknown_one():
    assert notebook_paths(["05,06"]) == notebook_paths(["05", "06"]) == [p for p in ALL if p.stem[:2] in ("05", "06")]
    with pytest.raises(ValueError, match=r"no notebook matches \['09'\]"):
        notebook_paths(["01,09"])
    with pytest.raises(ValueError, match="an empty prefix would match all"):
        notebook_paths(["05,"])
