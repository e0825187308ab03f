"""End-to-end GRPO: the baseline (plain decoding, no drafter) vs TLT (adaptive SD + online drafter), side by side in
one process on the same prompts and seeds, with TRL's GRPOTrainer on the same workload as the peer.

Per RL step and policy: the time of each phase (rollout, reference/old log-probs, update, drafter training), the
step, the reward; per seed the held-out accuracy at the end (greedy). Reported: mean step time and speedup, the
rollout's share of the baseline step, the Amdahl bound 1 / ((1 - s) + s / r) from that share s and the measured
rollout speedup r, and how close TLT's step speedup gets to it; reward curves (mean +- std over seeds) and whether
they overlap; final held-out accuracy of both with Welch's t-test. For the first seed, the accepted length per RL
step of the drafter TLT trains online, of the same drafter kept frozen, and of the n-gram drafter, on a fixed probe
set (measured outside the timed phases). Also the update's tokens/s with length-bucketed micro-batches vs padded
micro-batches of a fixed row count in arrival order (TRL's per-device batches).

    python -m tltlib bench e2e_grpo                                  # CPU, tiny reasoner, 3 seeds x 8 steps
    python -m tltlib bench e2e_grpo --drafter data/tiny-reasoner-drafter-early   # the drifted warm-up
    python -m tltlib bench e2e_grpo --device cuda --dtype bfloat16 --model ... --drafter ...
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ensure_malloc_env, machine_info, markdown_table, write_results  # noqa: E402

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="data/tiny-reasoner")
    ap.add_argument("--drafter", default="data/tiny-reasoner-drafter", help="TLT's warm drafter (trained online)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=8, help="RL steps per seed")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step (x --group completions)")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=720)
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--micro-batch-tokens", type=int, default=2048)
    ap.add_argument("--drafter-steps", type=int, default=6)
    ap.add_argument("--drafter-batch", type=int, default=4)
    ap.add_argument("--threshold", type=int, default=0, help="SD switch (0 = the device default)")
    ap.add_argument("--on-drafter-change", default="reset", choices=["reset", "keep"],
                    help="the tuner's reward windows of the drafter's arms after it trains: re-explore or keep")
    ap.add_argument("--held-out", type=int, default=128, help="held-out problems for the final accuracy")
    ap.add_argument("--probe", type=int, default=16, help="probe prompts for the accepted-length curves (0 = off)")
    ap.add_argument("--probe-strategy", default="chain-8")
    ap.add_argument("--trl-steps", type=int, default=2, help="TRL GRPOTrainer steps (0 = skip the peer)")
    ap.add_argument("--tag", default="", help="suffix of the result files (e.g. -drift)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--replot", metavar="JSON", help="only redraw the figures of an earlier result file")
    args = ap.parse_args()
    if args.replot:
        from tltlib.fileio import read_json
        _figures(read_json(args.replot, "give a bench/results/e2e_grpo-*.json file"), Path(args.replot))
        return
    ensure_malloc_env()

    import torch

    from tltlib.checkpoint import load
    from tltlib.e2e import compare, summarize, update_speed
    from tltlib.grpo import GRPOConfig
    from tltlib.tasks import ChainTaskConfig, encode_prompts, generate_problems
    from tltlib.trainer import GRPOTrainer, TLTConfig

    torch.set_num_threads(os.cpu_count() or 1)
    model, tok, drafter = load(args.model, args.drafter, device=args.device, dtype=args.dtype)
    device = str(model.device)
    train = generate_problems(ChainTaskConfig(), 4096, seed=1)
    held = generate_problems(ChainTaskConfig(zipf_exponent=0.6), args.held_out, seed=10_001)
    probe = generate_problems(ChainTaskConfig(zipf_exponent=0.6), args.probe, seed=20_002) if args.probe else []
    tlt = TLTConfig(speculative="adaptive", threshold=args.threshold, drafter_steps=args.drafter_steps,
                    drafter_batch=args.drafter_batch, on_drafter_change=args.on_drafter_change)

    def grpo(seed):
        return GRPOConfig(num_generations=args.group, generation_batch_size=args.prompts * args.group,
                          max_completion_length=args.max_new, temperature=args.temperature, learning_rate=args.lr,
                          max_steps=args.steps, seed=seed, micro_batch_tokens=args.micro_batch_tokens)

    result = compare(model, tok, drafter, train, held, grpo, tlt, args.seeds, args.steps, probe,
                     args.probe_strategy, log=lambda s: print(s, flush=True))
    upd = update_speed(GRPOTrainer(copy.deepcopy(model), tok, train, grpo(0)),
                       encode_prompts(train[: args.prompts], tok))
    trl = _trl_peer(args, train) if args.trl_steps else None
    summary = summarize(result["runs"], trl["step_s"][-1] if trl and trl["step_s"] else None)
    table = _tables(summary, result["acceptance"], upd, trl, args, device)
    payload = {"bench": "e2e_grpo", "machine": machine_info(device), "settings": vars(args), "summary": summary,
               "acceptance": result["acceptance"], "update_speed": upd, "trl": trl, "runs": result["runs"]}
    path = write_results(f"e2e_grpo-{device.split(':')[0]}-{args.dtype}{args.tag}", payload, table, args.out)
    _figures(payload, path)


def _figures(payload: dict, json_path: Path) -> None:
    """``<result>-acceptance.png`` (accepted length per RL step, online / frozen / n-gram) beside the result file."""
    if not payload.get("acceptance"):
        return
    from tltlib.plots import acceptance_curves
    fig = acceptance_curves(payload["acceptance"], payload["settings"]["probe_strategy"])
    out = json_path.with_name(json_path.stem + "-acceptance.png")
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(out)
    print(f"figure: {out}")


def _trl_peer(args, train) -> dict | None:
    """TRL's GRPOTrainer on the same model, reward, batch, completion length and learning rate (CPU)."""
    try:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM
        from trl import GRPOConfig as TRLConfig
        from trl import GRPOTrainer as TRLTrainer
    except ImportError as e:
        print(f"TRL peer skipped: {e} (install it: python -m tltlib setup --extras peers)", flush=True)
        return None
    import torch

    from tltlib.grpo import accuracy_reward
    from tltlib.params import resolve
    from tltlib.tokenizer import load_tokenizer
    ds = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in train])
    model = AutoModelForCausalLM.from_pretrained(resolve(args.model), dtype=getattr(torch, args.dtype))
    total = args.prompts * args.group
    per_device = max(d for d in range(1, min(16, total) + 1) if total % d == 0)   # our micro-batches: 16 rows
    cfg = TRLConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=per_device,
                    gradient_accumulation_steps=total // per_device,
                    num_generations=args.group, max_completion_length=args.max_new, temperature=args.temperature,
                    learning_rate=args.lr, beta=0.0, loss_type="dapo", use_cpu=not args.device.startswith("cuda"),
                    logging_steps=1, max_steps=args.trl_steps, report_to="none", save_strategy="no", seed=0,
                    disable_tqdm=True)
    trainer = TRLTrainer(model=model, reward_funcs=accuracy_reward, args=cfg, train_dataset=ds,
                         processing_class=load_tokenizer(resolve(args.model)))
    # Where TRL's step goes: wrap its phases with timers (the wrapped callables are called exactly as before).
    phases = {"generate": [], "generate_and_score": [], "loss_forward": [], "training_step": []}

    def timed(fn, key):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            phases[key].append(time.perf_counter() - t)
            return out
        return wrapper

    model.generate = timed(model.generate, "generate")
    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, "generate_and_score")
    trainer.compute_loss = timed(trainer.compute_loss, "loss_forward")
    trainer.training_step = timed(trainer.training_step, "training_step")
    t = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t
    steps = [h for h in trainer.state.log_history if "step_time" in h]
    micro = cfg.gradient_accumulation_steps       # one generation per RL step, then one training_step per micro-batch

    def per_step(key):
        v = phases[key]
        return [sum(v[i * micro:(i + 1) * micro]) for i in range(len(steps))] if key in ("loss_forward",
                                                                                          "training_step") else v
    gs, lf, ts = per_step("generate_and_score"), per_step("loss_forward"), per_step("training_step")
    import trl
    return {"version": trl.__version__, "total_s": total, "step_s": [h["step_time"] for h in steps],
            "generate_s": per_step("generate"), "generate_and_score_s": gs, "loss_forward_s": lf,
            "backward_s": [t - g - f for t, g, f in zip(ts, gs, lf)], "micro_batches": micro,
            "reward": [h.get("reward") for h in steps], "gradient_checkpointing": bool(cfg.gradient_checkpointing)}


def _tables(s, acceptance, upd, trl, args, device) -> str:
    b, t, c = s["baseline"], s["tlt"], s["comparison"]
    rows = [[name, v["rollout"], v["logprob"], v["update"], v["drafter"], v["step"],
             f"{b['step'] / v['step']:.2f}x", f"{v['rollout'] / v['step']:.0%}"] for name, v in (("baseline", b),
                                                                                                 ("TLT", t))]
    text = (f"GRPO end to end, {args.prompts} prompts x {args.group} completions, up to {args.max_new} tokens, "
            f"T={args.temperature}, lr {args.lr}, {args.steps} steps x {args.seeds} seeds, {args.dtype} on {device}"
            " (mean seconds per step)\n\n" + markdown_table(
                ["policy", "rollout", "log-prob", "update", "drafter", "step", "speedup", "rollout share"], rows))
    text += (f"\n\nRollout speedup {c['rollout_speedup']:.2f}x; Amdahl bound {c['amdahl_bound']:.2f}x from the "
             f"baseline's rollout share {c['rollout_share_baseline']:.0%}; TLT's step speedup "
             f"{c['step_speedup']:.2f}x = {c['of_bound']:.0%} of the bound. Drafter training: "
             f"{c['drafter_share_of_tlt_step']:.1%} of TLT's step.")
    text += ("\n\nReward per step, mean +- std over seeds:\n\n" + markdown_table(
        ["step", "baseline", "TLT"], [[k + 1, f"{statistics.mean(x):.3f} +- {statistics.pstdev(x):.3f}",
                                      f"{statistics.mean(y):.3f} +- {statistics.pstdev(y):.3f}"]
                                     for k, (x, y) in enumerate(zip(b["reward_by_step"], t["reward_by_step"]))]))
    text += (f"\n\nCurves overlap (|mean difference| <= sum of the stds) at {c['reward_curves_overlap_frac']:.0%} of "
             f"the steps. Held-out accuracy (greedy, {args.held_out} problems): baseline "
             f"{statistics.mean(b['held_out']):.3f} ({', '.join(f'{x:.3f}' for x in b['held_out'])}), TLT "
             f"{statistics.mean(t['held_out']):.3f} ({', '.join(f'{x:.3f}' for x in t['held_out'])}); Welch t-test "
             f"p = {c['held_out_welch_p'] if c['held_out_welch_p'] is None else round(c['held_out_welch_p'], 3)}.")
    if acceptance:
        text += (f"\n\nAccepted length per RL step ({args.probe_strategy} on {args.probe} probe prompts, seed 0):\n\n"
                 + markdown_table(["step", "online drafter", "frozen drafter", "n-gram"],
                                  [[a["step"], a["online"], a["frozen"], a["ngram"]] for a in acceptance]))
    if upd:
        text += "\n\nUpdate (forward + backward) on one rollout's batch:\n\n" + markdown_table(
            ["micro-batches", "count", "padded tokens", "tokens/s"],
            [[k, v["micro_batches"], v["padded_tokens"], v["tokens_per_s"]] for k, v in upd.items() if k != "tokens"])
    if trl and trl["step_s"]:
        def s_(key):
            return ", ".join(f"{x:.1f}" for x in trl.get(key, []))
        text += (f"\n\nTRL {trl['version']} GRPOTrainer, same workload (gradient checkpointing "
                 f"{'on, its default' if trl['gradient_checkpointing'] else 'off'}): step times {s_('step_s')} s, of "
                 f"which generate {s_('generate_s')} s, generate + reward + bookkeeping {s_('generate_and_score_s')} s, "
                 f"loss forward {s_('loss_forward_s')} s, backward {s_('backward_s')} s (over "
                 f"{trl.get('micro_batches', '?')} micro-batches); tltlib's baseline step is "
                 f"{c['baseline_vs_trl_step']:.1f}x faster than TRL's last step.")
    return text


if __name__ == "__main__":
    main()
