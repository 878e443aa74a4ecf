"""The data a matplotlib figure draws, as E2B's Code Interpreter SDKs read
it (their Chart types: line, scatter, bar, pie, box_and_whisker, a
superchart of several axes, or unknown) [ours, written from the SDKs'
chart models]. Loaded by the IPython startup script when a figure is
displayed; a figure it cannot read gets no chart, never an error.
"""

import re

_UNIT = re.compile(r"[(\[]([^)\]]+)[)\]]\s*$")


def chart_of(figure):
    try:
        axes = [ax for ax in figure.axes if ax.get_visible() and not hasattr(ax, "_colorbar")]
        if not axes:
            return None
        if len(axes) == 1:
            return _axes_chart(axes[0])
        suptitle = getattr(figure, "_suptitle", None)
        return {
            "type": "superchart",
            "title": (suptitle.get_text() or None) if suptitle is not None else None,
            "elements": [c for c in (_axes_chart(ax) for ax in axes) if c],
        }
    except Exception:  # a chart is extra: the PNG is there regardless
        return None


def _axes_chart(ax):
    from matplotlib.container import BarContainer
    from matplotlib.patches import PathPatch, Wedge
    from matplotlib.collections import PathCollection

    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    wedges = [p for p in ax.patches if isinstance(p, Wedge)]
    boxes = [p for p in ax.patches if isinstance(p, PathPatch)]
    lines = [ln for ln in ax.lines if ln.get_linestyle() not in ("None", "", " ", "none")]
    scatters = [c for c in ax.collections if isinstance(c, PathCollection)]
    title = ax.get_title() or None
    if wedges and len(wedges) == len(ax.patches):
        return {"type": "pie", "title": title, "elements": [_wedge(w) for w in wedges]}
    base = {"title": title, **_labels(ax)}
    if bars:
        return {"type": "bar", **base, "elements": [e for c in bars for e in _bars(ax, c)]}
    if boxes:
        return {"type": "box_and_whisker", **base, "elements": [_box(ax, b) for b in boxes]}
    if lines:
        return {"type": "line", **base, **_scales(ax), "elements": [_line(ax, ln) for ln in lines]}
    if scatters:
        return {"type": "scatter", **base, **_scales(ax), "elements": [_scatter(ax, c) for c in scatters]}
    return {"type": "unknown", "title": title, "elements": []}


def _labels(ax):
    out = {}
    for axis, label in (("x", ax.get_xlabel()), ("y", ax.get_ylabel())):
        unit = _UNIT.search(label or "")
        out[axis + "_label"] = label or None
        out[axis + "_unit"] = unit.group(1).strip() if unit else None
    return out


def _kind(axis):
    """The scale of an axis as the SDKs name it: datetime and categorical
    from the axis' unit converter, else matplotlib's own scale name."""
    import matplotlib.category
    import matplotlib.dates

    converter = axis.get_converter() if hasattr(axis, "get_converter") else axis.converter
    if isinstance(converter, matplotlib.category.StrCategoryConverter):
        return "categorical"
    if isinstance(converter, (matplotlib.dates.DateConverter, matplotlib.dates.ConciseDateConverter)) or type(converter).__name__ == "_SwitchableDateConverter":
        return "datetime"
    return axis.get_scale()


def _value(kind, v):
    """One coordinate as JSON: a date as ISO text, a category as its name,
    a number as a float."""
    import matplotlib.dates

    if kind == "datetime":
        return matplotlib.dates.num2date(float(v)).isoformat()
    if isinstance(v, str):
        return v
    return float(v)


def _ticks(axis, kind):
    ticks = list(axis.get_majorticklocs())
    labels = axis.get_major_formatter().format_ticks(ticks)
    if kind == "categorical":
        return labels, [str(t) for t in labels]
    return [_value(kind, t) for t in ticks], [str(t) for t in labels]


def _scales(ax):
    # The view limits are brought up to date (autoscaled to the data) before
    # the ticks are read, as a draw would.
    ax.get_xlim()
    ax.get_ylim()
    out = {}
    for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
        kind = _kind(axis)
        out[name + "_scale"] = kind
        out[name + "_ticks"], out[name + "_tick_labels"] = _ticks(axis, kind)
    return out


def _coordinates(axis, kind, converted, original):
    if kind == "categorical":
        return [str(v) for v in original]
    return [_value(kind, v) for v in converted]


def _line(ax, line):
    xk, yk = _kind(ax.xaxis), _kind(ax.yaxis)
    xs = _coordinates(ax.xaxis, xk, line.get_xdata(orig=False), line.get_xdata(orig=True))
    ys = _coordinates(ax.yaxis, yk, line.get_ydata(orig=False), line.get_ydata(orig=True))
    return {"label": line.get_label(), "points": [list(p) for p in zip(xs, ys)]}


def _scatter(ax, collection):
    xk, yk = _kind(ax.xaxis), _kind(ax.yaxis)
    points = []
    for x, y in collection.get_offsets():
        points.append([_value(xk, x) if xk != "categorical" else _category(ax.xaxis, x), _value(yk, y) if yk != "categorical" else _category(ax.yaxis, y)])
    return {"label": collection.get_label(), "points": points}


def _category(axis, position):
    """The name a categorical axis gives the position nearest to it."""
    ticks = list(axis.get_majorticklocs())
    if not ticks:
        return str(position)
    names = axis.get_major_formatter().format_ticks(ticks)
    i = min(range(len(ticks)), key=lambda k: abs(ticks[k] - position))
    return str(names[i])


def _group(label):
    return None if not label or label.startswith("_") else label


def _bars(ax, container):
    horizontal = getattr(container, "orientation", "vertical") == "horizontal"
    along = ax.yaxis if horizontal else ax.xaxis
    out = []
    for bar in container.patches:
        if horizontal:
            center, value = bar.get_y() + bar.get_height() / 2, bar.get_width()
        else:
            center, value = bar.get_x() + bar.get_width() / 2, bar.get_height()
        out.append({"label": _category(along, center), "group": _group(container.get_label()), "value": float(value)})
    return out


def _wedge(w):
    return {"label": w.get_label(), "angle": round(abs(w.theta2 - w.theta1), 6), "radius": float(w.r)}


def _box(ax, box):
    """A box of a boxplot drawn with patch_artist: its quartiles from the
    box, its median, whiskers and outliers from the lines at its place."""
    vertices = box.get_path().vertices
    x0, x1 = float(vertices[:, 0].min()), float(vertices[:, 0].max())
    q1, q3 = float(vertices[:, 1].min()), float(vertices[:, 1].max())
    center = (x0 + x1) / 2
    median, low, high, outliers = None, q1, q3, []
    for line in ax.lines:
        xs = [float(v) for v in line.get_xdata(orig=False)]
        ys = [float(v) for v in line.get_ydata(orig=False)]
        if not xs or min(xs) < x0 - 1e-9 or max(xs) > x1 + 1e-9:
            continue
        if line.get_linestyle() in ("None", "", " ", "none"):
            outliers.extend(ys)
        elif len(set(xs)) == 1 and abs(xs[0] - center) < 1e-9:
            low, high = min(low, *ys), max(high, *ys)  # a whisker
        elif len(set(ys)) == 1 and q1 <= ys[0] <= q3 and abs(min(xs) - x0) < 1e-9 and abs(max(xs) - x1) < 1e-9:
            median = ys[0]
    return {
        "label": _category(ax.xaxis, center),
        "min": low,
        "first_quartile": q1,
        "median": median,
        "third_quartile": q3,
        "max": high,
        "outliers": outliers,
    }
