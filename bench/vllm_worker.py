"""vLLM as a benchmark peer, in its own venv (``.venv-vllm``): one engine, fed requests over stdin, one JSON line each.

    .venv-vllm/bin/python bench/vllm_worker.py '{"model": DIR, "dtype": "float32", "max_model_len": 1024,
                                                 "eager": false, "drafter": null, "k": 0}'

Started by ``bench/_vllm.py`` (the tltlib side). Prints ``{"ready": true, "startup_s": ...}`` once the engine is
built, then answers every request line ``{"prompts": [[ids]], "max_tokens": N, "temperature": T, "seed": S,
"ignore_eos": true, "stop_token_ids": [ids] or null, "fresh": bool}`` (``fresh``: empty the prefix cache first,
untimed) with
``{"tokens": [[ids]], "seconds": ..., "drafts": ..., "draft_tokens": ..., "accepted": ...}`` (vLLM's own
spec-decode counters, cumulative, when a drafter is set) and stops at end of input. Errors go back as
``{"error": "..."}``. Imports nothing from tltlib: this venv holds vLLM's own transformers.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

# This script's folder comes first on the path, and its benches (kernels.py, sampling.py, ...) would shadow the vLLM
# venv's modules of those names: transformers imports a module "kernels" where one is importable (the HF kernels
# package), found bench/kernels.py, and that imported tltlib, which this venv does not hold.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]

COUNTERS = (("drafts", "vllm:spec_decode_num_drafts"), ("draft_tokens", "vllm:spec_decode_num_draft_tokens"),
            ("accepted", "vllm:spec_decode_num_accepted_tokens"))


def _say(obj: dict, out) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


def build(spec: dict):
    from vllm import LLM
    extra = {}
    if spec.get("drafter"):
        extra = {"speculative_config": {"method": "eagle", "model": spec["drafter"],
                                        "num_speculative_tokens": int(spec["k"])},
                 "disable_log_stats": False}
    return LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), skip_tokenizer_init=True,
               enforce_eager=bool(spec.get("eager")), max_model_len=int(spec.get("max_model_len", 1024)), seed=0,
               **extra)


def counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        for key, name in COUNTERS:
            if m.name == name:
                out[key] = int(getattr(m, "value", 0))
    return out


def serve(llm, spec: dict, inp, out) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    for line in inp:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            params = SamplingParams(temperature=float(req.get("temperature", 0.0)), max_tokens=int(req["max_tokens"]),
                                    ignore_eos=bool(req.get("ignore_eos", True)), seed=req.get("seed"),
                                    stop_token_ids=req.get("stop_token_ids"))
            prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
            if req.get("fresh"):                    # forget earlier calls' prompts: none of them is cached
                llm.reset_prefix_cache()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            reply = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": seconds}
            if spec.get("drafter"):
                reply.update(counters(llm))
            _say(reply, out)
        except Exception as e:                      # the parent turns this into its own error
            _say({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}, out)


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = os.fdopen(os.dup(1), "w")                 # the protocol stream: a private copy of stdout, and then
    os.dup2(2, 1)                                   # fd 1 is stderr, for vLLM's prints and its engine process
    sys.stdout.reconfigure(line_buffering=True)     # its prints reach the log as made (a failure's tail names them)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")      # GiB: batch 64 of SmolLM2 needs ~1
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")     # else it decodes on one of 2 cores
    t0 = time.perf_counter()
    try:
        llm = build(spec)
    except Exception as e:
        _say({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}, out)
        return
    _say({"ready": True, "startup_s": time.perf_counter() - t0}, out)
    serve(llm, spec, sys.stdin, out)


if __name__ == "__main__":          # vLLM spawns its engine process: the guard keeps it from re-running this
    main()
