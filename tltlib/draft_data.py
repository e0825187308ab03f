"""The drafter's training data as token files: the target's own sampled responses, written once (in batches, so a
long sampling run can be stopped and continued) and trained on many times.

A responses file is JSONL, one sampled response per row: ``{"prompt_ids": [...], "response_ids": [...]}`` (token ids
of the target's tokenizer, EOS included when the response ended by itself). Ids, not text: decoding and re-encoding
a sampled response does not always give back the tokens the target sampled (a non-canonical tokenization), and the
drafter must learn the target's own token sequences. The hidden states are recomputed by one training forward of
the target (:func:`tltlib.draft_train.pairs_from_sequences`), much cheaper than the sampling.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

# torch and the engine are imported where used: ``python -m tltlib`` builds its parser (add_command) from a bare
# Python, before set-up has installed torch.


def sample_responses(target, tokenizer, problems, out, temperature: float = 0.9, max_new_tokens: int = 512,
                     batch: int = 64, seed: int = 0, progress: bool = True) -> dict:
    """Sample one response per problem in batches of ``batch`` prompts and append each batch's rows to ``out``
    (created if missing; rows already there are kept, so a stopped run continues with the next problems: the
    file's row count says where). Returns ``{"rows": ..., "tokens": ..., "seconds": ...}`` of this call."""
    import torch

    from .rollout import RolloutConfig, RolloutEngine
    from .sampling import SamplingConfig
    from .tasks import encode_prompts, read_responses
    if batch < 1 or max_new_tokens < 1:
        raise ValueError(f"batch and max_new_tokens must be >= 1, got {batch}, {max_new_tokens}")
    out = Path(out)
    done = len(read_responses(out)) if out.exists() else 0
    eng = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens)))
    dev = target.embed.weight.device
    rows = tokens = 0
    t0 = time.perf_counter()
    from tqdm.auto import tqdm
    bar = tqdm(total=len(problems), initial=min(done, len(problems)), desc="responses", disable=not progress)
    for start in range(done, len(problems), batch):
        prompts = encode_prompts(problems[start: start + batch], tokenizer)
        res = eng.generate(prompts, torch.Generator(device=dev).manual_seed(seed * 1_000_003 + start))
        lines = [json.dumps({"prompt_ids": p, "response_ids": res.tokens[j, : int(res.lengths[j])].tolist()})
                 for j, p in enumerate(prompts)]
        with out.open("a", encoding="utf-8") as f:          # whole lines per batch: a kill loses at most one batch
            f.write("".join(line + "\n" for line in lines))
        rows, tokens = rows + len(lines), tokens + int(res.lengths.sum())
        bar.update(len(lines))
    bar.close()
    return {"rows": rows, "tokens": tokens, "seconds": time.perf_counter() - t0}


def add_command(sub) -> None:
    """The ``sample-responses`` command's arguments (:mod:`tltlib.cli`)."""
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


def run_command(args) -> int:
    """``python -m tltlib sample-responses``: ``--n`` problems of ``--dataset`` (a generated task drawn with seed
    ``--seed`` + 1000, train-drafter's training seed for word problems; or a file's first rows), one sampled response
    each, appended to ``--out``."""
    from .fileio import resolve
    from .loading import load
    from .tasks import generate_task, load_problems
    target, tok, _ = load(args.model, None, device=args.device)
    generated = args.dataset in ("", "chain", "words")
    problems = (generate_task(args.dataset or "chain", args.n, args.seed + 1000) if generated
                else load_problems(resolve(args.dataset))[: args.n])
    st = sample_responses(target, tok, problems, args.out, args.temperature, args.max_new_tokens, args.batch,
                          args.seed, progress=not args.quiet)
    print(f"{st['rows']} responses ({st['tokens']} tokens) in {st['seconds']:.0f} s appended to {args.out}")
    return 0
