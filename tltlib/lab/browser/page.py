"""What the browser tier does and reads on JupyterLab's page: open a notebook and wait for its kernel, Run All
Cells and wait for the last cell, the errors a reader would see, the first slider moved and its figure compared,
screenshots, the executed copy saved.

Selectors are JupyterLab 4's and ipywidgets 8's (``.jp-CodeCell``, ``.jp-InputArea-prompt``,
``.jp-Notebook-ExecutionIndicator``, ``.widget-slider .noUi-handle``); a change in either shows as a bounded wait
that names what it waited for.

Paper: none (tooling). Departures: none.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from ...errors import Refused, TimedOut
from .config import BrowserConfig, wait
from .server import JupyterLab

_CELLS_JS = """() => [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')].map(c =>
    (c.querySelector('.jp-InputArea-prompt') || {}).textContent || '')"""
_STDERR_JS = """() => [...document.querySelectorAll('.jp-Notebook .jp-Cell')].flatMap((c, i) =>
    [...c.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
        .map(o => [i, o.innerText]))"""
_BROKEN_IMAGES_JS = """() => [...document.querySelectorAll('.jp-Notebook img')]
    .filter(i => i.complete && i.naturalWidth === 0).map(i => i.getAttribute('alt') || i.getAttribute('src'))"""
_WIDGET_ERRORS_JS = """() => [...document.querySelectorAll('.jp-Notebook .jp-OutputArea-output')]
    .map(o => o.innerText).filter(t => /Error displaying widget|model not found/.test(t))"""


def _kernel_idle(page) -> bool:
    """The page shows a kernel (not "No Kernel") whose status is idle."""
    name = page.locator(".jp-NotebookPanel-toolbar .jp-Toolbar-kernelName").first.inner_text().strip()
    idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").count() > 0
    return bool(name) and name != "No Kernel" and idle


def _dialog(page) -> None:
    """Refuse when JupyterLab shows a dialog (a kernel to select, an error): a reader would have to answer it."""
    dialogs = page.locator(".jp-Dialog")
    if dialogs.count():
        raise Refused(f"JupyterLab shows a dialog: {' '.join(dialogs.first.inner_text().split())[:300]}")


def open_notebook(page, lab: JupyterLab, path: str, workspace: str, config: BrowserConfig) -> str:
    """Open the notebook at ``path``; wait (bounded) until its cells are shown, its kernel has started and the page
    shows it idle; the kernel's id."""
    page.goto(lab.url(path, workspace), timeout=config.start_seconds * 1000)
    page.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=config.start_seconds * 1000)

    def started() -> str | None:
        _dialog(page)
        kernel = lab.kernel_of(path)
        state = kernel and lab.api("GET", f"api/kernels/{kernel}").get("execution_state")
        return kernel if state == "idle" and _kernel_idle(page) else None

    return wait(f"the kernel of {path} to start (idle on the server and on the page)", config.start_seconds,
                started)


def run_all(page, path: str, bound: float) -> tuple[float, dict[int, float]]:
    """Run > Run All Cells; wait (at most ``bound`` seconds) until no cell is running or queued and the kernel is
    idle. Returns the wall seconds from the click, and for each code cell (by its index among code cells) the
    seconds from the click until its execution count was seen (polled every 0.25 s)."""
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    item = page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first
    item.wait_for(timeout=10_000)
    t0 = time.perf_counter()
    item.click()
    state = {"seen": False, "running": []}
    done: dict[int, float] = {}

    def finished() -> bool:
        _dialog(page)
        prompts = page.evaluate(_CELLS_JS)
        for i, p in enumerate(prompts):
            if execution_count(p) is not None and i not in done:
                done[i] = round(time.perf_counter() - t0, 1)
        state["running"] = [i for i, p in enumerate(prompts) if "*" in p]
        state["seen"] |= bool(state["running"])
        return (not state["running"] and (state["seen"] or all(execution_count(p) for p in prompts))
                and _kernel_idle(page))

    try:
        wait(f"Run All Cells of {path} to finish", bound, finished)
    except TimedOut as e:
        raise TimedOut(f"{e}: code cells {state['running']} still running or queued; the others finished at "
                       f"{done} s") from None
    return time.perf_counter() - t0, done


def execution_count(prompt: str) -> int | None:
    """The execution count a cell's prompt shows (``[12]:`` -> 12), None where it shows none."""
    inside = prompt.strip().removeprefix("[").removesuffix(":").removesuffix("]").strip()
    return int(inside) if inside.isdigit() else None


def problems(page) -> tuple[list[str], list[str]]:
    """(errors a reader sees in the notebook, other stderr output such as warnings), each as text naming its cell
    (its index among all cells)."""
    errors, stderr = [], []
    for cell, text in page.evaluate(_STDERR_JS):
        short = " ".join(text.split())[:600]
        (errors if "Traceback" in text else stderr).append(f"cell {cell}: {short}")
    not_run = [i for i, p in enumerate(page.evaluate(_CELLS_JS)) if execution_count(p) is None]
    if not_run:
        errors.append(f"code cells {not_run} (counted among code cells) were not executed")
    errors += [f"broken image: {b}" for b in page.evaluate(_BROKEN_IMAGES_JS)]
    errors += [f"widget: {' '.join(t.split())[:200]}" for t in page.evaluate(_WIDGET_ERRORS_JS)]
    return errors, stderr


# ------------------------------------------------------------------------------------------------ the widget
def _figure_src(cell) -> str | None:
    """The data of the last image in the cell's output (the live figure below its controls)."""
    images = cell.locator(".jp-OutputArea-output img")
    return images.last.get_attribute("src") if images.count() else None


def has_slider(notebook: Path) -> bool:
    """Whether a code cell of ``notebook`` makes a slider (``int_slider``/``float_slider`` of
    :mod:`tltlib.lab.widgets`, or an ipywidgets ``...Slider(``): then the browser must show one that redraws."""
    cells = json.loads(notebook.read_text()).get("cells", [])
    code = ["".join(c.get("source", "")) for c in cells if c.get("cell_type") == "code"]
    return any(k in src for src in code for k in ("int_slider(", "float_slider(", "Slider("))


def move_slider(page, out: Path, config: BrowserConfig) -> dict:
    """Move the first slider whose cell shows a figure by one step with the keyboard (right, or left at its
    maximum); wait (bounded) until the figure changes. Screenshots of the page and the cell before and after."""
    cells = page.locator(".jp-Notebook .jp-CodeCell").filter(has=page.locator(".widget-slider")).filter(
        has=page.locator(".jp-OutputArea-output img"))
    if cells.count() == 0:
        return {"slider": None, "changed": False, "expected": True,
                "problem": "the notebook makes a slider, but none with a figure below it is shown"}
    cell = cells.first
    cell.scroll_into_view_if_needed()
    handle = cell.locator(".widget-slider .noUi-handle").first
    name = (cell.locator(".widget-slider .widget-label").first.text_content() or "").strip()
    readout = cell.locator(".widget-slider .widget-readout").first
    before_value, before_src = (readout.text_content() or "").strip(), _figure_src(cell)
    page.screenshot(path=str(out / "widget-before.png"))
    cell.screenshot(path=str(out / "widget-cell-before.png"))
    at_max = handle.get_attribute("aria-valuenow") == handle.get_attribute("aria-valuemax")
    handle.focus()
    page.keyboard.press("ArrowLeft" if at_max else "ArrowRight")
    try:
        wait(f"the figure below slider {name!r} to change", config.redraw_seconds,
             lambda: _figure_src(cell) not in (None, before_src))
        changed, problem = True, ""
    except TimedOut as e:
        changed, problem = False, str(e)
    page.wait_for_timeout(300)                        # the new image painted before the screenshot
    page.screenshot(path=str(out / "widget-after.png"))
    cell.screenshot(path=str(out / "widget-cell-after.png"))
    return {"slider": name, "value_before": before_value, "value_after": (readout.text_content() or "").strip(),
            "changed": changed, "problem": problem, "expected": True}


_SCROLLER_JS = "() => document.querySelector('.jp-NotebookPanel .jp-WindowedPanel-outer').scrollHeight"
_LAST_CELL_JS = """() => Math.max(...[...document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell')]
    .map(c => c.getBoundingClientRect().bottom))"""


def whole_notebook(page, path: Path, config: BrowserConfig, most: int = 30000) -> None:
    """A screenshot of the whole notebook: the viewport grown to the notebook's height (at most ``most`` pixels),
    then restored. Cells off screen are laid out at an estimated height until shown, so the height is measured
    again after each growth (three times at most), and the viewport is cut below the last cell at the end."""
    page.locator(".jp-NotebookPanel .jp-WindowedPanel-outer").evaluate("e => e.scrollTo(0, 0)")
    height = config.height
    for _ in range(3):
        wanted = min(int(page.evaluate(_SCROLLER_JS)) + 150, most)
        if wanted <= height:
            break
        height = wanted
        page.set_viewport_size({"width": config.width, "height": height})
        page.wait_for_timeout(700)
    bottom = int(page.evaluate(_LAST_CELL_JS)) + 60
    if config.height < bottom < height:
        page.set_viewport_size({"width": config.width, "height": bottom})
        page.wait_for_timeout(300)
    page.screenshot(path=str(path))
    page.set_viewport_size({"width": config.width, "height": config.height})


def save(page, config: BrowserConfig) -> None:
    """Save the executed copy (Ctrl+S, as a reader would); wait (bounded) until its tab no longer shows unsaved
    changes."""
    page.keyboard.press("Control+s")
    wait("JupyterLab to save the executed copy", config.start_seconds,
         lambda: page.locator(".lm-TabBar-tab.jp-mod-current.jp-mod-dirty").count() == 0)


def saved_errors(path: Path, seen: list[str]) -> list[str]:
    """The error outputs of the saved copy (``ename: evalue``), for the cells whose traceback the page did not
    already show."""
    if not path.is_file():
        return []
    listed = {e.split(":", 1)[0] for e in seen}
    found = []
    for i, cell in enumerate(json.loads(path.read_text()).get("cells", [])):
        for o in cell.get("outputs", []):
            if o.get("output_type") == "error" and f"cell {i}" not in listed:
                found.append(f"cell {i}: {o.get('ename')}: {o.get('evalue')}")
    return found
