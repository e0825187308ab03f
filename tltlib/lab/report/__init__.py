"""The results docs, rendered from their result files so that they cannot drift: every table of docs/results.md,
docs/real-models.md, docs/gpu.md and the README's results is written by ``python -m tltlib report`` from
``bench/results/*.json`` and the canonical runs' ``figures/**/<notebook>.json``, and a test renders them again and
fails when a committed doc differs.

A doc marks each rendered block::

    <!-- report: sd_speed -->
    | batch | ... |          (written by the renderer; edit the renderer, not the table)
    <!-- /report -->

Modules: :mod:`.render` (the markers, the docs, the links), :mod:`.results` (reading result files), :mod:`.format`
(how numbers are written), and one module of renderers per group of results: :mod:`.decoding`, :mod:`.rollout`,
:mod:`.grpo`, :mod:`.models`, :mod:`.simulator`, :mod:`.runs`, :mod:`.goals` and :mod:`.summary` (the README).

Departures: none (tooling).
"""
from .render import DOCS, all_renderers, anchor, anchors, broken_links, render_docs, render_text
from .results import ReportError, Results

__all__ = ["DOCS", "ReportError", "Results", "all_renderers", "anchor", "anchors", "broken_links", "render_docs",
           "render_text"]
