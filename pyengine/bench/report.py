"""The report of ``python -m pyengine bench``: its tables, its goals and its plot,
made from the results the runner collected (plain dicts, as ``--json`` writes
them).

Every figure is the median (min-max) of one run's samples; every ratio is
a time divided by the time of the row's baseline in the same run, so above
1 means slower than the baseline.
"""

from __future__ import annotations

import statistics

from . import lookups
from .subjects import SUBJECTS
from .workload import size_label

GOAL_CHAIN_100K_US = 0.3
GOAL_WIDE_US = 0.4
GOAL_FIXED_US = 3.0
# Issue 19's goals: the engine's cost against the floor of calling every
# apply alone, grad(inputs=) against backward at every size, the fixed cost
# of the public calls, and the per-node cost at 1M against 10k.
GOAL_FLOOR_RATIO = 2.0
GOAL_GRAD_INPUTS_RATIO = 1.3
GOAL_BACKWARD_FIXED_US = 2.5
GOAL_GRAD_FIXED_US = 3.5
GOAL_SCALING = 1.2
GOAL_DEZERO_CHAIN = 2.0
GOAL_DEZERO_WIDE = 5.0
# Issue 18: DeZero's training step on pyengine at least as fast as on its own.
GOAL_DEZERO_STEP = 1.0
GOAL_MICROGRAD = 1.0


def stats(entry):
    """``{"median", "min", "max"}`` of a workload's samples, or None."""
    if not entry or "error" in entry or not entry.get("samples"):
        return None
    samples = entry["samples"]
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def entry_of(results, subject, key):
    return results["timing"].get(subject, {}).get("workloads", {}).get(key)


def median_of(results, subject, key):
    figure = stats(entry_of(results, subject, key))
    return None if figure is None else figure["median"]


def format_stats(figure) -> str:
    if figure is None:
        return "-"
    median = figure["median"]
    digits = 3 if median < 1 else 2 if median < 10 else 1
    return f"{median:.{digits}f} ({figure['min']:.{digits}f}-{figure['max']:.{digits}f})"


def format_cell(results, subject, key) -> str:
    entry = entry_of(results, subject, key)
    if entry is None:
        return "-"
    if "error" in entry:
        return "FAILED"
    return format_stats(stats(entry))


def format_ratio(results, subject, baseline, key) -> str:
    value, base = median_of(results, subject, key), median_of(results, baseline, key)
    if value is None or not base:
        return "-"
    return f"{value / base:.2f}x" if value / base < 10 else f"{value / base:.0f}x"


def render(headers, rows, markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(headers) + " |",
                 "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|"]
        lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max([len(str(headers[i]))] + [len(str(row[i])) for row in rows])
              for i in range(len(headers))]

    def line(cells):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def heading(text: str, markdown: bool) -> str:
    return f"\n#### {text}\n" if markdown else f"\n{text}\n{'-' * len(text)}"


def _present(results, family):
    return [key for key, subject in SUBJECTS.items()
            if subject.family == family and key in results["timing"]
            and "skipped" not in results["timing"][key]]


def _row_name(results, subjects, key):
    for subject in subjects:
        entry = entry_of(results, subject, key)
        if entry and "name" in entry:
            return entry["name"], entry["nodes"]
    kind, _, size = key.partition(":")
    return f"{kind} {size_label(int(size))}", None


def _comparison(results, subjects, baseline, keys, markdown, ratio_header):
    """One row per workload key: every subject's cell and its ratio to ``baseline``
    (whose column comes first)."""
    subjects = sorted(subjects, key=lambda s: s != baseline)
    headers = ["graph", "nodes"]
    for subject in subjects:
        headers.append(SUBJECTS[subject].label)
        if subject != baseline:
            headers.append(ratio_header)
    rows = []
    for key in keys:
        if all(entry_of(results, s, key) is None for s in subjects):
            continue
        name, nodes = _row_name(results, subjects, key)
        row = [name, "-" if not nodes else f"{nodes:,}"]
        for subject in subjects:
            row.append(format_cell(results, subject, key))
            if subject != baseline:
                row.append(format_ratio(results, subject, baseline, key))
        rows.append(row)
    return render(headers, rows, markdown)


def report(results, markdown=False) -> str:
    """The whole text report (tables, goals, failures)."""
    parts = [results["header"]]
    graph_keys, step_keys, fixed_keys = (results["keys"]["graphs"], results["keys"]["steps"],
                                         results["keys"]["fixed"])
    engines = _present(results, "engine")
    if engines:
        parts.append(heading("Engines on the same graphs: us per node, median (min-max); "
                             "ratio = time / pyengine compiled's", markdown))
        parts.append(_comparison(results, engines, "pyengine", graph_keys, markdown,
                                 "/ compiled"))
    for family in ("DeZero", "micrograd"):
        subjects = _present(results, family)
        if subjects:
            baseline = SUBJECTS[subjects[0]].baseline
            parts.append(heading(f"{family}: native against pyengine, us per node of {family}'s "
                                 "own graph; ratio = native time / time on pyengine", markdown))
            parts.append(_comparison(results, subjects, baseline, graph_keys, markdown,
                                     "native / pyengine"))
    step_rows = []
    for subject in SUBJECTS:
        for key in step_keys:
            entry = entry_of(results, subject, key)
            if entry is None:
                continue
            baseline = SUBJECTS[subject].baseline
            if SUBJECTS[subject].family == "engine":
                baseline = "pyengine"
            step_rows.append([SUBJECTS[subject].label, entry.get("name", key),
                              format_cell(results, subject, key),
                              "-" if subject == baseline else
                              f"{format_ratio(results, subject, baseline, key)} "
                              f"of {SUBJECTS[baseline].label}"])
    if step_rows:
        parts.append(heading("Training step (forward, backward, SGD): ms per step", markdown))
        parts.append(render(["subject", "problem", "ms/step", "ratio"], step_rows, markdown))
    fixed_subjects = [s for s in engines if any(entry_of(results, s, k) for k in fixed_keys)]
    if fixed_subjects:
        parts.append(heading("Fixed cost of one call: us per call; ratio = time / pyengine "
                             "compiled's", markdown))
        parts.append(_comparison(results, fixed_subjects, "pyengine", fixed_keys, markdown,
                                 "/ compiled"))
    if results.get("memory"):
        parts.append(heading("Peak memory of one backward on a chain: bytes per node "
                             "(peak RSS delta)", markdown))
        parts.append(memory_table(results["memory"], markdown))
        own = [m for m in results["memory"] if m["subject"] == "pyengine" and "error" not in m]
        if own:
            largest = max(own, key=lambda m: m["size"])
            parts.append(f"\npyengine compiled's own memory at {largest['size']:,} nodes: "
                         f"{largest['rss_peak'] / largest['nodes']:.0f} bytes/node peak RSS "
                         f"({largest['rss_method']}), {largest['tracemalloc_peak'] / largest['nodes']:.1f} "
                         "bytes/node through Python's allocators (tracemalloc)")
    if results.get("lookups"):
        parts.append(heading(f"Lookups (indexed gradients): {lookups.LOOKUPS} lookups of "
                             f"{lookups.ROWS_PER_LOOKUP:,} rows, (e * e).sum() each; ms per "
                             "backward, median (min-max); peak memory of one backward "
                             "(tracemalloc)", markdown))
        parts.append(render(lookups.LOOKUP_HEADERS, lookups.lookup_rows(results["lookups"]),
                            markdown))
    parts.append(heading("Goals", markdown))
    parts.append(render(["goal", "measured", "status"], goals(results), markdown))
    failures = failure_lines(results)
    if failures:
        parts.append(heading("Failures", markdown))
        parts.extend(f"- {line}" for line in failures)
    return "\n".join(parts) + "\n"


def memory_table(memory, markdown) -> str:
    sizes = sorted({m["size"] for m in memory})
    headers = ["subject"] + [f"chain {size_label(s)}" for s in sizes]
    rows = []
    for subject in SUBJECTS:
        figures = {m["size"]: m for m in memory if m["subject"] == subject}
        if not figures:
            continue
        row = [SUBJECTS[subject].label]
        for size in sizes:
            m = figures.get(size)
            if m is None:
                row.append("-")
            elif "error" in m:
                row.append("FAILED")
            else:
                row.append(f"{m['rss_peak'] / m['nodes']:.0f}")
        rows.append(row)
    return render(headers, rows, markdown)


def goals(results):
    """``[label, measured, status]`` rows: issue 6's engine goals and the
    adapters' goals of issue 5, from this run's medians."""
    rows = []

    def at_most(label, value, limit, unit):
        if value is None:
            rows.append([label, "not measured", "-"])
        else:
            rows.append([label, f"{value:.3f} {unit}", "met" if value <= limit else "MISSED"])

    def speedup(label, native, pyengine, key, limit):
        a, b = median_of(results, native, key), median_of(results, pyengine, key)
        if a is None or b is None:
            rows.append([label, "not measured", "-"])
        else:
            rows.append([label, f"{a / b:.2f}x", "met" if a / b >= limit else "MISSED"])

    if not results["timing"]:  # --lookups-only
        return lookups.lookup_goals(results.get("lookups") or [])
    at_most(f"compiled <= {GOAL_CHAIN_100K_US} us/node, chain 100k",
            median_of(results, "pyengine", "chain:100000"), GOAL_CHAIN_100K_US, "us/node")
    at_most(f"compiled <= {GOAL_WIDE_US} us/node, wide 1000x10",
            median_of(results, "pyengine", "wide:10000"), GOAL_WIDE_US, "us/node")
    at_most(f"fixed cost <= {GOAL_FIXED_US} us (Engine.execute, 1 node)",
            median_of(results, "pyengine", "execute-fixed:1"), GOAL_FIXED_US, "us")
    at_most(f"backward() fixed cost <= {GOAL_BACKWARD_FIXED_US} us (1 node)",
            median_of(results, "pyengine", "backward-fixed:1"), GOAL_BACKWARD_FIXED_US, "us")
    at_most(f"grad() fixed cost <= {GOAL_GRAD_FIXED_US} us (1 node)",
            median_of(results, "pyengine", "grad-fixed:1"), GOAL_GRAD_FIXED_US, "us")

    def ratio_at_most(label, key, reference_key, limit):
        value = median_of(results, "pyengine", key)
        reference = median_of(results, "pyengine", reference_key)
        if value is None or not reference:
            rows.append([label, "not measured", "-"])
        else:
            rows.append([label, f"{value / reference:.2f}x",
                         "met" if value / reference <= limit else "MISSED"])

    ratio_at_most(f"engine cost per node <= {GOAL_FLOOR_RATIO}x calling each apply alone, "
                  "chain 100k", "chain:100000", "apply-floor:100000", GOAL_FLOOR_RATIO)
    for size in (10_000, 100_000, 1_000_000):
        ratio_at_most(f"grad(inputs=) per node <= {GOAL_GRAD_INPUTS_RATIO}x backward, chain "
                      f"{size_label(size)}", f"grad-inputs:{size}", f"chain:{size}",
                      GOAL_GRAD_INPUTS_RATIO)
    small, large = (median_of(results, "pyengine", "chain:10000"),
                    median_of(results, "pyengine", "chain:1000000"))
    label = f"compiled per-node cost at 1M within {GOAL_SCALING}x of 10k (chain)"
    if small and large:
        rows.append([label, f"{large / small:.2f}x",
                     "met" if large / small <= GOAL_SCALING else "MISSED"])
    else:
        rows.append([label, "not measured", "-"])
    speedup(f"DeZero on pyengine >= {GOAL_DEZERO_CHAIN:.0f}x faster, chain 10k", "dezero",
            "dezero-pyengine", "chain:10000", GOAL_DEZERO_CHAIN)
    speedup(f"DeZero on pyengine >= {GOAL_DEZERO_WIDE:.0f}x faster, wide 1000x10", "dezero",
            "dezero-pyengine", "wide:10000", GOAL_DEZERO_WIDE)
    speedup("DeZero on pyengine no slower, MLP step", "dezero", "dezero-pyengine", "mlp-step:0",
            GOAL_DEZERO_STEP)
    speedup("micrograd on pyengine no slower, chain 10k", "micrograd", "micrograd-pyengine",
            "chain:10000", GOAL_MICROGRAD)
    speedup("micrograd on pyengine no slower, MLP step", "micrograd", "micrograd-pyengine",
            "mlp-step:0", GOAL_MICROGRAD)
    if results.get("lookups"):
        rows.extend(lookups.lookup_goals(results["lookups"]))
    return rows


def failure_lines(results):
    lines = []
    for subject, outcome in results["timing"].items():
        label = SUBJECTS[subject].label
        if "error" in outcome:
            lines.append(f"{label}: {outcome['error']}")
        for key, entry in outcome.get("workloads", {}).items():
            if "error" in entry:
                lines.append(f"{label}, {entry.get('name', key)}: {entry['error']}")
    for m in results.get("memory", []):
        if "error" in m:
            lines.append(f"{SUBJECTS[m['subject']].label}, memory at {m['size']:,}: {m['error']}")
    return lines


def skipped_lines(results):
    return [f"{SUBJECTS[s].label}: {outcome['skipped']}"
            for s, outcome in results["timing"].items() if "skipped" in outcome]


# -- the plot ------------------------------------------------------------------------------

STYLES = {"engine": "-", "DeZero": "--", "micrograd": ":"}


def plot(results, path) -> None:
    """Write a PNG: us per node against chain size, and peak memory of one
    backward against chain size, both log-log, one line per subject.

    Raises ImportError (saying what to install) without matplotlib.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError("the plot needs matplotlib: pip install matplotlib "
                          "(or pip install 'pyengine[bench]'), or pass --no-plot") from error
    figure, (time_axes, memory_axes) = plt.subplots(1, 2, figsize=(13, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (key, subject) in enumerate(SUBJECTS.items()):
        style = dict(linestyle=STYLES[subject.family], color=colors[index % len(colors)],
                     marker="o", markersize=4, label=subject.label)
        points = []
        for workload_key, entry in results["timing"].get(key, {}).get("workloads", {}).items():
            figure_stats = stats(entry)
            if workload_key.startswith("chain:") and figure_stats:
                points.append((entry["nodes"], figure_stats))
        if points:
            points.sort(key=lambda p: p[0])
            sizes = [p[0] for p in points]
            medians = [p[1]["median"] for p in points]
            errors = [[p[1]["median"] - p[1]["min"] for p in points],
                      [p[1]["max"] - p[1]["median"] for p in points]]
            time_axes.errorbar(sizes, medians, yerr=errors, capsize=3, **style)
        # A log axis has no zero: a backward that fit in pages the process
        # already had (small graphs) has no point.
        memory = sorted((m["nodes"], m["rss_peak"]) for m in results.get("memory", [])
                        if m["subject"] == key and "error" not in m and m["rss_peak"] > 0)
        if memory:
            memory_axes.plot([m[0] for m in memory], [m[1] / 2**20 for m in memory], **style)
    for axes in (time_axes, memory_axes):
        axes.set_xscale("log")
        axes.set_yscale("log")
        axes.set_xlabel("nodes in the chain")
        axes.grid(True, which="major", alpha=0.4)
    time_axes.set_ylabel("us per node (median; bars: min-max)")
    time_axes.set_title("Backward time per node")
    memory_axes.set_ylabel("MiB (peak RSS during one backward)")
    memory_axes.set_title("Peak memory of one backward")
    handles, labels = time_axes.get_legend_handles_labels()
    if not handles:
        handles, labels = memory_axes.get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=5, fontsize=8, frameon=False)
    figure.suptitle(results["title"], fontsize=10)
    figure.tight_layout(rect=(0, 0.1, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)
