"""Plain decoding throughput: tltlib's RolloutEngine vs transformers ``generate`` (and vLLM when importable).

Same model, same prompts, greedy, every row decodes exactly ``--new-tokens`` tokens (EOS ignored on all sides), so
the token streams must be identical and the comparison is pure engine speed. Warm-up first, then ``--repeats``
rounds per batch size in which every engine runs once (interleaved, so machine noise hits all alike); medians and
the tltlib/transformers ratio.

    python -m tltlib bench decode                       # CPU, fp32, the tiny reasoner
    python -m tltlib bench decode --device cuda --dtype bfloat16 --model /path/to/Qwen2.5-7B
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (TASK_HELP, ensure_malloc_env, interleaved_medians, machine_info, markdown_table,  # noqa: E402
                     model_suffix, task_prompts, write_results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="data/tiny-reasoner")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--task", default="chain", choices=["chain", "words"], help=TASK_HELP)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args()
    ensure_malloc_env()

    import torch
    from transformers import AutoModelForCausalLM

    from tltlib.checkpoint import load
    from tltlib.params import resolve
    from tltlib.rollout import RolloutConfig, RolloutEngine
    from tltlib.sampling import SamplingConfig

    torch.set_num_threads(os.cpu_count() or 1)
    ours, tok, _ = load(args.model, device=args.device, dtype=args.dtype)
    device, dtype, path = str(ours.device), ours.embed.weight.dtype, resolve(args.model)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    hf.generation_config.eos_token_id = None          # decode exactly N tokens, like ignore_eos
    hf.generation_config.pad_token_id = tok.pad_token_id
    n = args.new_tokens
    engine = RolloutEngine(ours, RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=n), ignore_eos=True))
    vllm = _maybe_vllm(path, args.dtype, n)

    rows, results = [], []
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = task_prompts(args.task, tok, b, seed=b)
        width = max(map(len, prompts))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts], device=device)  # left pad
        # from the lengths, not the token values: a chat prompt holds the pad id itself (SmolLM2 pads with
        # <|im_end|>, which ends every chat turn), and masking those would change transformers' input
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        out = {}
        with torch.no_grad():
            run_ours = lambda: out.__setitem__("ours", engine.generate(prompts).tokens)
            run_hf = lambda: out.__setitem__("hf", hf.generate(ids, attention_mask=mask, do_sample=False,
                                                               max_new_tokens=n, min_new_tokens=n)[:, width:])
            fns = {"ours": run_ours, "hf": run_hf}
            if vllm is not None:
                fns["vllm"] = lambda: vllm(prompts)
            timing = interleaved_medians(fns, device, args.repeats)
            (t_ours, all_ours), (t_hf, all_hf) = timing["ours"], timing["hf"]
        identical = bool(torch.equal(out["ours"].cpu(), out["hf"].cpu()))
        rec = {"batch": b, "new_tokens": n, "tltlib_s": t_ours, "transformers_s": t_hf, "tltlib_runs": all_ours,
               "transformers_runs": all_hf, "tltlib_tok_s": b * n / t_ours, "transformers_tok_s": b * n / t_hf,
               "ratio": t_hf / t_ours, "identical_tokens": identical}
        row = [b, rec["tltlib_tok_s"], rec["transformers_tok_s"], f"{rec['ratio']:.2f}x", identical]
        if vllm is not None:
            rec["vllm_tok_s"] = b * n / timing["vllm"][0]
            row.insert(3, rec["vllm_tok_s"])
        results.append(rec), rows.append(row)

    header = ["batch", "tltlib tok/s", "transformers tok/s", "tltlib / transformers", "identical tokens"]
    if vllm is not None:
        header.insert(3, "vLLM tok/s")
    payload = {"bench": "decode", "machine": machine_info(device), "model": str(args.model), "dtype": args.dtype,
               "settings": vars(args), "results": results}
    write_results(f"decode-{device.split(':')[0]}-{args.dtype}{model_suffix(args.model)}", payload,
                  f"Plain greedy decoding, model {args.model}, {args.task} prompts, {n} new tokens per row, {args.dtype} on {device} (median of "
                  f"{args.repeats} after a warm-up)\n\n" + markdown_table(header, rows), args.out)


def _maybe_vllm(path: Path, dtype: str, n: int):
    """A callable running vLLM on token prompts, or None when vLLM is not importable."""
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError:
        return None
    llm = LLM(model=str(path), dtype=dtype, skip_tokenizer_init=True, enforce_eager=True, max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return lambda prompts: llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                        use_tqdm=False)


if __name__ == "__main__":
    main()
