"""The tuner prior file: the cost model and the measured acceptance of one model, drafter and machine, written by
``python -m tltlib check --prior FILE`` (:func:`save_prior`) and read by the next run on the same three
(``tlt.prior``, :func:`load_prior`) with the threshold, arms and accept floor recommended with them.

Every part of the file is checked when it is read, and refused in one error naming the file, the part and the fix:
another model, drafter or machine (its costs and acceptance would mislead the tuner), a part missing, a number that
is not one, an accept floor under 1 token (what ``tlt.accept_floor`` refuses too).

Paper: TLT §5 (the tuner's cost model). Departures: none (tooling).
"""
from __future__ import annotations

import json
import math
from typing import NamedTuple

from ..errors import BadInput
from ..fileio import atomic_write_text, read_json
from ..machine import machine_info
from ..model.weights import fingerprint
from ..sim.costs import MeasuredCosts
from ..spec.strategy import SpecStrategy

PRIOR_FORMAT = "tltlib-tuner-prior"
FAMILIES = ("learned", "ngram")
"""The drafter families whose acceptance a prior holds (:attr:`tltlib.rollout.adaptive.AdaptiveController.accept`)."""
AGAIN = "write it again with python -m tltlib check --model M --drafter D --prior FILE"


class Prior(NamedTuple):
    """What a tuner prior file holds: the cost model, the measured acceptance states by drafter family, and the
    threshold, arms and accept floor recommended with them (``python -m tltlib check``; 0, () and None when none
    was)."""

    costs: MeasuredCosts
    accept: dict
    threshold: int
    arms: tuple
    accept_floor: float | None = None


def _fingerprint(target, drafter, device: str) -> dict:
    c, m = target.config, machine_info(device)
    return {"model": {"hidden_size": c.hidden_size, "num_layers": c.num_layers, "vocab_size": c.vocab_size,
                      "dtype": str(target.embed.weight.dtype)},
            "drafter": None if drafter is None else {"draft_vocab_size": drafter.config.draft_vocab_size,
                                                     "weights": fingerprint(drafter)},
            "machine": {k: m.get(k) for k in ("cpu", "gpu", "threads", "torch")}}


def save_prior(path, controller, target, drafter=None, recommended: dict | None = None) -> None:
    """Write the controller's (:class:`~tltlib.rollout.adaptive.AdaptiveController`) cost model and measured
    acceptance (JSON, atomically), with the model's shape, the drafter's weights (a digest) and the machine they
    were measured on, so the next run on the same model, drafter and machine starts from them; ``recommended``:
    ``{"threshold": int, "arms": [names], "accept_floor": float | None}`` measured with them."""
    if controller.costs is None:
        raise BadInput("this controller has no cost model to save; build it with costs=measure_costs(...) "
                       "(tltlib.sim.measure)")
    d = {"format": PRIOR_FORMAT, "fingerprint": _fingerprint(target, drafter, str(target.embed.weight.device)),
         "costs": controller.costs.to_dict(), "accept": {f: a.state_dict() for f, a in controller.accept.items()},
         "recommended": recommended or {"threshold": 0, "arms": []}}
    atomic_write_text(path, json.dumps(d, indent=1) + "\n")


def _number(value, what: str, path, lo: float = 0.0, integer: bool = False) -> float:
    """``value`` when it is a finite number >= ``lo`` (an int when ``integer``), else one error naming the part."""
    ok = isinstance(value, int if integer else (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) and value >= lo
    if not ok:
        kind = "an integer" if integer else "a number"
        raise BadInput(f"{path}: {what} must be {kind} >= {lo:g}, got {value!r}: {AGAIN}")
    return value


def _accept_states(d, path) -> dict:
    """The acceptance states by family, each ``{"reached": [n], "accepted": [n], "prior": [rates]}``, checked."""
    if not isinstance(d, dict) or not set(d) <= set(FAMILIES):
        raise BadInput(f"{path}: accept must map the drafter families {list(FAMILIES)} to their acceptance, got "
                       f"{d!r:.80}: {AGAIN}")
    for family, state in d.items():
        if not isinstance(state, dict) or not all(isinstance(state.get(k), list) for k in ("reached", "accepted")):
            raise BadInput(f"{path}: accept.{family} needs the lists reached and accepted: {AGAIN}")
        for key in ("reached", "accepted", "prior"):
            for i, v in enumerate(state.get(key, [])):
                _number(v, f"accept.{family}.{key}[{i}]", path)
        if len(state["reached"]) != len(state["accepted"]):
            raise BadInput(f"{path}: accept.{family} has {len(state['reached'])} reached and "
                           f"{len(state['accepted'])} accepted counts: {AGAIN}")
    return d


def _recommended(rec, path) -> tuple[int, tuple, float | None]:
    if not isinstance(rec, dict):
        raise BadInput(f"{path}: recommended must be a mapping (threshold, arms, accept_floor), got {rec!r}: {AGAIN}")
    threshold = _number(rec.get("threshold", 0), "recommended.threshold", path, integer=True)
    arms = rec.get("arms", [])
    if not isinstance(arms, list) or not all(isinstance(a, str) for a in arms):
        raise BadInput(f"{path}: recommended.arms must be a list of strategy names, got {arms!r}: {AGAIN}")
    for i, arm in enumerate(arms):
        try:
            SpecStrategy.parse(arm)
        except ValueError as e:
            raise BadInput(f"{path}: recommended.arms[{i}]: {e}") from None
    floor = rec.get("accept_floor")
    if floor is not None and (_number(floor, "recommended.accept_floor", path) < 1.0):
        raise BadInput(f"{path}: recommended.accept_floor is {floor}, but an accept floor is tokens per row per SD "
                       f"step, bonus included, so >= 1 (tlt.accept_floor refuses it too): {AGAIN}")
    return threshold, tuple(arms), (float(floor) if floor else None)


def load_prior(path, target, drafter=None) -> Prior:
    """The :class:`Prior` of :func:`save_prior`'s file, refused when it was measured for another model, drafter
    (another architecture or other weights) or machine (its costs and acceptance would mislead the tuner), or when
    a part is missing or not a number: load it into a controller with ``AdaptiveController(config, prior.costs)``
    and ``controller.accept[f].load_state_dict(prior.accept[f])``."""
    d = read_json(path, AGAIN)
    if not isinstance(d, dict) or d.get("format") != PRIOR_FORMAT:
        raise BadInput(f"{path} is not a tuner prior file (format {PRIOR_FORMAT!r}); write one with python -m "
                       "tltlib check --prior FILE")
    missing = [k for k in ("fingerprint", "costs", "accept") if not isinstance(d.get(k), dict)]
    if missing:
        raise BadInput(f"{path} has no {' and no '.join(missing)} (a tuner prior holds the model, drafter and "
                       f"machine it was measured for, their costs and acceptance): {AGAIN}")
    here = _fingerprint(target, drafter, str(target.embed.weight.device))
    for part in ("model", "drafter", "machine"):
        if d["fingerprint"].get(part) != here[part]:
            raise BadInput(f"{path} was measured for another {part} ({d['fingerprint'].get(part)}; this run: "
                           f"{here[part]}): its costs and acceptance would mislead the tuner. Measure afresh for "
                           "this setting: python -m tltlib check --model M --drafter D --prior FILE")
    try:
        costs = MeasuredCosts.from_dict(d["costs"])
        costs.forward(1, 1, 1)                       # a table of the wrong shape fails here, not in the rollout
    except BadInput as e:
        raise BadInput(f"{path}: costs: {e}") from None
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise BadInput(f"{path}: costs are not a measured cost model ({type(e).__name__}: {e}): {AGAIN}") from None
    threshold, arms, floor = _recommended(d.get("recommended") or {}, path)
    return Prior(costs, _accept_states(d["accept"], path), int(threshold), arms, floor)
