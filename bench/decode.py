"""Plain decoding throughput: tltlib's RolloutEngine vs transformers ``generate`` (and vLLM when it is installed).

Same model, same prompts, greedy, every row decodes exactly ``--new-tokens`` tokens (EOS ignored on all sides), so
the token streams must be identical and the comparison is pure engine speed. Warm-up first, then ``--repeats``
rounds per batch size in which every engine runs once (interleaved, so machine noise hits all alike); medians and
the tltlib/transformers and tltlib/vLLM ratios. vLLM runs in-process when importable (a GPU node), else from
``.venv-vllm`` (``python -m tltlib setup-vllm``) in its own process, set up as its CPU guide says (bench/_vllm.py).
tltlib runs as its rollouts do: the decoder layers in one C++ call on a CPU (``RolloutConfig.native_layers``, the
default, set here explicitly; :mod:`tltlib.model.native`; no effect on CUDA).

    python -m tltlib bench decode                       # CPU, fp32, the tiny reasoner
    python -m tltlib bench decode --device cuda --dtype bfloat16 --model /path/to/Qwen2.5-7B
    python -m tltlib bench decode --model ~/.cache/tltlib/models/smollm2-135m --task words --compile --vllm off

``--compile`` adds tltlib with its decoder layers compiled (``RolloutConfig(compile_layers=True)``,
:mod:`tltlib.model.fused`) as a fourth engine, interleaved with the others: its speed, its ratio to tltlib eager, its
tokens against transformers', and the seconds its first call spent compiling (in the warm-up, not timed).
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    TASK_HELP,
    add_device_flags,
    add_model_flags,
    add_output_flags,
    bench_parser,
    interleaved_medians,
    listed,
    load_models,
    machine_info,
    markdown_table,
    model_suffix,
    parse_bench_args,
    positive_int,
    resolve,
    result_name,
    task_prompts,
    write_results,
)
from _vllm import vllm_peer  # noqa: E402


def parse_args(argv: list[str] | None = None):
    ap = bench_parser(__doc__)
    add_model_flags(ap)
    add_device_flags(ap)
    ap.add_argument("--batches", default="1,16,64", type=listed(positive_int, "1,16,64"))
    ap.add_argument("--task", default="chain", choices=["chain", "words"], help=TASK_HELP)
    ap.add_argument("--new-tokens", type=positive_int, default=128)
    ap.add_argument("--compile", action="store_true",
                    help="also tltlib with its decoder layers compiled by torch.compile (CPU), side by side")
    ap.add_argument("--vllm", default="auto", choices=["auto", "compiled", "eager", "off"],
                    help="vLLM column: auto = compiled when vLLM is installed (in .venv-vllm or here), else none")
    add_output_flags(ap, repeats=7, out_help="results folder (default bench/results)")
    return parse_bench_args(ap, argv)


def main() -> None:
    args = parse_args()
    from tltlib.model.sampling import SamplingConfig
    from tltlib.rollout.engine import RolloutConfig, RolloutEngine

    ours, tok, _ = load_models(args)
    device, dtype, path = str(ours.device), ours.embed.weight.dtype, resolve(args.model)
    hf = _hf_model(path, dtype, device, tok)
    n = args.new_tokens
    config = RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=n), ignore_eos=True, native_layers=True)
    engine = RolloutEngine(ours, config)
    compiled = RolloutEngine(ours, replace(config, compile_layers=True)) if args.compile else None
    vllm, note = vllm_peer(args.vllm, path, args.dtype, n,     # the model's context, at most 2,048 (vLLM refuses more)
                           max_model_len=min(2048, ours.config.max_position_embeddings))
    try:
        measured = [_measure_batch(b, args, tok, engine, hf, vllm, device, compiled) for b in args.batches.items]
    finally:
        if vllm is not None and hasattr(vllm, "close"):
            vllm.close()
    results, rows = [rec for rec, _ in measured], [row for _, row in measured]
    header = ["batch", "tltlib tok/s", "transformers tok/s", "tltlib / transformers", "identical tokens"]
    if vllm is not None:
        header[3:3] = ["vLLM tok/s", "tltlib / vLLM"]
    if compiled is not None:
        from tltlib.model.fused import compile_seconds
        header += ["compiled tok/s", "compiled / eager", "compiled identical"]
    payload = {"bench": "decode", "machine": machine_info(device), "model": str(args.model), "dtype": args.dtype,
               "settings": vars(args), "vllm": note, "results": results}
    if compiled is not None:
        payload["compile_seconds"] = compile_seconds()
        note = (note + "; " if note else "") + (f"compiled layers: {compile_seconds():.1f} s compiling in the "
                                                "warm-ups (not timed)")
    suffix = model_suffix(args.model) + ("-compile" if compiled is not None else "")
    write_results(result_name("decode", device, args.dtype, suffix), payload,
                  f"Plain greedy decoding, model {args.model}, {args.task} prompts, {n} new tokens per row, "
                  f"{args.dtype} on {device} (median of {args.repeats} after a warm-up)"
                  + (f"; {note}" if note else "") + "\n\n" + markdown_table(header, rows), args.out)


def _hf_model(path: Path, dtype, device: str, tok):
    """The same checkpoint in transformers, set to decode exactly N tokens (EOS ignored, like ``ignore_eos``)."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = tok.pad_token_id
    return hf


def _measure_batch(b: int, args, tok, engine, hf, vllm, device: str, compiled=None) -> tuple[dict, list]:
    """Every engine on ``b`` prompts, interleaved: the result record and its table row."""
    import torch
    n = args.new_tokens
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
        if compiled is not None:
            fns["compiled"] = lambda: out.__setitem__("compiled", compiled.generate(prompts).tokens)
        if vllm is not None:
            fns["vllm"] = lambda: out.__setitem__("vllm", vllm(prompts))
        # vLLM's worker keeps cores busy after its call returns (Intel OpenMP spins 200 ms, its engine longer): the next
        # engine (tltlib, in every round) would share them; each call is followed by 0.3 s of idle, then until quiet
        timing = interleaved_medians(fns, device, args.repeats, settle=0.3 if vllm is not None else 0.0)
        (t_ours, all_ours), (t_hf, all_hf) = timing["ours"], timing["hf"]
    identical = bool(torch.equal(out["ours"].cpu(), out["hf"].cpu()))
    if vllm is not None:
        identical = identical and out["ours"].cpu().tolist() == out["vllm"]
    rec = {"batch": b, "new_tokens": n, "tltlib_s": t_ours, "transformers_s": t_hf, "tltlib_runs": all_ours,
           "transformers_runs": all_hf, "tltlib_tok_s": b * n / t_ours, "transformers_tok_s": b * n / t_hf,
           "ratio": t_hf / t_ours, "identical_tokens": identical}
    row = [b, rec["tltlib_tok_s"], rec["transformers_tok_s"], f"{rec['ratio']:.2f}x", identical]
    if vllm is not None:
        rec["vllm_tok_s"] = b * n / timing["vllm"][0]
        rec["vllm_runs"] = timing["vllm"][1]
        rec["ratio_vllm"] = timing["vllm"][0] / t_ours
        row[3:3] = [rec["vllm_tok_s"], f"{rec['ratio_vllm']:.2f}x"]
    if compiled is not None:
        t_c, all_c = timing["compiled"]
        rec.update(compiled_tok_s=b * n / t_c, compiled_runs=all_c, ratio_compiled=t_ours / t_c,
                   compiled_identical=bool(torch.equal(out["compiled"].cpu(), out["hf"].cpu())))
        row += [rec["compiled_tok_s"], f"{rec['ratio_compiled']:.2f}x", rec["compiled_identical"]]
    return rec, row


if __name__ == "__main__":
    main()
