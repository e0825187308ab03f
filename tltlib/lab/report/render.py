"""Rendering the results docs: every block between ``<!-- report: NAME -->`` and ``<!-- /report -->`` in README.md,
docs/results.md, docs/real-models.md, docs/gpu.md and docs/trl.md is written again by the renderer NAME; the prose
around it is left as it is. And the docs' relative links, checked: a file that does not exist or an anchor that is no
heading.

Departures: none (tooling).
"""
from __future__ import annotations

import re
from pathlib import Path

from ...fileio import ROOT, atomic_write_text
from . import check, decoding, goals, grpo, models, rollout, runs, simulator, summary, trl
from .results import ReportError, Results

DOCS = ("README.md", "docs/results.md", "docs/real-models.md", "docs/gpu.md", "docs/trl.md", "docs/trust.md")
"""The docs whose marked blocks are rendered (relative to the project root)."""

BLOCK = re.compile(r"<!-- report: (?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- /report -->", re.S)
OPEN = re.compile(r"<!-- report: ([^>]*?) -->")


def render_text(text: str, results: Results, renderers: dict | None = None) -> str:
    """``text`` (a doc) with every marked block rendered again. An unknown renderer, or a block opened and never
    closed, is refused with its line."""
    renderers = all_renderers() if renderers is None else renderers
    closed = {m.start() for m in BLOCK.finditer(text)}
    for m in OPEN.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        if m.start() not in closed:
            raise ReportError(f"{results.doc.name}, line {line}: '<!-- report: {m.group(1)} -->' has no "
                              "'<!-- /report -->' after it on a line of its own (or its name is not a word)")
        if m.group(1) not in renderers:
            raise ReportError(f"{results.doc.name}, line {line}: no renderer {m.group(1)!r}; known: "
                              f"{', '.join(sorted(renderers))}")

    def block(m: re.Match) -> str:
        name = m.group("name")
        try:
            body = renderers[name](results).rstrip("\n")
        except ReportError as e:
            raise ReportError(f"{results.doc.name}, line {text.count(chr(10), 0, m.start()) + 1}, renderer {name!r}: "
                              f"{e}") from None
        except (KeyError, IndexError, TypeError, StopIteration) as e:    # a file without what the renderer reads
            what = repr(e.args[0]) if isinstance(e, KeyError) and e.args else str(e) or type(e).__name__
            raise ReportError(f"{results.doc.name}, line {text.count(chr(10), 0, m.start()) + 1}: renderer {name!r} "
                              f"found no {what} in its result files: a file from an older bench, or a renderer that "
                              "reads the wrong key (tltlib/lab/report/)") from None
        return f"<!-- report: {name} -->\n{body}\n<!-- /report -->"
    return BLOCK.sub(block, text)


def all_renderers() -> dict:
    """Every renderer a doc can name: each table module's ``RENDERERS``, the goals and the README's rows."""
    out: dict = {}
    for registry in (decoding.RENDERERS, rollout.RENDERERS, grpo.RENDERERS, models.RENDERERS, simulator.RENDERERS,
                     runs.RENDERERS, trl.RENDERERS, check.RENDERERS, goals.RENDERERS, summary.RENDERERS):
        clash = set(out) & set(registry)
        assert not clash, f"renderer names defined twice: {sorted(clash)}"
        out.update(registry)
    return out


LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.M)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]|\[|\]\([^)]*\)", "", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a markdown text (a repeated heading as GitHub numbers it: ``name-1``, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for h in HEADING.findall(FENCE.sub("", text)):
        a = anchor(h)
        out.add(a if a not in seen else f"{a}-{seen[a]}")
        seen[a] = seen.get(a, 0) + 1
    return out


def broken_links(root: Path = ROOT, docs=DOCS) -> list[str]:
    """The relative links of ``docs`` whose file does not exist or whose ``#anchor`` is no heading of it, each as
    ``doc: target``."""
    out = []
    for name in docs:
        path = root / name
        text = FENCE.sub("", path.read_text())
        for m in LINK.finditer(text):
            target = m.group("target")
            if re.match(r"[a-z]+:", target):
                continue                                       # http(s), mailto: not checked here
            file, _, frag = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                out.append(f"{name}: {target} (no such file)")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest.read_text()):
                out.append(f"{name}: {target} (no heading #{frag} in {dest.relative_to(root)})")
    return out


def render_docs(root: Path = ROOT, docs=DOCS, check: bool = False, renderers: dict | None = None) -> list[Path]:
    """Render the marked blocks of ``docs``; returns the docs whose text changed (``check``: that would change; none
    is written). Every doc is rendered before any is written, so a failing renderer leaves them all as they were."""
    out = {}
    results_dir = root / "bench" / "results"
    for name in docs:
        path = root / name
        text = path.read_text()
        new = render_text(text, Results(results_dir, path, root), renderers)
        if new != text:
            out[path] = new
    if not check:
        for path, text in out.items():
            atomic_write_text(path, text)
    return list(out)
