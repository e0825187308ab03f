"""Notebook widgets that a reader can trust: a figure redrawn from its controls when a slider is released (not on
every move), kept as a plain image in the saved notebook (reopened without a kernel, the figure is still there), and
controls whose starting value outside their range is said in the cell instead of crashing it.

Paper: none (teaching). Departures: none.
"""
from __future__ import annotations

from collections.abc import Callable


def _clamped(name: str, value, lo, hi) -> tuple[object, str]:
    """``value`` inside ``[lo, hi]``, and a note when it had to be moved there (empty when not)."""
    if lo <= value <= hi:
        return value, ""
    inside = min(max(value, lo), hi)
    return inside, f"{name} = {value} is outside this slider's range {lo}..{hi}: it starts at {inside}"


def int_slider(name: str, value: int, lo: int, hi: int, step: int = 1):
    """An integer slider for the parameter ``name`` (redraws on release), starting at ``value`` clamped to
    ``[lo, hi]``; returns (slider, note: why it does not start at ``value``, or "")."""
    import ipywidgets as widgets
    start, note = _clamped(name, value, lo, hi)
    return widgets.IntSlider(value=start, min=lo, max=hi, step=step, description=name,
                             continuous_update=False), note


def float_slider(name: str, value: float, lo: float, hi: float, step: float = 0.05):
    """A float slider for the parameter ``name`` (redraws on release): see :func:`int_slider`."""
    import ipywidgets as widgets
    start, note = _clamped(name, value, lo, hi)
    return widgets.FloatSlider(value=start, min=lo, max=hi, step=step, description=name,
                               continuous_update=False, readout_format=".2f"), note


def values_of(controls: dict) -> dict:
    """The controls' current values by name."""
    return {name: c.value for name, c in controls.items()}


def live_figure(draw: Callable[..., object], controls: dict, notes: tuple[str, ...] = ()):
    """Show the controls, then ``draw(**values)``'s figure as an ordinary output (a PNG the saved notebook keeps),
    redrawn in place whenever a control's value changes (sliders: when released). ``notes``: lines shown above the
    controls (e.g. a starting value that was outside a slider's range). Returns the controls' box."""
    import ipywidgets as widgets
    from IPython.display import display
    box = widgets.VBox([*(widgets.HTML(f"<i>{n}</i>") for n in notes if n), widgets.HBox(list(controls.values()))])
    display(box)
    handle = display(render(draw, controls), display_id=True)

    def redraw(_change=None) -> None:
        handle.update(render(draw, controls))

    for c in controls.values():
        c.observe(redraw, names="value")
    return box


def render(draw: Callable[..., object], controls: dict):
    """``draw(**values)``'s figure, closed in pyplot (displayed once, as the handle's image, not again at the cell's
    end)."""
    import matplotlib.pyplot as plt
    fig = draw(**values_of(controls))
    plt.close(fig)
    return fig
