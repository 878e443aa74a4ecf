"""IPython startup script of root/code-interpreter [ours].

What E2B's Code Interpreter template adds to a Python kernel, so its SDKs
see the same results:

- an image a cell shows (Image.show) or saves to a file is also displayed,
  so it comes back as a result with a PNG (there is no display to open a
  viewer on);
- a pandas DataFrame also has an "e2b/data" representation, its columns as
  lists (the SDK's Result.data). pandas is imported only when a cell makes
  one, so kernels start as fast as before;
- a matplotlib figure also has an "e2b/chart" representation, the data it
  draws in the shape of the SDKs' Chart (codeinterpreter_charts.py).
"""

import IPython
from IPython.core.formatters import BaseFormatter
from IPython.display import display
from PIL import ImageShow
from PIL.Image import Image
from traitlets import ObjectName, Unicode


class _DisplayViewer(ImageShow.Viewer):
    """The first viewer asked: it displays the image in the cell's output."""

    def show(self, image, **options):
        display(image)
        return 1


ImageShow.register(_DisplayViewer(), order=-1)

_original_save = Image.save


def _save(image, fp, format=None, **params):
    if isinstance(fp, str):
        display(image)
    return _original_save(image, fp, format, **params)


Image.save = _save


class _DataFormatter(BaseFormatter):
    format_type = Unicode("e2b/data")
    print_method = ObjectName("_repr_e2b_data_")
    _return_type = (dict,)


def _columns(frame):
    """The frame's columns as lists of JSON values: pandas' own JSON, so
    NaN is null, dates are ISO strings and anything else is its str."""
    import json

    try:
        split = json.loads(frame.to_json(orient="split", date_format="iso", default_handler=str))
    except Exception:  # no data representation beats a lost result
        return None
    rows = split.get("data", [])
    return {str(name): [row[i] for row in rows] for i, name in enumerate(split.get("columns", []))}


_ip = IPython.get_ipython()
if _ip is not None:
    _data = _DataFormatter(parent=_ip.display_formatter)
    # By name, so pandas loads only when a cell does: pandas 3 names its
    # DataFrame's module "pandas", earlier releases "pandas.core.frame".
    for _module in ("pandas", "pandas.core.frame"):
        _data.for_type_by_name(_module, "DataFrame", _columns)
    _ip.display_formatter.formatters["e2b/data"] = _data

    class _ChartFormatter(BaseFormatter):
        """Formats matplotlib figures by their class, not by a registered
        printer: matplotlib's inline backend removes every formatter's
        printer for Figure when pyplot loads."""

        format_type = Unicode("e2b/chart")
        print_method = ObjectName("_repr_e2b_chart_")
        _return_type = (dict,)

        def __call__(self, obj):
            if not self.enabled:
                return None
            for cls in type(obj).__mro__:
                if cls.__module__ == "matplotlib.figure" and cls.__name__ == "Figure":
                    try:
                        return _chart(obj)
                    except Exception:  # a chart is extra: the PNG is there regardless
                        return None
            return None

    _chart_module = []

    def _chart(figure):
        # Loaded from beside the server (IPYTHONDIR's parent) on the first
        # figure, without adding that directory to the cell's sys.path.
        if not _chart_module:
            import importlib.util
            import os

            path = os.path.join(os.path.dirname(os.environ.get("IPYTHONDIR", "")), "codeinterpreter_charts.py")
            spec = importlib.util.spec_from_file_location("codeinterpreter_charts", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _chart_module.append(module)
        return _chart_module[0].chart_of(figure)

    _charts = _ChartFormatter(parent=_ip.display_formatter)
    _ip.display_formatter.formatters["e2b/chart"] = _charts
