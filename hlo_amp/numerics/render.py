"""Rendering shared by the numerics results: short numbers, standard JSON, the plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hlo_amp.report import matplotlib_figure

if TYPE_CHECKING:
    from hlo_amp.numerics.attribute import Attribution


def short(value: float | None) -> str:
    """A number in a table cell: "-" for none, "0", else three significant digits."""
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return f"{value:.2e}"


def json_number(value: Any) -> Any:
    """inf and NaN as strings, so the JSON is standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_number(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_number(v) for v in value]
    return value


def plot_attribution(attribution: Attribution, path: str | Path, budget: float | None = None
                     ) -> Path:
    """Write a PNG bar chart of the two errors per scope (needs matplotlib)."""
    figure_type = matplotlib_figure("Attribution.plot")
    import matplotlib.ticker

    rows = list(reversed(attribution.scopes))  # worst on top
    positive = [v for row in rows for v in (row.only_low, row.only_f32 or 0.0)
                if v and math.isfinite(v)] + [attribution.error or 1e-7]
    left = 10 ** math.floor(math.log10(min(positive)))  # bars start at a decade
    floor = 1.5 * left  # a zero error is drawn as a stub, visible on the log axis

    def bar(value: float | None) -> float:
        if value is None or value == 0:
            return floor
        return value if math.isfinite(value) else max(positive) * 10

    low = "/".join(attribution.dtypes) or "low"
    fig = figure_type(figsize=(7, 0.45 * len(rows) + 2.2))
    ax = fig.add_subplot()
    y = np.arange(len(rows))
    ax.barh(y + 0.2, [bar(r.only_low) for r in rows], 0.4, label=f"only this scope {low}")
    ax.barh(y - 0.2, [bar(r.only_f32) for r in rows], 0.4, label="only this scope f32")
    ax.axvline(attribution.error, color="k", ls="--", lw=1, label=f"every scope {low}")
    if budget is not None:
        ax.axvline(budget, color="r", ls=":", lw=1, label="budget")
    ax.set_yticks(y, [r.scope for r in rows])
    ax.set_xscale("log")
    ax.set_xlim(left=left)
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # they overlap
    ax.set_xlabel(f"error (max over outputs, scaled; against {attribution.reference})")
    ax.set_title(f"error per scope at depth {attribution.depth}, {attribution.policy}",
                 fontsize=9)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    return out
