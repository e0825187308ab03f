"""The results docs are rendered from their files (tltlib.lab.report): the committed docs equal what their result
files render, a stale table is rendered again, bad markers and missing files are refused naming the fix, and every
relative link of the docs resolves."""
import json

import pytest

from tltlib.cli.app import main
from tltlib.lab import report
from tltlib.lab.report import (
    ReportError,
    Results,
    anchor,
    anchors,
    broken_links,
    render,
    render_docs,
    render_text,
)
from tltlib.lab.report import format as fmt


def test_committed_docs_equal_their_result_files():
    stale = render_docs(check=True)
    assert stale == [], (f"{[str(p) for p in stale]} differ from what their result files render: run "
                         "python -m tltlib report (and edit the renderer in tltlib/lab/report/, not the table)")


def test_every_link_of_the_docs_resolves():
    assert broken_links() == []


def _results(tmp_path, **files):
    folder = tmp_path / "bench" / "results"
    folder.mkdir(parents=True)
    for stem, data in files.items():
        (folder / f"{stem}.json").write_text(json.dumps(data))
    return Results(folder, tmp_path / "docs" / "results.md")


def _count(r):
    return f"rows: {r.json('demo')['rows']}"


def test_a_stale_block_is_rendered_again_and_prose_is_kept(tmp_path):
    r = _results(tmp_path, demo={"rows": 3})
    doc = "intro\n<!-- report: count -->\nrows: 2 (typed by hand)\n<!-- /report -->\nafter, by hand\n"
    out = render_text(doc, r, {"count": _count})
    assert out == "intro\n<!-- report: count -->\nrows: 3\n<!-- /report -->\nafter, by hand\n"
    assert render_text(out, r, {"count": _count}) == out                   # rendering again changes nothing


def test_render_docs_checks_without_writing_and_writes_atomically(tmp_path):
    _results(tmp_path, demo={"rows": 5})
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- report: count -->\nold\n<!-- /report -->\n")
    assert render_docs(tmp_path, ("doc.md",), check=True, renderers={"count": _count}) == [doc]
    assert "old" in doc.read_text()                                          # --check writes nothing
    assert render_docs(tmp_path, ("doc.md",), renderers={"count": _count}) == [doc]
    assert doc.read_text() == "<!-- report: count -->\nrows: 5\n<!-- /report -->\n"
    assert render_docs(tmp_path, ("doc.md",), check=True, renderers={"count": _count}) == []


def test_a_failing_renderer_leaves_every_doc_as_it_was(tmp_path):
    _results(tmp_path, demo={"rows": 5})
    for name in ("a.md", "b.md"):
        (tmp_path / name).write_text("<!-- report: count -->\nold\n<!-- /report -->\n")
    (tmp_path / "b.md").write_text("<!-- report: missing -->\nold\n<!-- /report -->\n")
    with pytest.raises(ReportError, match="no renderer 'missing'"):
        render_docs(tmp_path, ("a.md", "b.md"), renderers={"count": _count})
    assert "old" in (tmp_path / "a.md").read_text()


def test_bad_markers_are_refused_with_their_line(tmp_path):
    r = _results(tmp_path, demo={"rows": 1})
    with pytest.raises(ReportError, match=r"line 2: no renderer 'nope'; known: count"):
        render_text("x\n<!-- report: nope -->\n<!-- /report -->\n", r, {"count": _count})
    with pytest.raises(ReportError, match=r"line 3: '<!-- report: count -->' has no '<!-- /report -->'"):
        render_text("x\n\n<!-- report: count -->\nrows\n", r, {"count": _count})


def test_a_missing_or_broken_results_file_names_the_fix(tmp_path):
    r = _results(tmp_path)
    with pytest.raises(ReportError, match="nothing.json: no such results file; run its bench"):
        r.json("nothing")
    (r.folder / "broken.json").write_text("{not json")
    with pytest.raises(ReportError, match="is not valid JSON .* run its bench again"):
        r.json("broken")


def test_links_are_relative_to_the_doc(tmp_path):
    r = _results(tmp_path)
    assert r.link("x") == "[x.md](../bench/results/x.md)"
    assert Results(r.folder, tmp_path / "README.md").link("x", "file") == "[file](bench/results/x.md)"


def test_anchors_follow_github():
    assert anchor("The paper's results at its scale") == "the-papers-results-at-its-scale"
    assert anchor("SmolLM2-135M on the CPU") == "smollm2-135m-on-the-cpu"
    assert anchor("Notebook 05 (canonical run)") == "notebook-05-canonical-run"
    assert anchor("`tltlib.sim` — the simulator") == "tltlibsim--the-simulator"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_broken_links_are_named(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Real heading\n")
    (tmp_path / "doc.md").write_text("# Top\n[ok](#top) [ok](docs/other.md#real-heading) [web](https://x.org/#y)\n"
                                     "[a](#gone) [b](docs/other.md#gone) [c](docs/missing.png)\n"
                                     "```\n[in a fence](#ignored)\n```\n")
    assert broken_links(tmp_path, ("doc.md",)) == [
        "doc.md: #gone (no heading #gone in doc.md)",
        "doc.md: docs/other.md#gone (no heading #gone in docs/other.md)",
        "doc.md: docs/missing.png (no such file)"]


def test_a_busy_run_is_quoted_against_its_quiet_time_and_a_slow_or_red_one_is_not(tmp_path):
    busy = {"machine": {"cpu": "X", "threads": 2, "torch": "t"}, "markers": "not gpu", "returncode": 0, "busy": 2,
            "load_average": [4.1, 3.0, 2.0], "seconds": 90.0, "quiet_seconds": 60.0, "ratio": 1.5, "limit": 2.0,
            "counts": {"passed": 3}, "summary": "3 passed"}
    r = _results(tmp_path, **{"busy_tests-x": busy})
    assert "| 2 | 4.1 | 3 | 0 | 1 min 0 s | 1 min 30 s | 1.50x |" in report.all_renderers()["busy_suite"](r)
    for name, bad in (("slow", {"seconds": 150.0, "ratio": 2.5}), ("red", {"returncode": 1})):
        r = _results(tmp_path / name, **{"busy_tests-x": {**busy, **bad}})
        with pytest.raises(ReportError, match="records a busy run that failed or took"):
            report.all_renderers()["busy_suite"](r)


def test_every_renderer_is_named_once_and_every_doc_block_has_one():
    names = report.all_renderers()
    assert all(callable(fn) for fn in names.values())
    for doc in report.DOCS:
        used = set(render.OPEN.findall((report.render.ROOT / doc).read_text()))
        assert used <= set(names), f"{doc} names unknown renderers {used - set(names)}"


def test_table_formatting():
    assert fmt.md_table(["a", "b"], [[1, None]]) == "| a | b |\n|---|---|\n| 1 | — |"
    assert (fmt.x(1.234), fmt.pct(0.456), fmt.n(8637.2)) == ("1.23x", "46%", "8,637")
    assert fmt.minutes(25.4) == "25 s" and fmt.minutes(497) == "8 min 17 s"


def test_report_check_command_exits_nonzero_on_a_stale_doc(monkeypatch, capsys):
    monkeypatch.setattr(report, "render_docs", lambda check=False: [render.ROOT / "docs" / "results.md"])
    monkeypatch.setattr(report, "broken_links", lambda: [])
    assert main(["report", "--check"]) == 1
    assert "out of date: docs/results.md; run python -m tltlib report" in capsys.readouterr().err


def test_a_renderer_that_finds_no_key_names_the_doc_line_and_renderer(tmp_path):
    r = _results(tmp_path, demo={"columns": 3})
    with pytest.raises(ReportError, match=r"results.md, line 2: renderer 'count' found no 'rows' in its result files"):
        render_text("x\n<!-- report: count -->\n<!-- /report -->\n", r, {"count": _count})


def test_canonical_runs_are_read_under_the_results_root(tmp_path):
    r = Results(tmp_path / "bench" / "results", tmp_path / "docs" / "results.md", tmp_path)
    with pytest.raises(ReportError, match="no canonical-run metrics; run python -m tltlib run"):
        r.canonical("01_profile_long_tail")
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "01_profile_long_tail.json").write_text(json.dumps(
        {"run": {"notebook": "01_profile_long_tail.ipynb", "seconds": 25.0}, "metrics": {"rollout/len_p50": 7}}))
    assert r.canonical("01_profile_long_tail") == {"rollout/len_p50": 7}
    assert [run["seconds"] for run in r.canonical_runs()] == [25.0]


def test_a_missing_file_names_the_command_that_writes_it(tmp_path):
    r = _results(tmp_path)
    with pytest.raises(ReportError, match="run python -m tltlib bench e2e_grpo"):
        r.json("e2e_grpo-cpu-float32-w2")
    with pytest.raises(ReportError, match="run python -m tltlib simulate --validate"):
        r.json("simulate-validate-cpu")


def test_a_failing_test_suite_is_not_quoted(tmp_path):
    green = {"machine": {"cpu": "X", "threads": 2, "torch": "t"}, "markers": "not gpu", "returncode": 0,
             "seconds": 60.0, "counts": {"passed": 3}, "summary": "3 passed"}
    r = _results(tmp_path, **{"tests-x": green, "tests-y": {**green, "workers": 2}})
    table = report.all_renderers()["test_suite"](r)
    assert "| one process | 3 | 0 | 0 | 1 min 0 s |" in table      # a file from before the workers: one process
    assert "| 2 workers | 3 | 0 | 0 | 1 min 0 s |" in table
    r = _results(tmp_path / "red", **{"tests-x": {**green, "returncode": 1, "counts": {"passed": 2, "failed": 1}}})
    with pytest.raises(ReportError, match="records a failing suite"):
        report.all_renderers()["test_suite"](r)


def test_a_ratio_beside_its_goal_keeps_its_side():
    assert fmt.x_vs(1.0999, 1.1) == "1.0999x" and fmt.x_vs(1.2, 1.1) == "1.20x"


def test_block_verification_counts_the_drafts_accepted_without_the_token_every_step_emits():
    """Tokens per forward are 1 + the drafts kept: the drafts' ratio drops the 1 (2.6 vs 2.5 tokens: 1.6 / 1.5
    drafts), and the goal's line gives both, each with its own verdict."""
    from tltlib.lab.report.decoding import drafts_accepted_ratio
    from tltlib.lab.report.goals import block_verification
    row = {"depth": 4, "tokens_per_forward": {"token": 2.5, "block": 2.6}, "block_over_token": 2.6 / 2.5}
    assert drafts_accepted_ratio(row) == pytest.approx(1.6 / 1.5)

    class Results:
        def json(self, stem):
            return {"results": [row]}
    shown, met = block_verification(Results())
    assert "1.067x drafts accepted" in shown and "1.040x tokens" in shown
    assert met == "drafts accepted yes; tokens no"


def test_a_breakdown_on_huge_pages_shows_the_step_on_4_kib_pages_and_where_the_weights_lay(tmp_path):
    """A breakdown whose loader placed the weights on huge pages: a column with the native step on the 4 KiB-page
    copy and huge pages' speedup, and the share of the weights on them in the caption; a result from before has
    neither."""
    row = {"rows": 1, "step_ms": 20.0, "attention_ms": 1.0, "projections_ms": 15.0, "small_ops_ms": 2.0,
           "outside_ms": 2.0, "floor_ms": 16.0, "step_over_floor": 1.25, "native_step_ms": 19.0,
           "native_over_floor": 1.19}
    before = {"machine": {"cpu": "X", "threads": 2, "torch": "t", "isa": "avx2"}, "bandwidth_gb_s": 30.0,
              "bandwidth_range_gb_s": [28.0, 33.0], "results": [row],
              "settings": {"task": "words", "new_tokens": 64, "repeats": 5}}
    after = {**before, "huge_pages": {"thp": "madvise", "on": True, "weight_bytes": 100,
                                      "weight_bytes_on_huge_pages": 80, "copy_bytes_on_huge_pages": 0},
             "results": [{**row, "small_pages_step_ms": 20.5, "huge_pages_speedup": 1.07}]}
    render_one = report.decoding.decode_breakdown("decode_breakdown-x")
    old = render_one(_results(tmp_path / "before", **{"decode_breakdown-x": before}))
    assert "4 KiB" not in old and "huge pages" not in old
    new = render_one(_results(tmp_path / "after", **{"decode_breakdown-x": after}))
    assert "| 19.00 (1.19x) | 20.50 (1.07x) |" in new and "80% of the weights on huge pages" in new
    assert "measured in each round (median 30.0 GB/s, 28.0-33.0), each step over its own round's floor" in new
    bracketed = {**after, "floor_bracketed": True}                       # the bandwidth read around each step
    bracketed = render_one(_results(tmp_path / "bracketed", **{"decode_breakdown-x": bracketed}))
    assert ("measured just before and just after each step's rollouts (median 30.0 GB/s, 28.0-33.0), each step over "
            "the mean of its two floors") in bracketed and "each round" not in bracketed
