"""Offline warm-up of a drafter for any local target: its data (the target's own sampled responses, a responses
file, a dataset's responses), acceptance in speculative rollouts, its card, and :func:`train_warm_drafter` behind
``python -m tltlib train-drafter``. The loss and the trainer are :mod:`tltlib.drafting.train`'s.

Paper: TLT §4 (the drafter is warmed before RL, then trained online). Reference: none (its drafters come
pre-trained).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import BadInput
from ..fileio import check_output_folder, resolve
from ..model.drafter import Drafter, DrafterConfig, frequent_tokens, is_drafter_folder, load_drafter, save_drafter
from ..model.sampling import SamplingConfig
from ..model.weights import load_model, parse_dtype
from ..rollout.engine import RolloutConfig, RolloutEngine
from ..spec.strategy import SpecStrategy
from ..tasks.chain import ChainTaskConfig, generate_problems
from ..tasks.datasets import generate_task, load_problems, read_responses
from ..tasks.prompts import encode_prompts
from ..tasks.tokenizer import load_tokenizer
from .pairs import PairBuffer, PairBufferConfig
from .train import DrafterTrainConfig, pairs_from_sequences, train_offline


def rollout_dataset(target, tokenizer, problems, num_generations: int = 1, temperature: float = 0.9,
                    max_new_tokens: int = 720, seed: int = 0, progress: bool = False, max_tokens: int = 1 << 22):
    """Sample responses from the target, streaming the drafter's pairs into a new
    :class:`tltlib.drafting.pairs.PairBuffer` (at most ``max_tokens`` pairs), which is returned."""
    w = target.embed.weight
    buf = PairBuffer(target.config.hidden_size, PairBufferConfig(max_tokens=max_tokens, seed=seed), w.dtype, w.device)
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens),
                                              num_generations=num_generations))
    eng.generate(encode_prompts(problems, tokenizer), torch.Generator(device=w.device).manual_seed(seed),
                 progress=progress, pairs=buf)
    return buf


def measure_acceptance(target, drafter, tokenizer, problems, strategy, temperature: float = 0.9,
                       max_new_tokens: int = 720, seed: int = 0, progress: bool = False) -> dict:
    """``spec/*`` stats of a speculative rollout of ``problems`` with ``strategy`` (accepted length etc.);
    ``progress``: the rollout's bar of finished responses."""
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens)),
                        drafter=drafter)
    g = torch.Generator(device=target.embed.weight.device).manual_seed(seed)
    res = eng.generate(encode_prompts(problems, tokenizer), g, strategy=strategy, progress=progress)
    return {k: v for k, v in res.stats.items() if k.startswith("spec/")}


WARM_CARD = """# {name}

An EAGLE-1-style one-layer drafter ({params_k:.0f} K trainable parameters: fc 2H->H + one decoder layer; the
embedding and LM head are the target's, shared and frozen, not stored here) for `{target}`.

## How it was made
`{command}` — offline warm-up, {start}, on the target's own responses: {n_train} {data_line}, {pairs} training
pairs; {steps} AdamW steps (lr {lr}, batch {batch} sequences,
loss = SmoothL1(hidden) + 0.1 x soft CE{ce_line}{unroll_line}), {minutes:.1f} minutes on {where}.

## Quality on {n_eval} held-out responses
Top-1 agreement with the target's argmax by draft depth (predicted features, true tokens):
{depth_table}

Proposals: {vocab_line}

{accept_block}
"""


def drafter_problems(dataset: str, n_train: int, n_eval: int, n_accept: int, seed: int,
                     task_max_steps: int = 52) -> tuple[list, list, list, str]:
    """(train, eval, acceptance) problems and a description, from a generated task (``""``/``"chain"``: the chain
    mix the shipped drafter was trained on; ``"words"``: word problems) or a JSONL/parquet file (the held-out
    problems are its last ``n_eval`` rows; rows may carry a ``response`` to train on instead of sampling one)."""
    if dataset in ("", "chain"):
        mix = dict(max_steps=task_max_steps)
        train = (generate_problems(ChainTaskConfig(**mix), n_train * 3 // 4, seed=seed + 1000)
                 + generate_problems(ChainTaskConfig(zipf_exponent=0.3, **mix), n_train - n_train * 3 // 4,
                                     seed=seed + 2000))
        held = generate_problems(ChainTaskConfig(zipf_exponent=0.6), n_eval, seed=seed + 3000)
        accept = generate_problems(ChainTaskConfig(), n_accept, seed=seed + 4000)
        return train, held, accept, "chain problems" + (f" of at most {task_max_steps} steps"
                                                         if task_max_steps < 52 else "")
    if dataset == "words":
        return (generate_task("words", n_train, seed + 1000), generate_task("words", n_eval, seed + 3000),
                generate_task("words", n_accept, seed + 4000), "GSM8K-style word problems (tltlib.tasks.wordproblems)")
    rows = load_problems(resolve(dataset))
    if len(rows) <= n_eval:
        raise BadInput(f"{dataset}: {len(rows)} rows cannot hold {n_eval} held-out problems and training problems "
                       f"apart; lower --n-eval (at most {len(rows) - 1}) or use a larger dataset")
    held = rows[-n_eval:]
    return rows[:-n_eval][:n_train], held, held[:n_accept], f"the prompts of {Path(dataset).name}"


def check_context(prompts: list[list[int]], context: int, source: str, model: str) -> None:
    """One error for every prompt that leaves no room for a response in the model's context."""
    long = [i for i, p in enumerate(prompts) if len(p) >= context]
    if long:
        worst = max(len(prompts[i]) for i in long)
        more = "..." if len(long) > 5 else ""
        raise BadInput(f"{source}: {len(long)} of {len(prompts)} prompts (rows {long[:5]}{more}) leave no room for "
                       f"a response in the context of {model} ({context} tokens, max_position_embeddings; the "
                       f"longest prompt has {worst}): shorten or drop them")


def training_pairs(target, tokenizer, problems, seed: int, temperature: float, max_new_tokens: int,
                   progress: bool = False) -> PairBuffer:
    """The drafter's pairs for ``problems``: their own ``response`` fields when every problem has one (hidden states
    from one forward), else the target's sampled responses (hidden states from the generation pass)."""
    ctx = target.config.max_position_embeddings
    if problems and all(isinstance(p.meta.get("response"), str) for p in problems):
        prompts = encode_prompts(problems, tokenizer)
        eos = target.config.eos_token_ids[0]
        seqs = [p + tokenizer(pr.meta["response"], add_special_tokens=False).input_ids + [eos]
                for p, pr in zip(prompts, problems)]
        return pairs_from_sequences(target, [s[:ctx] for s in seqs], [len(p) for p in prompts],
                                    tokenizer.pad_token_id or 0)
    return rollout_dataset(target, tokenizer, problems, temperature=temperature, max_new_tokens=max_new_tokens,
                           seed=seed, progress=progress)


def response_pairs(target, tokenizer, path, n_train: int, n_eval: int,
                   progress: bool = False) -> tuple[PairBuffer, PairBuffer, str]:
    """(training pairs, held-out pairs, description) of a responses file
    (:func:`tltlib.drafting.responses.read_responses`):
    its last ``n_eval`` rows held out, at most ``n_train`` of the others trained on; hidden states from one forward
    of the target."""
    rows = read_responses(path, target.config.vocab_size)
    if len(rows) <= n_eval:
        raise BadInput(f"{path}: {len(rows)} responses cannot hold {n_eval} held-out ones and training ones apart; "
                       f"lower --n-eval (at most {len(rows) - 1}) or sample more")
    train = rows[:-n_eval][:n_train]
    return (rows_pairs(target, tokenizer, train, progress), rows_pairs(target, tokenizer, rows[-n_eval:], progress),
            f"{Path(path).name} (python -m tltlib sample-responses)")


def rows_pairs(target, tokenizer, rows: list[tuple[list[int], list[int]]], progress: bool = False) -> PairBuffer:
    """The drafter's pairs of ``(prompt_ids, response_ids)`` rows (cut at the target's context), hidden states from
    one forward of the target."""
    ctx = target.config.max_position_embeddings
    return pairs_from_sequences(target, [(p + r)[:ctx] for p, r in rows], [len(p) for p, _ in rows],
                                tokenizer.pad_token_id or 0, progress=progress)


def _vocab_line(drafter, eval_data: PairBuffer) -> str:
    """What the drafter proposes from, for its card (with the held-out tokens a draft vocabulary covers)."""
    if drafter.draft_ids is None:
        return "the whole vocabulary"
    held = eval_data.tok[: eval_data.size].to(drafter.draft_ids.device)
    covered = float(torch.isin(held, drafter.draft_ids).float().mean()) if held.numel() else float("nan")
    return (f"a draft vocabulary of {drafter.config.draft_vocab_size} tokens (the most frequent in the training "
            f"pairs), covering {covered:.1%} of the held-out pairs' tokens")


def _card(drafter, out_dir, model_name: str, cfg: DrafterTrainConfig, log: dict, accept: dict, data, eval_data,
          n_accept: int, **about) -> str:
    """The drafter's README.md (:data:`WARM_CARD`); ``about``: command, source, init, temperature, device."""
    accs, device = log["eval_acc"][-1], str(about["device"])
    return WARM_CARD.format(
        name=f"{Path(out_dir).name}: EAGLE drafter", target=model_name, command=about["command"],
        data_line=(f"responses read from {about['source']}" if about.get("from_file") else
                   f"responses (sampled at temperature {about['temperature']}, or the dataset's) to {about['source']}"),
        ce_line=(" over the draft vocabulary" if cfg.ce_vocab == "draft" and drafter.draft_ids is not None else ""),
        unroll_line=(f", over {cfg.unroll} draft steps on the drafter's own features, weights x{cfg.unroll_decay} per "
                     "step" if cfg.unroll > 1 else ""),
        start="continued from " + str(about["init"]) if about["init"] else "from a random initialisation",
        temperature=about["temperature"],
        params_k=sum(p.numel() for p in drafter.parameters()) / 1e3, n_train=len(data), pairs=data.num_pairs,
        steps=log.get("steps", cfg.steps), lr=cfg.lr, batch=cfg.batch_sequences, minutes=log["train_seconds"] / 60,
        where=(torch.cuda.get_device_name(device) if device.startswith("cuda")
               else f"{torch.get_num_threads()} CPU threads"), n_eval=len(eval_data),
        depth_table="| depth | " + " | ".join(str(d + 1) for d in range(len(accs))) + " |\n|---|"
                    + "---|" * len(accs) + "\n| top-1 | " + " | ".join(f"{a:.1%}" for a in accs) + " |",
        vocab_line=_vocab_line(drafter, eval_data),
        accept_block=(f"Measured in speculative rollouts of {n_accept} held-out prompts (temperature "
                      f"{about['temperature']}; accepted length includes\nthe bonus token): "
                      + "; ".join(f"{name}: {s['spec/accept_len_mean']:.2f} tokens per step"
                                  for name, s in accept.items())) if accept else
                     "Accept lengths not measured (`--n-accept 0`): `python -m tltlib bench drafters` measures them.")


def train_warm_drafter(model_path, out_dir, cfg: DrafterTrainConfig | None = None, n_train: int = 512,
                       n_eval: int = 64, seed: int = 0, progress: bool = True, overwrite: bool = False,
                       task_max_steps: int = 52, command: str = "python -m tltlib train-drafter",
                       device: str = "cpu", dtype: str = "auto", dataset: str = "", init=None,
                       max_new_tokens: int = 720, n_accept: int = 32, temperature: float = 0.9,
                       draft_vocab: int = 0, responses: str = "") -> str:
    """Build (or continue from ``init``), train and save the warm drafter of any local target; returns its card.

    Data (:func:`drafter_problems`, :func:`training_pairs`): the target's own sampled responses (``temperature``, at
    most ``max_new_tokens``; hidden states taken in the generation pass) to a generated task's or a dataset's
    prompts, or the dataset's own ``response`` fields (hidden states from one forward). ``task_max_steps`` < 52
    trains on short chain problems only (the drift notebook 05 measures).

    The output folder is checked before any work (writable; an existing drafter is replaced only with
    ``overwrite``; anything else is never replaced) and written as a whole in one atomic step: weights, config,
    card (README.md) and train_log.json. ``dtype`` is the target's (``auto``: bfloat16 on CUDA, else float32); the
    drafter trains in float32 under autocast to it, then is measured and saved in it. ``draft_vocab`` > 0 gives the
    drafter a draft vocabulary of that many tokens, the most frequent in the training pairs (plus EOS), and the card
    reports how much of the held-out pairs' tokens it covers (0 keeps ``init``'s, or the whole vocabulary).
    ``responses``: train on a responses file (:mod:`tltlib.drafting.responses`; its last ``n_eval`` rows held out)
    instead of sampling; the acceptance is still measured on ``dataset``'s held-out prompts."""
    check_output_folder(out_dir, overwrite, is_drafter_folder, "drafter")
    cfg = cfg or DrafterTrainConfig()
    dtype = parse_dtype(("bfloat16" if str(device).startswith("cuda") else "float32") if dtype == "auto" else dtype)
    target, tok = load_model(model_path, dtype=dtype, device=device), load_tokenizer(model_path)
    name = Path(model_path).name
    if init:
        drafter = load_drafter(init, target).float()             # refused here if it belongs to another target
    train_probs, eval_probs, accept_probs, source = drafter_problems(dataset, n_train, n_eval, n_accept, seed,
                                                                     task_max_steps)
    if responses:
        data, eval_data, source = response_pairs(target, tok, responses, n_train, n_eval, progress)
    else:
        for probs in (train_probs, eval_probs):
            check_context(encode_prompts(probs, tok), target.config.max_position_embeddings, dataset or "the task",
                          name)
        data = training_pairs(target, tok, train_probs, seed, temperature, max_new_tokens, progress)
        eval_data = training_pairs(target, tok, eval_probs, seed + 1, temperature, max_new_tokens, progress)
    torch.manual_seed(seed)
    if not init:
        drafter = Drafter(DrafterConfig.from_target(target.config)).to(device).attach(target)
    if draft_vocab:
        drafter.set_draft_vocab(frequent_tokens(data.tok[: data.size], draft_vocab, target.config.vocab_size,
                                                always=target.config.eos_token_ids))
    log = train_offline(drafter, data, cfg, eval_data, eval_every=max(1, cfg.steps // 10), progress=progress)
    drafter.to(dtype)
    accept = {st.name: measure_acceptance(target, drafter, tok, accept_probs, st, temperature, max_new_tokens)
              for st in (SpecStrategy("chain", 4), SpecStrategy("tree", 6, 4, 24)) if accept_probs}
    card = _card(drafter, out_dir, name, cfg, log, accept, data, eval_data, len(accept_probs), command=command,
                 source=source, init=init, temperature=temperature, device=device, from_file=bool(responses))
    train_log = json.dumps({"recipe": cfg.__dict__, "data": {"dataset": dataset or "chain", "source": source},
                            "log": log, "acceptance": accept}, indent=1) + "\n"
    save_drafter(drafter, out_dir, extra_files={"README.md": card, "train_log.json": train_log})
    return card
