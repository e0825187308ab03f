"""python -m tltlib check: each test passes on the shipped tiny reasoner and its drafter, and catches the fault it
is there for (a wrong residual, a greedy verify that accepts a wrong draft, a drafter for another policy, a draft
vocabulary off by one) with p < 1e-6 or an exact mismatch; the tuner prior file it writes is what the trainer
starts from; bad input gets one clear error each."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import tltlib.spec.verify as verify
from tltlib.cli.app import main
from tltlib.errors import BadInput
from tltlib.lab.check import CheckConfig, card_numbers, faults, lossless, run_check
from tltlib.lab.check.drafter import quality
from tltlib.lab.check.pays import acceptance_rates, recommend
from tltlib.model import load
from tltlib.model.sampling import SamplingConfig
from tltlib.rl.config import TLTConfig
from tltlib.rl.online import adaptive_controller, alarms_for
from tltlib.rollout.adaptive import AdaptiveConfig, AdaptiveController
from tltlib.rollout.prior import save_prior
from tltlib.sim.measure import measure_costs
from tltlib.spec.strategy import SpecStrategy
from tltlib.tasks import encode_prompts, generate_problems
from tltlib.tasks.chain import ChainTaskConfig

CHAIN4 = SpecStrategy.parse("chain-4")
RESIDUAL = verify.residual


@pytest.fixture(scope="module")
def tiny():
    return load("data/tiny-reasoner", "data/tiny-reasoner-drafter", device="cpu")


@pytest.fixture(scope="module")
def prompts(tiny):
    return encode_prompts(generate_problems(ChainTaskConfig(), 4, seed=7), tiny.tokenizer)


def small(**kw) -> CheckConfig:
    return CheckConfig(**{"prompts": 4, "samples": 64, "length_samples": 4, "max_new_tokens": 96,
                          "greedy_tokens": 32, **kw})


def test_lossless_and_drafter_parts_pass_on_the_shipped_pair(tiny, prompts):
    cfg = small(parts=("lossless", "drafter"))
    report = run_check(tiny.model, tiny.tokenizer, tiny.drafter, prompts, cfg,
                       card=card_numbers("data/tiny-reasoner-drafter"), log=None)
    by_name = {v.name: v for v in report.verdicts}
    assert report.lossless and set(by_name) == {"greedy identity", "first tokens χ²", "response lengths", "log-probs",
                                                "top-1 by depth", "accept length"}
    assert by_name["log-probs"].numbers["max_abs_diff"] < 1e-3 and by_name["top-1 by depth"].status == "pass"
    assert by_name["accept length"].numbers["accept_len_mean"] > 2 and report.data["drafter"]["alarm_floor"] > 1
    assert json.loads(json.dumps(report.to_dict(), default=float))["lossless"] is True


def _contexts(tiny, prompts, sampling, k):
    plain = lossless.rollout(tiny.model, None, prompts, SamplingConfig(sampling.temperature, max_new_tokens=96), None,
                             1, 3)
    rows = [(plain.prompt_ids[i], plain.response_ids(i)) for i in range(plain.num_sequences)]
    return lossless.entropic_contexts(tiny.model, rows, sampling, k, windows=2)


def test_chi2_catches_a_wrong_residual(tiny, prompts):
    cfg = small(temperature=2.0, samples=64)
    ctx = _contexts(tiny, prompts, SamplingConfig(2.0), cfg.first_tokens)
    ok = lossless.first_tokens_chi2(tiny.model, tiny.drafter, ctx, CHAIN4, cfg)
    with faults.swapped_residual():                        # max(0, q - p): the arguments swapped
        bad = lossless.first_tokens_chi2(tiny.model, tiny.drafter, ctx, CHAIN4, cfg)
    assert verify.residual is RESIDUAL                     # restored
    assert ok.status == "pass" and bad.status == "fail" and bad.numbers["pvalue"] < 1e-6, (ok.line, bad.line)


def test_greedy_identity_catches_a_verify_that_accepts_a_wrong_draft(tiny, prompts):
    shifted = faults.off_by_one(tiny.drafter)              # wrong drafts: a correct verify rejects them
    cfg = small(greedy_tokens=16)
    assert lossless.greedy_identity(tiny.model, shifted, prompts, CHAIN4, cfg).status == "pass"
    with faults.lenient_greedy_verify():
        v = lossless.greedy_identity(tiny.model, shifted, prompts, CHAIN4, cfg)
    assert v.status == "fail" and v.numbers["top_two_margin"] > 1e-3, v.line


def _quality(tiny, prompts, drafter):
    s = SamplingConfig(1.0, max_new_tokens=48)
    plain = lossless.rollout(tiny.model, None, prompts, s, None, 2, 0)
    spec = lossless.rollout(tiny.model, drafter, prompts, s, CHAIN4, 2, 1)
    return quality(tiny.model, tiny.tokenizer, drafter, plain, spec, "chain-4",
                   card_numbers("data/tiny-reasoner-drafter"))


def test_drafter_part_catches_a_draft_vocabulary_off_by_one(tiny, prompts):
    shifted = faults.off_by_one(tiny.drafter)
    verdicts, numbers = _quality(tiny, prompts, shifted)
    top1 = verdicts[0]
    assert top1.status == "warn" and top1.numbers["pvalue"] < 1e-6 and numbers["accept_len_mean"] < 2, top1.line


def test_drafter_part_catches_a_drafter_not_synced(tiny, prompts):
    verdicts, _ = _quality(tiny, prompts, faults.unsynced(tiny.drafter))
    assert verdicts[0].status == "warn" and verdicts[0].numbers["pvalue"] < 1e-6, verdicts[0].line
    shipped, _ = _quality(tiny, prompts, tiny.drafter)
    assert shipped[0].status == "pass", shipped[0].line


def test_prior_file_is_what_the_trainer_starts_from(tiny, tmp_path):
    costs = measure_costs(tiny.model, tiny.drafter, rows=(1, 2), tokens=(1, 5), contexts=(8, 32), repeats=1)
    ctl = AdaptiveController(AdaptiveConfig(threshold=2), costs, tiny.drafter)
    ctl.accept["learned"].update(torch.tensor([1.0, 2.0, 5.0]).numpy())
    save_prior(tmp_path / "prior.json", ctl, tiny.model, tiny.drafter,
               recommended={"threshold": 2, "arms": ["off", "chain-4"], "accept_floor": 2.5})
    started = adaptive_controller(tiny.model, tiny.drafter, TLTConfig(prior=str(tmp_path / "prior.json")), 16, 0)
    assert started.config.threshold == 2 and started.costs.to_dict() == costs.to_dict()
    alarms = alarms_for(TLTConfig(prior=str(tmp_path / "prior.json")), tiny.model, tiny.drafter)
    assert alarms.floor == 2.5 and "prior file" in alarms.floor_source           # the check's floor, not the card's
    assert alarms_for(TLTConfig(prior=str(tmp_path / "prior.json"), accept_floor=3.0), tiny.model,
                      tiny.drafter).floor == 3.0
    assert started.accept["learned"].state_dict()["reached"][:2] == [8.0, 7.0]
    retrained = copy.deepcopy(tiny.drafter)
    with torch.no_grad():
        retrained.fc.weight[0, 0] += 1e-3
    with pytest.raises(ValueError, match="measured for another drafter"):
        adaptive_controller(tiny.model, retrained, TLTConfig(prior=str(tmp_path / "prior.json")), 16, 0)
    # a fixed strategy does not build the tuner, but the alarms read the prior's floor: checked all the same
    with pytest.raises(ValueError, match="measured for another drafter"):
        alarms_for(TLTConfig(speculative="chain-4", prior=str(tmp_path / "prior.json")), tiny.model, retrained)


@pytest.mark.parametrize("change, words", [
    (lambda d: d.pop("fingerprint"), "has no fingerprint"),
    (lambda d: d.pop("costs"), "has no costs"),
    (lambda d: d["costs"].pop("target_s"), "costs are not a measured cost model"),
    (lambda d: d["costs"].update(target_s="fast"), "costs are not a measured cost model"),
    (lambda d: d["recommended"].update(threshold="16"), "recommended.threshold must be an integer >= 0, got '16'"),
    (lambda d: d["recommended"].update(threshold=-2), "recommended.threshold must be an integer >= 0, got -2"),
    (lambda d: d["recommended"].update(accept_floor="high"), "recommended.accept_floor must be a number >= 0"),
    (lambda d: d["recommended"].update(accept_floor=0.5), "recommended.accept_floor is 0.5, but an accept floor is "
                                                           "tokens per row per SD step"),
    (lambda d: d["recommended"].update(arms=["chain-x"]), "recommended.arms[0]"),
    (lambda d: d["accept"]["learned"].update(reached=["a"]), "accept.learned.reached[0] must be a number"),
    (lambda d: d["accept"].update(learned=[1, 2]), "accept.learned needs the lists reached and accepted"),
])
def test_a_broken_prior_file_is_one_error_naming_its_part(tiny, tmp_path, change, words):
    """A hand-edited or truncated prior never reaches the tuner or the alarms: one error naming the file and the
    part, where it was an internal error (a missing fingerprint or cost model, a threshold, floor or acceptance that
    is not a number) or silently taken (a floor under 1 token, refused when given as tlt.accept_floor)."""
    costs = measure_costs(tiny.model, tiny.drafter, rows=(1, 2), tokens=(1, 5), contexts=(8, 32), repeats=1)
    ctl = AdaptiveController(AdaptiveConfig(threshold=2), costs, tiny.drafter)
    path = tmp_path / "prior.json"
    save_prior(path, ctl, tiny.model, tiny.drafter, recommended={"threshold": 2, "arms": ["off", "chain-4"],
                                                                 "accept_floor": 2.5})
    d = json.loads(path.read_text())
    change(d)
    path.write_text(json.dumps(d))
    for use in (lambda: adaptive_controller(tiny.model, tiny.drafter, TLTConfig(prior=str(path)), 16, 0),
                lambda: alarms_for(TLTConfig(prior=str(path)), tiny.model, tiny.drafter)):
        with pytest.raises(BadInput) as e:
            use()
        assert str(path) in str(e.value) and words in str(e.value), str(e.value)


def test_recommendation_from_measured_and_predicted_speed():
    measured = {1: {"chain-4": 1.4, "ngram-4": 0.9}, 16: {"chain-4": 0.95, "ngram-4": 0.8}}
    predicted = {4: {"chain-4": 1.2, "ngram-4": 1.05}, 16: {"chain-4": 1.3, "ngram-4": 1.0}}
    assert recommend(measured, predicted) == (4, ("off", "chain-4", "ngram-4"))     # 16 measured: it does not pay
    assert recommend({1: {"chain-4": 0.9}}, {}) == (0, ("off",))
    assert acceptance_rates(torch.tensor([2.0, 2.0, 4.0]).numpy()) == pytest.approx([0.75, 4 / 6])


@pytest.mark.parametrize("kw, words", [
    ({"temperature": 0.0}, ["greedy identity is what applies", "--temperature"]),
    ({"prompts": 3}, ["at least 4", "--prompts 4"]),
    ({"prompts": 4, "samples": 32}, ["256", "--samples to 64"]),
    ({"first_tokens": 1}, ["at least 2"]),
    ({"strategy": "chain-x"}, ["chain"]),
])
def test_check_config_refusals_name_the_fix(kw, words):
    with pytest.raises(ValueError) as e:
        CheckConfig(**kw)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("argv, words", [
    (["--drafter", "data/smollm2-135m-drafter"], ["hidden size", "train a drafter for this target"]),
    (["--temperature", "0"], ["greedy identity is what applies"]),
    (["--dataset", "DATASET", "--prompts", "4"], ["gives 3 prompts", "need 4"]),
    (["--prior", "no/such/folder/prior.json"], ["--prior", "does not exist"]),
    (["--parts", "lossless", "--prior", "PRIOR"], ["--prior is written by the pays part"]),
    (["--strategy", "chain-4", "--drafter", ""], ["drafts with a learned drafter", "--drafter"]),
    (["--rows", "1,x"], ["--rows", "1,4,16"]),
    (["--temperature", "inf"], ["temperature inf is not a sampling temperature"]),
    # where the report and the prior go, checked before minutes of tests (their verdicts were lost at the end)
    (["--out", "FOLDER"], ["the check --out file", "is a folder; name a file"]),
    (["--prior", "FOLDER"], ["the check --prior file", "is a folder; name a file"]),
    (["--out", "/proc/tltlib-check.json"], ["cannot write the check --out file", "choose a folder you can write"]),
    (["--prior", "/proc/tltlib-prior.json"], ["cannot write the check --prior file"]),
    (["--prior", "BLOCKED"], ["is a file, not a folder"]),
])
def test_check_command_bad_input_is_one_clear_error(argv, words, tmp_path, capsys):
    data = tmp_path / "three.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(3)))
    (tmp_path / "blocker").write_text("x")
    named = {"DATASET": str(data), "PRIOR": str(tmp_path / "p.json"), "FOLDER": str(tmp_path),
             "BLOCKED": str(tmp_path / "blocker" / "p.json")}
    argv = [named.get(a, a) for a in argv]
    assert main(["check", "--out", str(tmp_path / "r.json"), *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and all(w in err for w in words), err
    assert not (tmp_path / "r.json").exists()


def test_check_command_writes_its_report_and_exits_1_when_not_lossless(tmp_path, capsys):
    args = ["check", "--parts", "lossless", "--prompts", "4", "--samples", "64", "--max-new-tokens", "32",
            "--temperature", "2.0", "--drafter", "data/tiny-reasoner-drafter", "--quiet"]
    assert main([*args, "--out", str(tmp_path / "ok.json")]) == 0
    report = json.loads((tmp_path / "ok.json").read_text())
    assert report["lossless"] and len(report["verdicts"]) == 4 and report["settings"]["dtype"] == "float32"
    assert "lossless: every test passed" in capsys.readouterr().out
    with faults.swapped_residual():
        assert main([*args, "--out", str(tmp_path / "bad.json")]) == 1
    assert "NOT LOSSLESS" in capsys.readouterr().out
    assert json.loads((tmp_path / "bad.json").read_text())["lossless"] is False


def test_a_check_without_the_lossless_part_claims_no_losslessness():
    """``--parts pays`` alone ended "lossless: every test passed" and wrote ``"lossless": true`` with no test run."""
    from tltlib.lab.check.config import Verdict
    from tltlib.lab.check.run import CheckReport, screen
    pays = [Verdict("pays", "speed", "warn", "SD does not pay here")]
    report = CheckReport(pays, settings={"dtype": "float32"}, machine={"cpu": "x"})
    assert report.lossless is None and report.to_dict()["lossless"] is None
    assert "lossless: not tested (--parts without lossless)" in screen(report)
    assert "every test passed" not in screen(report)
    tested = CheckReport([Verdict("lossless", "greedy", "pass", "ok"), *pays], settings={"dtype": "float32"})
    failed = CheckReport([Verdict("lossless", "chi2", "fail", "p=1e-9"), *pays], settings={"dtype": "float32"})
    assert tested.lossless is True and failed.lossless is False and "NOT LOSSLESS" in screen(failed)


def test_check_runs_in_float32_on_cuda_unless_asked_and_its_screen_names_the_dtype(monkeypatch, capsys):
    """bf16's verify and decode forwards round differently: the default compares like with like on CUDA too."""
    import tltlib.model.loading as loading
    from tltlib.cli.parser import build_parser
    from tltlib.errors import Refused
    from tltlib.lab.check.config import Verdict
    from tltlib.lab.check.inputs import check_dtype
    from tltlib.lab.check.run import CheckReport, screen
    assert [check_dtype(d) for d in ("auto", "float32", "bfloat16")] == ["float32", "float32", "bfloat16"]
    loaded = []

    def load_spy(model, drafter=None, device="cpu", dtype="float32"):
        loaded.append((device, dtype))
        raise Refused("loaded")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(loading, "load", load_spy)
    for flags in ([], ["--dtype", "bfloat16"]):
        assert main(["check", "--quiet", *flags]) == 1 and "loaded" in capsys.readouterr().err
    assert loaded == [("cuda", "float32"), ("cuda", "bfloat16")]
    check = build_parser()._subparsers._group_actions[0].choices["check"]
    assert "default auto: float32 on every device, CUDA included" in " ".join(check.format_help().split())
    verdicts = [Verdict("lossless", "greedy identity", "pass", "identical")]
    plain = screen(CheckReport(verdicts, settings={"dtype": "float32"}, machine={"gpu": "H100"}, seconds=3))
    assert plain.splitlines()[-1] == "lossless: every test passed (3 s on H100, float32)"
    bf16 = screen(CheckReport(verdicts, settings={"dtype": "bfloat16"}, machine={"gpu": "H100"}, seconds=3))
    assert "H100, bfloat16)" in bf16 and "token identity is not expected" in bf16.splitlines()[-1]


def test_check_reads_a_jobs_model_drafter_and_sampling_and_a_flag_wins(tmp_path):
    from tltlib.cli.parser import build_parser
    from tltlib.lab.check.inputs import check_inputs, check_prompts

    args = build_parser().parse_args(["check", "--params", "params/train/cpu-tiny.yaml", "--top-k", "20"])
    inputs = check_inputs(args)
    c = inputs.config
    assert (inputs.model, inputs.drafter) == ("data/tiny-reasoner", "data/tiny-reasoner-drafter")
    assert (c.temperature, c.top_k, c.top_p, c.max_new_tokens) == (0.9, 20, 1.0, 720)
    tok = load("data/tiny-reasoner", device="cpu").tokenizer
    assert len(check_prompts(inputs, tok, 0)) == c.prompts
    job = tmp_path / "greedy.yaml"
    job.write_text((Path("params/train/cpu-tiny.yaml").read_text()).replace("temperature: 0.9", "temperature: 0.0"))
    with pytest.raises(ValueError, match="temperature 0"):                  # the job's own check refuses it first
        check_inputs(build_parser().parse_args(["check", "--params", str(job)]))
def test_check_model_and_drafter_flags_replace_a_jobs_absent_folders(tmp_path):
    import re

    from tltlib.cli.parser import build_parser
    from tltlib.lab.check.inputs import check_inputs, check_prompts
    text = re.sub(r"(?m)^model: .*$", f"model: {tmp_path / 'absent-model'}",
                  Path("params/train/cpu-tiny.yaml").read_text())
    job = tmp_path / "job.yaml"
    job.write_text(re.sub(r"(?m)^drafter: .*$", f"drafter: {tmp_path / 'absent-drafter'}", text))
    args = build_parser().parse_args(["check", "--params", str(job), "--model", "data/tiny-reasoner", "--drafter",
                                      "data/tiny-reasoner-drafter", "--prompts", "4"])
    inputs = check_inputs(args)
    assert (inputs.model, inputs.drafter, inputs.config.max_new_tokens) == ("data/tiny-reasoner",
                                                                            "data/tiny-reasoner-drafter", 720)
    tok = load("data/tiny-reasoner", device="cpu").tokenizer
    assert len(check_prompts(inputs, tok, 0)) == 4
    with pytest.raises(FileNotFoundError, match="--model 'no/such' .*does not exist"):
        check_inputs(build_parser().parse_args(["check", "--params", str(job), "--model", "no/such"]))


