"""Is the drafter still good: its top-1 agreement with the target by draft depth on the model's own responses and
its accept length at the user's sampling settings, beside what its card (``train_log.json``) measured when it was
trained; a drafter far below its card was trained for another policy, is not the one the run syncs, or proposes
through a wrong vocabulary mapping.

Paper: TLT §4 (the adaptive drafter keeps up with the policy).
Departures: none.
"""
from __future__ import annotations

import torch
from scipy.stats import binomtest

from ...drafting.train import autocast_to_target, depth_accuracy
from ...drafting.warmup import rows_pairs
from ...fileio import read_json, resolve
from ...rollout.alarms import CARD_FILE, AlarmConfig, card_acceptance, card_floor
from .config import Verdict

DEPTH = 5
"""Draft depths whose top-1 agreement is measured."""
FAR_BELOW = 0.8
"""A drafter is flagged when its depth-1 agreement is below this share of its card's, significantly (p < 1e-6)."""


def card_numbers(drafter_path) -> dict:
    """What the drafter's card (``train_log.json``) measured: ``top1`` by depth on held-out responses and
    ``accept`` (accept length by strategy, :func:`tltlib.rollout.alarms.card_acceptance`); {} when it has none."""
    folder = resolve(drafter_path) if drafter_path else None
    if folder is None or not (folder / CARD_FILE).is_file():
        return {}
    d = read_json(folder / CARD_FILE, "retrain the drafter (python -m tltlib train-drafter)")
    accs = (d.get("log") or {}).get("eval_acc") or [[]]
    return {"top1": [float(a) for a in accs[-1]], "accept": card_acceptance(folder)}


def top1_by_depth(model, tokenizer, drafter, rows) -> tuple[list[float], int]:
    """(top-1 agreement with the target's argmax at depths 1..DEPTH, pairs at depth 1) on ``rows`` of
    (prompt ids, response ids)."""
    buf = rows_pairs(model, tokenizer, rows)
    batch = buf.batch(buf.sequences())
    with torch.no_grad(), autocast_to_target(drafter):
        accs = depth_accuracy(drafter, batch, DEPTH)
    return accs, int(batch.mask.sum())


def quality(model, tokenizer, drafter, plain, spec, strategy_name: str, card: dict) -> tuple[list[Verdict], dict]:
    """The drafter part's verdicts from a plain rollout's responses (``plain``) and a speculative one (``spec``,
    every iteration ``strategy_name``)."""
    rows = [(plain.prompt_ids[i // plain.num_generations], plain.response_ids(i)) for i in range(plain.num_sequences)]
    accs, n = top1_by_depth(model, tokenizer, drafter, rows)
    verdicts, numbers = [], {"top1": accs, "pairs": n}
    ref = card.get("top1") or []
    if ref:
        p = float(binomtest(round(accs[0] * n), n, ref[0], alternative="less").pvalue) if n else 1.0
        far = accs[0] < FAR_BELOW * ref[0] and p < 1e-6
        numbers.update(card_top1=ref, pvalue=p)
        verdicts.append(Verdict("drafter", "top-1 by depth", "warn" if far else "pass",
                                "top-1 by depth " + " ".join(f"{a:.0%}" for a in accs) + f" on {n} pairs of the "
                                "model's responses vs its card's " + " ".join(f"{a:.0%}" for a in ref)
                                + (f": far below (p = {p:.1e}); the drafter was trained for another policy, is not "
                                   "the one the run syncs, or maps its draft vocabulary wrongly" if far else ""),
                                numbers))
    else:
        verdicts.append(Verdict("drafter", "top-1 by depth", "info", "top-1 by depth " + " ".join(
            f"{a:.0%}" for a in accs) + f" on {n} pairs (its folder has no train_log.json to compare with)", numbers))
    accept = float(spec.stats.get("spec/accept_len_mean", 1.0))
    card_accept = (card.get("accept") or {}).get(strategy_name)
    floor = round(card_floor({strategy_name: accept}, AlarmConfig().floor_share), 2)   # the run's rule, from here
    line = f"accept length {accept:.2f} tokens per SD step with {strategy_name}"
    line += f" (its card: {card_accept:.2f})" if card_accept else ""
    line += f"; alarm floor: {floor} (tlt.accept_floor)"
    verdicts.append(Verdict("drafter", "accept length", "info", line,
                            {"accept_len_mean": accept, "card_accept_len_mean": card_accept, "alarm_floor": floor}))
    return verdicts, {**numbers, "accept_len_mean": accept, "alarm_floor": floor}
