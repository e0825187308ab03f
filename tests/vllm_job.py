"""The vLLM side of the interop tier (tests/test_vllm_interop.py), run by the vLLM venv's Python (.venv-vllm).

    python tests/vllm_job.py SPEC.json OUT.json

SPEC: ``{"cases": [{"name", "target", "drafter", "prompts": [[ids]], "k", "max_new"}]}``. For every case, greedy
decoding of the token prompts with vLLM alone and with the exported drafter as its EAGLE speculator (``k`` draft
tokens per step); OUT: ``{name: {"plain": [[ids]], "spec": [[ids]], "drafts", "draft_tokens", "accepted"}}``
(vLLM's own spec-decode counters). Imports nothing from tltlib: this venv holds vLLM's own transformers.
"""
from __future__ import annotations

import json
import os
import sys


def _counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        for key, name in (("drafts", "vllm:spec_decode_num_drafts"), ("draft_tokens",
                                                                      "vllm:spec_decode_num_draft_tokens"),
                          ("accepted", "vllm:spec_decode_num_accepted_tokens")):
            if m.name == name:
                out[key] = int(getattr(m, "value", 0))
    return out


def run_case(case: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    prompts = [TokensPrompt(prompt_token_ids=p) for p in case["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=case["max_new"], ignore_eos=True)
    common = dict(model=case["target"], dtype="float32", skip_tokenizer_init=True, enforce_eager=True,
                  max_model_len=case["max_model_len"], seed=0)
    res = {}
    for key, extra in (("plain", {}), ("spec", {"speculative_config": {
            "method": "eagle", "model": case["drafter"], "num_speculative_tokens": case["k"]},
            "disable_log_stats": False})):
        llm = LLM(**common, **extra)
        outs = llm.generate(prompts, params, use_tqdm=False)
        res[key] = [list(o.outputs[0].token_ids) for o in outs]
        if key == "spec":
            res.update(_counters(llm))
        del llm
    return res


def main() -> None:
    spec_file, out_file = sys.argv[1:3]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    spec = json.loads(open(spec_file).read())
    out = {c["name"]: run_case(c) for c in spec["cases"]}
    tmp = out_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, out_file)


if __name__ == "__main__":          # vLLM spawns its engine process: the guard keeps it from re-running this
    main()
