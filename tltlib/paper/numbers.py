"""The TLT paper's numbers this project compares against.

From TLT (ASPLOS '26), its LaTeX source (see ``shared/reference``) — :data:`PAPER`: Table 3
(end-to-end speedup over VeRL by model and nodes of 8 H100), Table 4 (SD speedup by batch size and tokens to verify,
Qwen2.5-32B, TP 4, depth 10, a tree of branch 8: the paper's top-k), Fig. 14 (the 128-request rollout with SD switching
on below 32 running
requests: 2.44x), Table 6 (accept length of the drafter of the target before RL 4.59, adaptive 6.53), Table 7
(Qwen2.5-7B, TP 2, batch 1 on an H100: 242 tok/s plain, 542 with EAGLE), the rollout's ~85% share of a step. The paper
gives Fig. 7's reward curves and Fig. 11's per-model bars only as pictures: no numbers are quoted for them.

Departures: none (numbers).
"""
from __future__ import annotations

PAPER = {
    "table3": {"qwen2.5-7b": {1: 1.21, 2: 1.45, 4: 1.62, 8: 1.76}, "qwen2.5-32b": {1: None, 2: None, 4: 1.83, 8: 2.12}},
    "table3_note": "speedup of TLT over VeRL per RL step; None: out of memory",
    "table4": {1: (3.22, 3.46, 3.56, 3.62), 2: (3.08, 3.28, 3.39, 3.38), 4: (3.01, 3.09, 3.13, 2.98),
               8: (2.73, 2.63, 2.51, 2.27), 16: (2.67, 2.52, 2.24, 1.91), 32: (2.48, 2.23, 1.90, 1.70)},
    "table4_verify": (16, 32, 48, 64),
    "table4_note": "SD speedup over plain decoding, Qwen2.5-32B, TP 4, depth 10, top-k 8; rows: batch size",
    "case_study": {"requests": 128, "threshold": 32, "model": "qwen2.5-32b", "tp": 4, "rollout_speedup": 2.44},
    "table6": {"frozen": 4.59, "adaptive": 6.53},
    "table6_note": "accept length of the drafter trained for the target before RL (frozen) vs the adaptive drafter, "
                   "Qwen2.5-7B after RL",
    "table7": {"plain_tok_s": 242, "eagle_tok_s": 542, "eagle_accept": 6.53},
    "table1": {"accept": 8.66, "depth": 12, "branch": 8, "verify": 64},
    "table1_note": "accept length of the Qwen2.5-32B drafter at depth 12, top-k 8, verifying 64 tokens",
    "rollout_share": 0.85,
}
"""The paper's numbers this project compares against (see the module docstring for their sources)."""

SETTINGS = {"qwen2.5-7b": {"tp": 4, "nodes": (1, 2, 4, 8)}, "qwen2.5-32b": {"tp": 8, "nodes": (1, 2, 4, 8)}}
"""The paper's Table 3 settings: tensor parallelism per model and the node counts."""
