"""``python -m tltlib check``: is SD lossless on this model, does it pay on this machine, is the drafter good.

Modules: ``config`` (what is checked and how much), ``lossless`` (greedy identity, χ² of the first tokens, the
response lengths, the log-probs), ``pays`` (measured speed by rows and arm, the recommended threshold and arms, the
tuner prior file), ``drafter`` (top-1 by depth and accept length beside its card), ``run`` (the check, its screen
and JSON report).
"""
from .config import CheckConfig, Verdict
from .drafter import card_numbers
from .run import CheckReport, run_check, screen, write_report

__all__ = ["CheckConfig", "CheckReport", "Verdict", "card_numbers", "run_check", "screen", "write_report"]
