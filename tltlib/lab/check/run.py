"""``python -m tltlib check``: the three parts on one model, drafter and set of prompts, one screen of verdicts and
a JSON report.

Paper: TLT §4-5 (what a run of TLT relies on). Departures: none (tooling).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from ...errors import BadInput
from ...fileio import atomic_write_text
from ...machine import machine_info
from ...model.sampling import SamplingConfig
from ...spec.strategy import SpecStrategy
from . import lossless
from .config import CheckConfig, Verdict
from .drafter import quality
from .pays import pays

REPORT_FORMAT = "tltlib-check"


@dataclass
class CheckReport:
    """The check's verdicts, what each part measured, its settings and the machine."""

    verdicts: list[Verdict]
    data: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    machine: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def lossless(self) -> bool | None:
        """Whether every losslessness test passed (the check's exit status); None when none ran (``--parts``
        without ``lossless``): never a claim of losslessness that no test made."""
        tests = [v for v in self.verdicts if v.part == "lossless"]
        return all(v.status != "fail" for v in tests) if tests else None

    def to_dict(self) -> dict:
        return {"format": REPORT_FORMAT, "lossless": self.lossless, "seconds": self.seconds,
                "verdicts": [asdict(v) for v in self.verdicts], "data": self.data, "settings": self.settings,
                "machine": self.machine}


def checked_strategy(cfg: CheckConfig, drafter) -> SpecStrategy:
    """The strategy the losslessness tests run: ``cfg.strategy``, else chain-4 with a drafter, ngram-4 without;
    a learned strategy without a drafter is refused."""
    s = SpecStrategy.parse(cfg.strategy or ("chain-4" if drafter is not None else "ngram-4"))
    if s.uses_drafter and drafter is None:
        raise BadInput(f"check: strategy {s.name} drafts with a learned drafter but none was given: pass --drafter "
                       "or a model-free strategy (--strategy ngram-4 or suffix-4-8)")
    return s


def run_check(model, tokenizer, drafter, prompts: list[list[int]], cfg: CheckConfig, card: dict | None = None,
              prior_path=None, log=print, progress: bool = False) -> CheckReport:
    """Run ``cfg.parts`` on ``model`` (and ``drafter``) with ``cfg.prompts`` of the tokenized ``prompts``; the
    tuner prior file is written to ``prior_path`` when given; ``log`` gets a line per finished test (None: quiet);
    ``progress``: bars over the long rollouts."""
    if len(prompts) < cfg.prompts:
        raise BadInput(f"check: {len(prompts)} prompts given but the tests need {cfg.prompts} (--prompts; at least "
                       "4): use a larger dataset or lower --prompts")
    prompts, t0 = list(prompts[: cfg.prompts]), time.perf_counter()
    strategy, say = checked_strategy(cfg, drafter), (log or (lambda _: None))
    verdicts, data = [], {"strategy": strategy.name}

    def add(v: Verdict) -> None:
        verdicts.append(v)
        say(line(v))

    if "lossless" in cfg.parts:
        add(lossless.greedy_identity(model, drafter, prompts, strategy, cfg))
    sampling = SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p, max_new_tokens=cfg.max_new_tokens)
    plain = spec = None
    if "lossless" in cfg.parts or "drafter" in cfg.parts:
        plain, spec = (lossless.rollout(model, drafter, prompts, sampling, s, cfg.length_samples, cfg.seed + k,
                                        progress=progress) for s, k in ((None, 3), (strategy, 4)))
    if "lossless" in cfg.parts:
        rows = [(plain.prompt_ids[i], plain.response_ids(i * cfg.length_samples)) for i in range(len(prompts))]
        contexts = lossless.entropic_contexts(model, rows, sampling, cfg.first_tokens, cfg.windows)
        add(lossless.first_tokens_chi2(model, drafter, contexts, strategy, cfg))
        add(lossless.lengths_test(plain, spec, cfg))
        add(lossless.logprobs_test(model, spec, sampling))
    if "drafter" in cfg.parts and drafter is not None and strategy.uses_drafter:
        vs, data["drafter"] = quality(model, tokenizer, drafter, plain, spec, strategy.name, card or {})
        for v in vs:
            add(v)
    if "pays" in cfg.parts:
        floor = data.get("drafter", {}).get("alarm_floor")
        vs, data["pays"] = pays(model, drafter, prompts, cfg, prior_path, floor)
        for v in vs:
            add(v)
    dtype = str(model.embed.weight.dtype).removeprefix("torch.")
    return CheckReport(verdicts, data, {**cfg.settings(), "dtype": dtype}, machine_info(str(model.embed.weight.device)),
                       time.perf_counter() - t0)


def line(v: Verdict) -> str:
    """One verdict as a screen line."""
    return f"{v.status.upper():4s}  {v.part:8s} {v.name:18s} {v.line}"


def screen(report: CheckReport) -> str:
    """The verdicts, one per line, and the overall result with the dtype it ran in (in a reduced precision, that
    token identity is not expected of it)."""
    out = [line(v) for v in report.verdicts]
    dtype = report.settings.get("dtype", "?")
    verdict = {True: "lossless: every test passed", False: "NOT LOSSLESS: a test above failed",
               None: "lossless: not tested (--parts without lossless)"}[report.lossless]
    where = report.machine.get("cpu") or report.machine.get("gpu") or "?"
    out.append(verdict + f" ({report.seconds:.0f} s on {where}, {dtype})")
    if dtype in ("bfloat16", "float16"):
        out.append(f"note: in {dtype} the verify and decode forwards round differently, so token identity is not "
                   "expected: a greedy or χ² failure may be rounding, not a loss; --dtype float32 (the default) "
                   "tests losslessness")
    return "\n".join(out)


def write_report(report: CheckReport, path) -> None:
    """The report as JSON at ``path`` (atomically)."""
    atomic_write_text(path, json.dumps(report.to_dict(), indent=1, default=float) + "\n")
