"""What a rollout returns (:class:`RolloutResult`): the responses, their sampling log-probabilities, each response's
finish and the per-iteration timeline the statistics, plots and the tuner read.

Departures: none (data).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class RolloutResult:
    """Responses and traces of one rollout. Sequence ``i`` answers prompt ``i // num_generations``.

    Attributes:
        tokens: ``[N, max_new]`` int64 response ids (EOS included), ``pad_id`` after the end.
        lengths: ``[N]`` response lengths.
        logprobs: ``[N, max_new]`` log-probability of each sampled token under the sampling distribution (0 after
            the end).
        finish_iter, finish_time, truncated: per-sequence trace (decode iteration, seconds since start, cut by
            budget).
        timeline: per decode iteration after the first token: ``time`` (s since start, at its end), ``iter_time``
            (s), ``active`` (rows still generating), ``rows`` (rows in the forward, finished-but-not-compacted
            included), ``strategy`` (name), ``tokens`` (emitted), ``accepted`` (drafts accepted), ``drafted``
            (draft tokens verified), ``draft_s`` / ``verify_s`` (s), ``accept_hist`` (``[iterations, D+1]`` rows by
            number of accepted drafts).
        stats: ``rollout/*`` metrics (see tltlib.metrics.METRICS).
    """

    prompt_ids: list[list[int]]
    num_generations: int
    tokens: torch.Tensor
    lengths: torch.Tensor
    logprobs: torch.Tensor
    finish_iter: np.ndarray
    finish_time: np.ndarray
    truncated: np.ndarray
    timeline: dict[str, np.ndarray]
    stats: dict[str, float]

    @property
    def num_sequences(self) -> int:
        return int(self.lengths.numel())

    def response_ids(self, i: int) -> list[int]:
        return self.tokens[i, : int(self.lengths[i])].tolist()

    def texts(self, tokenizer) -> list[str]:
        """Decoded responses (special tokens dropped)."""
        return [tokenizer.decode(self.response_ids(i), skip_special_tokens=True) for i in range(self.num_sequences)]
