"""TRL's GRPOTrainer as the peer of bench e2e_grpo: the same model, prompts, reward, batch, completion length and
learning rate, run once per setting in ``TRL_RUNS`` (its defaults, then one change at a time, to the settings a user
who measured picks on the device), with timers around its phases, and the comparison with tltlib's baseline.

Imported by ``bench/e2e_grpo.py`` (its ``--trl-*`` flags); not a bench of its own.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _common import markdown_table, resolve

TRL_RUNS = ("defaults", "no-bf16", "no-bf16-no-ckpt", "tuned")   # --trl-runs: see trl_settings
TRL_DEFAULT_ROWS = 8       # TRL 1.16's per_device_train_batch_size default
TRL_TUNED_ROWS = 32        # the tuned run's micro-batch rows (--trl-rows; 16, 32, 64 and 128 measured: 32 fastest)
CB_PAGE = 256              # transformers' continuous-batching page (tokens per block), its default
CB_BATCH_TOKENS = 1024     # tokens per continuous-batching forward: its 8,192 default sizes the masks at GBs
TRL_RECORDED = ("bf16", "fp16", "gradient_checkpointing", "per_device_train_batch_size",
                "gradient_accumulation_steps", "steps_per_generation", "generation_batch_size",
                "use_transformers_continuous_batching", "transformers_continuous_batching_config", "use_vllm",
                "torch_compile", "shuffle_dataset", "optim")


def trl_run_name(text: str) -> str:
    """``text`` when it names one of the TRL runs (an argparse ``type`` or a :func:`listed` item)."""
    if text not in TRL_RUNS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TRL run ({', '.join(TRL_RUNS)})")
    return text


def trl_key(run: str) -> str:
    """The result file's key of a TRL run: ``trl`` for TRL's defaults (what older files hold), else ``trl_<run>``."""
    return "trl" if run == "defaults" else "trl_" + run.replace("-", "_")


def largest_divisor(total: int, cap: int) -> int:
    """The largest divisor of ``total`` that is at most ``cap``: micro-batch rows that split a batch evenly."""
    return max(d for d in range(1, min(cap, total) + 1) if total % d == 0)


def bf16_cpu_flags(cpuinfo: str) -> list[str]:
    """The flags of native bf16 arithmetic (AVX512-BF16 dot products, AMX-BF16 tiles) in /proc/cpuinfo's text."""
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return sorted(set(flags) & {"avx512_bf16", "amx_bf16"})


def trl_settings(batch: int, max_tokens: int, rows: int = TRL_TUNED_ROWS, continuous: bool = True) -> dict[str, dict]:
    """TRL's ``GRPOConfig`` settings per run, beyond the workload every run shares (``batch`` rows per RL step, each
    at most ``max_tokens`` tokens, prompt and completion).

    ``defaults``: TRL's own (bf16 autocast, gradient checkpointing, plain ``generate``) with its default micro-batch
    of 8 rows (the largest divisor of ``batch`` up to 8). ``tuned``: what a user who measured sets: no bf16 autocast
    (the model computes in the bench's ``--dtype``, as tltlib does), no gradient checkpointing (a 3.3M-parameter
    model's activations fit many times over), micro-batches of up to ``rows`` rows, and with
    ``continuous`` transformers' continuous batching for generation, its KV cache sized to the batch instead of half
    the free memory. Between them, each changing one thing: ``no-bf16`` (the defaults with bf16 off) and
    ``no-bf16-no-ckpt`` (and checkpointing off); ``tuned`` then changes the micro-batch and the generation."""
    d, t = largest_divisor(batch, TRL_DEFAULT_ROWS), largest_divisor(batch, rows)
    defaults = {"per_device_train_batch_size": d, "gradient_accumulation_steps": batch // d}
    no_bf16 = {**defaults, "bf16": False, "fp16": False}
    no_ckpt = {**no_bf16, "gradient_checkpointing": False}
    tuned = {**no_ckpt, "per_device_train_batch_size": t, "gradient_accumulation_steps": batch // t,
             "use_transformers_continuous_batching": continuous}
    if continuous:
        tuned["transformers_continuous_batching_config"] = {"num_blocks": batch * -(-max_tokens // CB_PAGE),
                                                            "max_batch_tokens": CB_BATCH_TOKENS}
    return {"defaults": defaults, "no-bf16": no_bf16, "no-bf16-no-ckpt": no_ckpt, "tuned": tuned}


def native_bf16(device: str) -> dict:
    """Whether ``device`` computes in bf16 natively, and how that was found (recorded with each TRL run)."""
    import torch
    if device.startswith("cuda"):
        return {"native_bf16": bool(torch.cuda.is_bf16_supported()), "checked": "torch.cuda.is_bf16_supported()"}
    try:
        flags = bf16_cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        flags = []
    return {"native_bf16": bool(flags), "cpu_bf16_flags": flags, "checked": "/proc/cpuinfo flags avx512_bf16, amx_bf16",
            "torch_mkldnn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())}


def _trl_peer(args, problems, device) -> dict:
    """Every TRL run of ``--trl-runs`` in turn, each from the checkpoint on disk: ``{run name: result}``."""
    import importlib.util
    if importlib.util.find_spec("trl") is None:
        print("TRL peer skipped: trl is not installed (install it: python -m tltlib setup)", flush=True)
        return {}
    from tltlib.tasks.tokenizer import load_tokenizer
    tok = load_tokenizer(resolve(args.model))
    longest = max(len(tok(p.prompt)["input_ids"]) for p in problems) + args.max_new
    settings = trl_settings(args.prompts * args.num_generations, longest, args.trl_rows, args.trl_continuous == "on")
    hw = native_bf16(device)
    out = {}
    for name in args.trl_runs.items:
        print(f"TRL {name}: {settings[name]}", flush=True)
        out[name] = {"run": name, **_trl_run(args, problems, settings[name]), **hw}
        print(f"TRL {name}: steps {', '.join(f'{x:.1f}' for x in out[name]['step_s'])} s", flush=True)
    return out


def _trl_run(args, problems, settings: dict) -> dict:
    """TRL's GRPOTrainer on the same model, prompts, reward, batch, completion length and learning rate, with
    ``settings`` on top; timers around its phases (the wrapped callables are called exactly as before)."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    from tltlib.rl.grpo import accuracy_reward
    from tltlib.tasks.tokenizer import load_tokenizer
    ds = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])
    model = AutoModelForCausalLM.from_pretrained(resolve(args.model), dtype=getattr(torch, args.dtype))
    cfg = TRLConfig(output_dir=tempfile.mkdtemp(), num_generations=args.num_generations,
                    max_completion_length=args.max_new,
                    temperature=args.temperature, learning_rate=args.lr, beta=0.0, loss_type="dapo",
                    use_cpu=not args.device.startswith("cuda"), logging_steps=1, max_steps=args.trl_steps,
                    report_to="none", save_strategy="no", seed=0, disable_tqdm=True, shuffle_dataset=False,
                    **settings)
    trainer = TRLTrainer(model=model, reward_funcs=accuracy_reward, args=cfg, train_dataset=ds,
                         processing_class=load_tokenizer(resolve(args.model)))
    phases = _trl_timers(trainer, model)
    t = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t
    steps = [h for h in trainer.state.log_history if "step_time" in h]
    recorded = {k: getattr(cfg, k) for k in TRL_RECORDED}
    recorded["optim"] = getattr(recorded["optim"], "value", str(recorded["optim"]))
    return {"version": trl.__version__, "transformers": transformers.__version__, "settings": recorded,
            "passed": settings, "torch_dtype": str(model.dtype).removeprefix("torch."), "total_s": total,
            **_trl_steps(phases, [h["step_time"] for h in steps], cfg.gradient_accumulation_steps),
            "reward": [h.get("reward") for h in steps], "micro_batches": cfg.gradient_accumulation_steps,
            "gradient_checkpointing": bool(cfg.gradient_checkpointing)}


def _trl_timers(trainer, model) -> dict[str, list[float]]:
    """Wrap TRL's phases with timers: generate (plain or continuous batching), generate + score, the loss's
    forward, the training step (all its micro-batches' forward + backward; the first also generates)."""
    phases = {"generate": [], "generate_and_score": [], "loss_forward": [], "training_step": []}

    def timed(fn, key):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            phases[key].append(time.perf_counter() - t)
            return out
        return wrapper

    model.generate = timed(model.generate, "generate")
    if hasattr(model, "generate_batch"):
        model.generate_batch = timed(model.generate_batch, "generate")
    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, "generate_and_score")
    trainer.compute_loss = timed(trainer.compute_loss, "loss_forward")
    trainer.training_step = timed(trainer.training_step, "training_step")
    return phases


def _trl_steps(phases: dict, step_s: list[float], micro: int) -> dict:
    """Per RL step: TRL's step and its phases (one generation per step, then ``micro`` micro-batches); backward is
    the training steps' time less generate + score and the loss's forward."""
    def per_step(key):
        v = phases[key]
        return [sum(v[i * micro:(i + 1) * micro]) for i in range(len(step_s))] if key in ("loss_forward",
                                                                                          "training_step") else v
    gs, lf, ts = per_step("generate_and_score"), per_step("loss_forward"), per_step("training_step")
    return {"step_s": step_s, "generate_s": per_step("generate"), "generate_and_score_s": gs, "loss_forward_s": lf,
            "backward_s": [t - g - f for t, g, f in zip(ts, gs, lf)]}


def trl_medians(run: dict) -> dict:
    """Median seconds per RL step of a TRL run's phases: generate, score (the rest of TRL's generate-and-score:
    rewards, tokenising, bookkeeping), the loss's forward, backward, update (forward + backward) and the step."""
    def med(v):
        return float(statistics.median(v)) if v else None
    gen, gs, lf, bw = (run.get(k) or [] for k in ("generate_s", "generate_and_score_s", "loss_forward_s",
                                                    "backward_s"))
    return {"generate": med(gen), "score": med([s - g for s, g in zip(gs, gen)]), "loss_forward": med(lf),
            "backward": med(bw), "update": med([f + b for f, b in zip(lf, bw)]), "step": med(run["step_s"])}


TRL_VS_TLTLIB = {"generate": "rollout", "update": "update", "step": "step"}   # TRL's phase: tltlib's
LADDER_PHASES = ("generate", "loss_forward", "backward", "step")


def trl_comparison(baseline: dict, runs: dict) -> dict:
    """``{"runs": {name: {"median": phases, "vs_baseline": ratios}}, "ladder": [...]}`` for TRL runs ``{name: result}``
    against tltlib's ``baseline`` summary: TRL's median generate / the baseline's rollout, its forward + backward /
    the baseline's update (which includes the optimiser step), step / step. The ladder goes through the runs present
    in :data:`TRL_RUNS` order (defaults, no-bf16, no-bf16-no-ckpt, tuned), each pair's phases before / after."""
    med = {name: trl_medians(r) for name, r in runs.items()}
    out = {"runs": {name: {"median": m, "vs_baseline": {k: m[k] / baseline[b] for k, b in TRL_VS_TLTLIB.items()
                                                        if m[k] is not None and baseline.get(b)}}
                    for name, m in med.items()}}
    order = [name for name in TRL_RUNS if name in med]
    out["ladder"] = [{"from": a, "to": b, **{k: med[a][k] / med[b][k] for k in LADDER_PHASES
                                             if med[a][k] is not None and med[b][k]}}
                     for a, b in zip(order, order[1:])]
    return out


def _trl_settings_line(r: dict) -> list:
    """A TRL run's row of the settings table (older files record fewer settings: '?')."""
    st = r.get("settings", {})
    cb = st.get("use_transformers_continuous_batching")
    return [r.get("run", "defaults"), st.get("bf16", "?"), r.get("gradient_checkpointing", "?"),
            f"{st.get('per_device_train_batch_size', '?')} x {r.get('micro_batches', '?')}",
            "?" if cb is None else ("continuous batching" if cb else "plain generate"), r.get("torch_dtype", "?")]


def _trl_tables(trl: dict, cmp: dict | None, s: dict, args) -> str:
    """TRL's runs beside tltlib's: settings, median phases, ratios to the baseline, the ladder between the runs."""
    if not cmp:
        return ""
    first = next(iter(trl.values()))
    b, t = s["baseline"], s["tlt"]
    text = (f"\n\nTRL {first['version']} GRPOTrainer (transformers {first.get('transformers', '?')}) on the same "
            f"workload: the same model, reward, {args.prompts} x {args.num_generations} batch, completion length, "
            f"temperature, "
            f"lr, DAPO loss, beta 0, seed 0's prompts of steps 1-{args.trl_steps}; its runs in turn, each from the "
            f"checkpoint. Native bf16 on this device: {'yes' if first.get('native_bf16') else 'no'} "
            f"({', '.join(first.get('cpu_bf16_flags', [])) or first.get('checked', '?')}).\n\n" + markdown_table(
                ["TRL run", "bf16 autocast", "gradient checkpointing", "micro-batches (rows x count)", "generation",
                 "weights"], [_trl_settings_line(r) for r in trl.values()]))
    rows = [[name, v["rollout"], v["reward"] + v["logprob"], "—", "—", v["update"], v["step"], "1.00x" if v is b
             else f"{v['step'] / b['step']:.2f}x"] for name, v in (("tltlib baseline", b), ("tltlib TLT", t))]
    for name, r in cmp["runs"].items():
        m, vs = r["median"], r["vs_baseline"]
        rows.append([f"TRL {name}", m["generate"], m["score"], m["loss_forward"], m["backward"], m["update"],
                     m["step"], f"{vs['step']:.2f}x"])
    text += (f"\n\nMedian seconds per step (TRL: over its {args.trl_steps} steps; TRL's update is the loss's forward + "
             "backward, tltlib's also the optimiser step, not split):\n\n" + markdown_table(
                 ["run", "rollout / generate", "reward + log-prob / score", "loss forward", "backward", "update",
                  "step", "step / baseline step"], rows))
    text += "\n\nTRL / tltlib baseline, per phase:\n\n" + markdown_table(
        ["TRL run", "generate / rollout", "forward + backward / update", "step / step"],
        [[name, *(f"{r['vs_baseline'].get(k, float('nan')):.2f}x" for k in TRL_VS_TLTLIB)]
         for name, r in cmp["runs"].items()])
    if cmp["ladder"]:
        text += ("\n\nWhere the defaults' time goes: each run against the next, which changes one thing (the last "
                 "also the micro-batch and the generation), phase time before / after:\n\n" + markdown_table(
                     ["from", "to", "generate", "loss forward", "backward", "step"],
                     [[x["from"], x["to"], *(f"{x[k]:.2f}x" if k in x else "n/a" for k in LADDER_PHASES)]
                      for x in cmp["ladder"]]))
    for name, r in trl.items():
        text += (f"\n\nTRL {name}, per step: " + "; ".join(
            f"{label} " + ", ".join(f"{x:.1f}" for x in r.get(key, [])) for label, key in (
                ("step", "step_s"), ("generate", "generate_s"), ("generate + score", "generate_and_score_s"),
                ("loss forward", "loss_forward_s"), ("backward", "backward_s"))) + " s.")
    return text
