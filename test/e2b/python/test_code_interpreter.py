"""E2B's Code Interpreter SDK (e2b-code-interpreter, pinned), unchanged,
against the gateway: the template code-interpreter-v1 is OpenDsec's image
root/code-interpreter, whose server speaks the SDK's protocol on port 49999."""

from __future__ import annotations

import base64
import os
import re
import time
from pathlib import Path

import pytest

from conftest import REPO, missing


@pytest.fixture(scope="module")
def ci_image():
    images = Path(os.environ.get("DSEC_TEST_IMAGE_STORE", REPO / ".cache" / "images"))
    if not (images / "refs" / "root" / "code-interpreter" / "latest").exists():
        missing("root/code-interpreter is not built (make images)")


@pytest.fixture(scope="module")
def ci(ci_image):
    from e2b_code_interpreter import Sandbox

    sb = Sandbox.create(timeout=600)
    yield sb
    try:
        sb.kill()
    except Exception:
        pass


def test_cells_share_state_and_stream_output(ci):
    seen = []
    first = ci.run_code("x = 41\nprint('hello')\nx + 1", on_stdout=lambda m: seen.append(m.line))
    assert first.error is None
    assert first.text == "42"
    assert first.logs.stdout == ["hello\n"]
    assert seen == ["hello\n"]
    assert first.execution_count is not None and first.execution_count >= 1
    second = ci.run_code("x * 2")
    assert second.text == "82"
    assert second.execution_count == first.execution_count + 1


def test_matplotlib_chart_is_a_png(ci):
    ex = ci.run_code(
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3], [3, 1, 2])\n"
        "plt.title('t')\n"
        "plt.show()"
    )
    assert ex.error is None, ex.error
    pngs = [r.png for r in ex.results if r.png]
    assert len(pngs) == 1
    data = base64.b64decode(pngs[0])
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_figures_come_with_their_chart_data(ci):
    # E2B's chart suites (charts/test_*.py): a figure's data in the SDK's
    # Chart types, beside its PNG.
    from e2b_code_interpreter.charts import BarChart, BoxAndWhiskerChart, LineChart, PieChart, ScatterChart, SuperChart

    bar = ci.run_code(
        "import matplotlib.pyplot as plt\n"
        "plt.figure()\n"
        "plt.bar(['A', 'B'], [100, 200], label='Sold')\n"
        "plt.xlabel('Authors'); plt.ylabel('Time (s)'); plt.title('Sales')\n"
        "plt.show()"
    ).results[0]
    assert bar.png and isinstance(bar.chart, BarChart), bar.chart
    assert (bar.chart.title, bar.chart.x_label, bar.chart.y_unit) == ("Sales", "Authors", "s")
    assert [(b.label, b.value, b.group) for b in bar.chart.elements] == [("A", 100, "Sold"), ("B", 200, "Sold")]

    box = ci.run_code(
        "fig, ax = plt.subplots()\n"
        "ax.boxplot([[85, 90, 78, 92, 88], [95, 89, 76, 91, 84, 87]], labels=['A', 'B'], patch_artist=True)\n"
        "plt.show()"
    ).results[0].chart
    assert isinstance(box, BoxAndWhiskerChart), box
    assert [(b.label, b.min, b.first_quartile, b.median, b.third_quartile, b.max, b.outliers) for b in box.elements] == [
        ("A", 78, 85, 88, 90, 92, []),
        ("B", 84, 84.75, 88, 90.5, 95, [76]),
    ]

    several = ci.run_code(
        "import datetime, math\n"
        "fig, axs = plt.subplots(1, 3)\n"
        "fig.suptitle('All')\n"
        "axs[0].plot([datetime.datetime(2023, 9, 1, 0, 0, i) for i in range(10)], [math.sin(i) for i in range(10)], label='sin')\n"
        "axs[0].set_yscale('log')\n"
        "axs[1].scatter([1, 2, 3], [4, 5, 6], label='dots')\n"
        "axs[2].pie([90, 10], labels=['no', 'yes'])\n"
        "plt.show()"
    ).results[0].chart
    assert isinstance(several, SuperChart) and several.title == "All"
    line, dots, pie = several.elements
    assert isinstance(line, LineChart) and line.x_scale == "datetime" and line.y_scale == "log"
    assert line.elements[0].label == "sin" and line.elements[0].points[1][0].startswith("2023-09-01T00:00:01")
    assert isinstance(dots, ScatterChart) and dots.elements[0].points == [(1.0, 4.0), (2.0, 5.0), (3.0, 6.0)]
    assert isinstance(pie, PieChart) and [(w.label, w.angle) for w in pie.elements] == [("no", 324), ("yes", 36)]


def test_exception_is_an_error_with_traceback(ci):
    ex = ci.run_code("def f():\n    return 1 / 0\nf()")
    assert ex.results == []
    assert ex.error is not None
    assert ex.error.name == "ZeroDivisionError"
    assert ex.error.value == "division by zero"
    # IPython's traceback, colours and all, as E2B answers it.
    plain = re.sub(r"\x1b\[[0-9;]*m", "", ex.error.traceback)
    assert "return 1 / 0" in plain and "f()" in plain and plain.rstrip().endswith("ZeroDivisionError: division by zero")


def test_cell_that_never_ends_is_cut_by_its_timeout(ci):
    from e2b import TimeoutException

    ci.run_code("kept = 'still here'")
    started = time.monotonic()
    with pytest.raises(TimeoutException, match="Execution timed out"):
        ci.run_code("import time\nwhile True:\n    time.sleep(0.1)", timeout=3)
    assert time.monotonic() - started < 30
    # The cell was interrupted, not left running: the kernel answers at
    # once and kept its state.
    started = time.monotonic()
    after = ci.run_code("kept")
    assert after.text == "still here"
    assert time.monotonic() - started < 10


def test_env_vars_hold_for_one_cell(ci):
    assert ci.run_code("import os; os.environ.get('DSEC_CI_VAR')", envs={"DSEC_CI_VAR": "set"}).text == "set"
    assert ci.run_code("import os; os.environ.get('DSEC_CI_VAR')").text is None


def test_contexts_bash_list_restart_remove(ci):
    from e2b import NotFoundException

    ctx = ci.create_code_context(language="bash", cwd="/tmp")
    assert ctx.language == "bash" and ctx.cwd == "/tmp"
    out = ci.run_code("pwd; N=7", context=ctx)
    assert out.logs.stdout == ["/tmp\n"]
    assert ci.run_code("echo $((N * 6))", context=ctx).logs.stdout == ["42\n"]
    assert ctx.id in [c.id for c in ci.list_code_contexts()]
    ci.restart_code_context(ctx)
    assert ci.run_code("echo N=$N", context=ctx).logs.stdout == ["N=\n"]
    ci.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in ci.list_code_contexts()]
    with pytest.raises(NotFoundException):
        ci.run_code("echo gone", context=ctx)


def test_javascript_cells_share_state(ci):
    first = ci.run_code("const base = 40\nconsole.log('from node')\nbase + 2", language="js")
    assert first.error is None, first.error
    assert first.text == "42" and first.logs.stdout == ["from node\n"]
    assert ci.run_code("base * 2", language="javascript").text == "80"
    awaited = ci.run_code("await new Promise((r) => setTimeout(() => r(base + 1), 10))", language="js")
    assert awaited.text == "41"
    err = ci.run_code("null.x", language="js").error
    assert err is not None and err.name == "TypeError" and "null" in err.value
    assert ci.run_code("process.env.DSEC_CI_JS", language="js", envs={"DSEC_CI_JS": "on"}).text == "on"
    # Static imports, as E2B's test_js_esm_imports writes them; what they
    # bind stays for later cells.
    imported = ci.run_code("import { readFileSync } from 'fs'\nimport * as path from 'path'\nconsole.log(typeof readFileSync)", language="js")
    assert imported.error is None and imported.logs.stdout == ["function\n"], imported
    assert ci.run_code("path.join('a', 'b')", language="js").text == "a/b"


def test_language_without_a_kernel_is_a_clear_error(ci):
    from e2b import SandboxException

    with pytest.raises(SandboxException, match="language 'java': not available in this sandbox; available: bash, javascript, python, r, typescript"):
        ci.run_code("1", language="java")


def test_r_and_typescript_cells(ci):
    # E2B's default-kernel, cwd and env-var suites for R and TypeScript.
    assert ci.run_code('print("Hello, World!")', language="r").logs.stdout == ['[1] "Hello, World!"\n']
    assert ci.run_code("getwd()", language="r").results[0].text.strip() == '[1] "/home/user"'
    assert ci.run_code("Sys.getenv('DSEC_R')", language="r", envs={"DSEC_R": 'a "quoted" value'}).results[0].text.strip() == '[1] "a \\"quoted\\" value"'
    assert ci.run_code("Sys.getenv('DSEC_R', unset = 'gone')", language="r").results[0].text.strip() == '[1] "gone"'
    ts = ci.run_code("const message: string = 'Hello, World!'; console.log(message)", language="ts")
    assert ts.error is None and ts.logs.stdout == ["Hello, World!\n"], ts
    assert ci.run_code("process.cwd()", language="typescript").text == "/home/user"
    assert ci.run_code("interface P { x: number }\nconst p: P = { x: 2 }\np.x * 21", language="ts").text == "42"


def test_a_string_result_reads_without_its_quotes(ci):
    """As E2B's server: a repr in single quotes loses them (24 tests of
    E2B's suites compare such a text); other reprs stay as they are."""
    assert ci.run_code("'supertest'").text == "supertest"
    assert ci.run_code("\"it's\"").text == "\"it's\""
    assert ci.run_code("['a']").text == "['a']"
    assert ci.run_code("'on'", language="js").text == "on"


def test_default_contexts_and_working_directories(ci):
    """Python and JavaScript contexts exist from the start; kernels run as
    root in /home/user, as in E2B's template, so a context may work in
    /root, and a context's missing directory is made."""
    languages = [c.language for c in ci.list_code_contexts()]
    assert "python" in languages and "javascript" in languages
    cwd = ci.run_code("from pathlib import Path; print(Path.cwd())")
    assert "".join(cwd.logs.stdout).strip() == "/home/user"
    assert ci.run_code("process.cwd()", language="js").text == "/home/user"
    assert ci.run_code("import os; os.getuid()").text == "0"
    in_root = ci.create_code_context(cwd="/root")
    assert ci.run_code("import os; os.getcwd()", context=in_root).text == "/root"
    made = ci.create_code_context(language="python", cwd="/home/user/dsec-ci/new")
    assert made.cwd == "/home/user/dsec-ci/new"
    assert ci.run_code("import os; os.getcwd()", context=made).text == "/home/user/dsec-ci/new"
    for ctx in (in_root, made):
        ci.remove_code_context(ctx)


def test_pandas_frames_and_pil_images(ci):
    """What a data cell expects: a DataFrame comes with its columns as
    Result.data (E2B's test_data), and a PIL image a cell shows or saves is
    a PNG result (E2B's test_images)."""
    frame = ci.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2, 3]})")
    assert frame.error is None, frame.error
    assert frame.results[0].data == {"a": [1, 2, 3]}
    assert "<table" in frame.results[0].html
    # NaN and values JSON has no form for come as pandas writes them.
    odd = ci.run_code("import decimal, math\npd.DataFrame({'n': [1.5, math.nan], 'd': [decimal.Decimal('2.5'), None]})")
    assert odd.error is None, odd.error
    assert odd.logs.stderr == [], odd.logs.stderr
    assert odd.results[0].data == {"n": [1.5, None], "d": ["2.5", None]}, odd.results[0].data
    make = (
        "import numpy\nfrom PIL import Image\n"
        "image = Image.fromarray((numpy.random.rand(16, 16, 3) * 255).astype('uint8')).convert('RGBA')\n"
    )
    for how in ("image.show()", "image.save('/tmp/dsec-ci.png')"):
        ex = ci.run_code(make + how + "\nprint('done')")
        assert ex.error is None, ex.error
        assert ex.logs.stdout == ["done\n"], how
        pngs = [r.png for r in ex.results if r.png]
        assert len(pngs) == 1, how
        assert base64.b64decode(pngs[0])[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_cell_of_a_sandbox_killed_under_it_says_so(ci_image):
    """E2B's test_killed: the /execute stream is cut when the sandbox is
    killed (not left open until a timeout), and the SDK says why."""
    from e2b import TimeoutException
    from e2b_code_interpreter import Sandbox
    import threading

    sb = Sandbox.create(timeout=120)
    timer = threading.Timer(2.0, sb.kill)
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutException, match="sandbox was killed while the request was in progress"):
            sb.run_code("import time; time.sleep(60)")
        assert time.monotonic() - started < 30
    finally:
        timer.cancel()
        try:
            sb.kill()
        except Exception:
            pass
