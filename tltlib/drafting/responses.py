"""The drafter's training data as token files: the target's own sampled responses, written once (in batches, so a
long sampling run can be stopped and continued) and trained on many times.

A responses file is JSONL, one sampled response per row: ``{"prompt_ids": [...], "response_ids": [...]}`` (token ids
of the target's tokenizer, EOS included when the response ended by itself). Ids, not text: decoding and re-encoding
a sampled response does not always give back the tokens the target sampled (a non-canonical tokenization), and the
drafter must learn the target's own token sequences. The hidden states are recomputed by one training forward of
the target (:func:`tltlib.drafting.train.pairs_from_sequences`), much cheaper than the sampling.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import BadInput

# torch and the engine are imported where used: ``python -m tltlib`` builds its parser (add_command) from a bare
# Python, before set-up has installed torch.


def sample_responses(target, tokenizer, problems, out, temperature: float = 0.9, max_new_tokens: int = 512,
                     batch: int = 64, seed: int = 0, progress: bool = True) -> dict:
    """Sample one response per problem in batches of ``batch`` prompts and append each batch's rows to ``out``
    (created if missing; rows already there are kept, so a stopped run continues with the next problems: the
    file's row count says where). Returns ``{"rows": ..., "tokens": ..., "seconds": ...}`` of this call."""
    import torch

    from ..model.sampling import SamplingConfig
    from ..rollout.engine import RolloutConfig, RolloutEngine
    from ..tasks.datasets import read_responses
    from ..tasks.prompts import encode_prompts
    if batch < 1 or max_new_tokens < 1:
        raise BadInput(f"batch and max_new_tokens must be >= 1, got {batch}, {max_new_tokens}")
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
