"""The book's helpers, for the notebooks (not part of the library): show the source of what a chapter runs,
build explorers, time a call on a shared machine, and read the committed benchmark results.

The book never pastes code: it imports ``kda_edu`` and shows the source of what it runs. Results of runs the
chapters cannot repeat on a CPU (H200 benchmarks, long sweeps) are committed to ``bench/results/`` of the
repository; ``bench_result`` reads them from the checkout this package was imported from (a clone or an
editable install; the Colab set-up cell clones the repository); a package installed without the repository
gets None.
"""

import inspect
import json
import math
import time
from pathlib import Path

import torch

import kda_edu

_ROOT = Path(kda_edu.__file__).resolve().parent.parent
RESULTS = _ROOT / "bench" / "results"


def bench_result(name: str) -> dict | None:
    """A committed benchmark result, ``bench/results/<name>`` of the repository, or None when it is not there.

    None means the benchmark has not been run yet, or ``kda_edu`` was installed without the repository
    (the Colab set-up cell clones it, so there the results are present).
    """
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def show_source(obj, start: str | None = None, stop: str | None = None):
    """Display the source of a function, class or Triton kernel from ``kda_edu`` with its file and line.

    With ``start`` (and ``stop``), only the lines from the first one containing ``start`` to the first one
    after it containing ``stop`` (both included; to the end without ``stop``): the lines that matter of a
    long kernel. A string that is not in the source raises ``ValueError``, so a listing cannot silently drift.
    Returns an IPython ``Markdown`` object, which a notebook renders as a highlighted code block.
    """
    from IPython.display import Markdown

    obj = getattr(obj, "fn", obj)  # a @triton.jit kernel wraps the Python function it was written as
    lines, start_line = inspect.getsourcelines(obj)
    if start is not None:
        first = next((i for i, line in enumerate(lines) if start in line), None)
        last = (
            len(lines) - 1
            if stop is None
            else next((i for i, line in enumerate(lines) if i >= (first or 0) and stop in line), None)
        )
        if first is None or last is None:
            raise ValueError(f"{obj.__qualname__}: no line contains {start if first is None else stop!r}")
        indent = min(len(line) - len(line.lstrip()) for line in lines[first : last + 1] if line.strip())
        lines, start_line = [line[indent:] for line in lines[first : last + 1]], start_line + first
    path = Path(inspect.getsourcefile(obj)).resolve()
    try:
        shown = path.relative_to(_ROOT)
    except ValueError:
        shown = path.name
    header = f"`{shown}`, line {start_line}"
    return Markdown(f"{header}\n\n```python\n{''.join(lines).rstrip()}\n```")


def explore(function, **controls):
    """An ipywidgets explorer: sliders (or other controls) that re-run ``function`` on change.

    ``controls`` maps each keyword argument of ``function`` to an ipywidgets control or an
    abbreviation (a ``(min, max, step)`` tuple, a list of options). The widget needs a live
    kernel; every chapter also draws the same figure statically for readers of the website, and the
    explorer says so in one line above its controls (on a built page the controls do not redraw).
    """
    import ipywidgets

    print(EXPLORE_NOTICE)
    return ipywidgets.interactive(function, **controls)


EXPLORE_NOTICE = (
    "Interactive: these controls redraw in a running notebook (Jupyter, Colab); on the website they "
    "stay at the saved settings, and the figure above shows the main ones."
)


def glue(name: str, value):
    """Hand ``value`` to the page's text, where ``{glue:text}`name``` (or ``name:.2f``) prints it, and return it.

    The book's build (myst-nb) substitutes the value into the prose, so a number the text quotes is the
    number the cell computed, never typed. Outside the build (Colab, a plain Jupyter) myst-nb is absent and
    the markdown shows the role unrendered; the value is still returned for the cell's own checks.
    """
    try:
        from myst_nb import glue as myst_glue
    except ImportError:
        return value
    myst_glue(name, value, display=False)
    return value


def time_call(fn, *args, repeats: int = 3, threads: int | None = 1, **kwargs) -> float:
    """Seconds `fn(*args, **kwargs)` takes: one warm-up call, then the fastest of `repeats` timed calls.

    The minimum, because on a shared machine other work only ever adds time. On the CPU the call runs on
    `threads` threads (None: leave PyTorch's setting alone) and the clock is this process's CPU time, which
    other programs on the machine do not inflate; with one thread and no waiting it equals the wall time
    on an idle machine. On a GPU the clock is the wall time, with the device synchronised around each call.
    """
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    cuda = any(a.is_cuda for a in tensors)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock = time.perf_counter if cuda else time.process_time
    before = torch.get_num_threads()
    if threads is not None and not cuda:
        torch.set_num_threads(threads)
    try:
        fn(*args, **kwargs)
        best = math.inf
        for _ in range(repeats):
            sync()
            start = clock()
            fn(*args, **kwargs)
            sync()
            best = min(best, clock() - start)
    finally:
        torch.set_num_threads(before)
    return best
