"""Instructions per node run, charged to the issue-19 steps of a node.

Runs ``benchmarks/profile_chain.py`` under callgrind twice (few and many
backward calls, so that building the graph and the first call cancel
out), charges every instruction of the compiled core to the ``.pyx`` line
it was inlined into (``addr2line -i``, outermost frame, then the nearest
``/* "pyengine/....pyx":N`` comment Cython wrote above that C++ line), and
each line to a step of a node's run: the count, the call of ``apply``, the
validation, the dependency decrement, the gradients list, the push, the
pop, ``thread_main``'s loop and ``evaluate_function``'s own. CPython's
and libc's instructions are reported by library.

The tree's compiled modules must carry debug info: in setup.py, ``-g`` for
``-g0`` (the code is the same), then ``python setup.py build_ext
--inplace``. Needs valgrind and binutils; takes about a minute:

    python benchmarks/callgrind_steps.py --tree /path/to/g-build [--lines]

Its output for main is in RESULTS.md, "Issue 19: what each step of a chain
node costs".
"""

from __future__ import annotations

import argparse
import bisect
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run_callgrind(tree, kind, n, calls, out):
    env = dict(os.environ, PYTHONPATH=tree)
    subprocess.run(["valgrind", "--tool=callgrind", "--dump-instr=yes", "--compress-pos=no",
                    "--compress-strings=no", f"--callgrind-out-file={out}",
                    "--collect-atstart=no", "--toggle-collect=*Engine_3execute*",
                    sys.executable, os.path.join(HERE, "profile_chain.py"), "--kind", kind,
                    "--n", str(n), "--calls", str(calls)],
                   cwd=tree, env=env, check=True, capture_output=True)


def self_costs(path):
    """``{(object file, offset): instructions}`` of one callgrind file, self
    cost only (a line after ``calls=`` is a call's inclusive cost)."""
    costs = collections.Counter()
    obj = None
    after_call = False
    with open(path) as profile:
        for line in profile:
            if line.startswith("ob="):
                obj = line[3:].strip()
                continue
            if line.startswith("calls="):
                after_call = True
                continue
            if line.startswith("0x"):
                if after_call:
                    after_call = False
                    continue
                address, _, cost = line.split()[:3]
                costs[(obj, int(address, 16))] += int(cost)
    return costs


class Source:
    """The generated C++ and the .pyx sources of one tree."""

    def __init__(self, tree):
        self.tree = tree
        self.marks = {}
        self.lines = {}

    def pyx_line(self, cpp_file, cpp_line):
        """The ``file.pyx:N`` whose code Cython wrote at ``cpp_file:cpp_line``."""
        if cpp_file not in self.marks:
            marks = []
            try:
                with open(cpp_file) as cpp:
                    for number, text in enumerate(cpp, 1):
                        found = re.search(r'/\* "(pyengine/[\w/]+\.(?:pyx|pxd))":(\d+)', text)
                        if found:
                            marks.append((number, f"{found.group(1)}:{found.group(2)}"))
            except OSError:
                pass
            self.marks[cpp_file] = ([number for number, _ in marks], [key for _, key in marks])
        numbers, keys = self.marks[cpp_file]
        at = bisect.bisect_right(numbers, cpp_line) - 1
        return keys[at] if at >= 0 else f"{os.path.basename(cpp_file)}:{cpp_line}"

    def text(self, key):
        path, _, number = key.rpartition(":")
        if not number.isdigit() or not path.startswith("pyengine/"):
            return ""
        if path not in self.lines:
            try:
                with open(os.path.join(self.tree, path)) as source:
                    self.lines[path] = source.read().splitlines()
            except OSError:
                self.lines[path] = []
        lines = self.lines[path]
        number = int(number)
        return lines[number - 1].strip() if 0 < number <= len(lines) else ""


def attribute(costs, source):
    """``[(instructions, pyx key, outermost function)]`` for the compiled
    core's addresses, through addr2line."""
    by_object = collections.defaultdict(list)
    for (obj, address), cost in costs.items():
        by_object[obj].append((address, cost))
    rows = []
    for obj, items in by_object.items():
        out = subprocess.run(["addr2line", "-a", "-i", "-f", "-C", "-e", obj]
                             + [hex(address) for address, _ in items],
                             capture_output=True, text=True, check=True).stdout.splitlines()
        blocks = []
        for line in out:
            if line.startswith("0x"):
                blocks.append([])
            else:
                blocks[-1].append(line)
        for (_, cost), block in zip(items, blocks):
            function, location = block[-2], block[-1]  # the outermost frame
            path, _, number = location.rpartition(":")
            number = number.split()[0]
            if path == "??" or not number.isdigit():
                raise SystemExit(f"{obj} has no debug info: build it with -g (see this "
                                 "script's docstring)")
            key = (source.pyx_line(path, int(number)) if path.endswith(".cpp")
                   else f"{path}:{number}")
            rows.append((cost, key, function))
    return rows


def step(function, text):
    """The step of a node's run that a line of the compiled core belongs to."""
    def has(*words):
        return any(word in text for word in words)

    if any(name in function for name in ("count_edge", "compute_dependencies",
                                         "count_dependencies")):
        return "count"
    if any(name in function for name in ("single_gradient", "spare_list")):
        return "buffer (the gradients list)"
    if any(name in function for name in ("Engine_route", "on_cpu", "make_record")):
        return "push"
    if any(name in function for name in ("release_record", "push_pop", "pop_record")):
        return "pop"
    if "is_numpy_array" in function:
        return "validate"
    if "profiler" in function or "anomaly_enabled" in function:
        return "thread_main's loop"
    if "call_function" in function:
        if has("gradient_passes_as_is", "only_next_node is None or", "PyList_GET_ITEM(checked"):
            return "validate"
        return "call (the engine's side)"
    if "thread_main" in function:
        if has("next_task_counted = True", "worker.next_task.graph_task ==", "fetch_sub(1)",
               "if not worker.next_task_counted"):
            return "push"
        if has("record", "has_next_task", "local_graph_task = <GraphTask>",
               "while graph_task is None", "keep_spare_list"):
            return "pop"
        return "thread_main's loop"
    if "evaluate_function" in function:
        if has("dependencies_.remove", "not_ready_.find", "task_should_execute", "is_ready = ",
               "remaining < 0", "dependency not found"):
            return "dependency decrement"
        if has("single_gradient", "_input_metadata), next_input_nr"):
            return "buffer (the gradients list)"
        if has("queue_task", "graph_task, next_node, gradients"):
            return "push"
        if has("call_function(", "= node._stream", "node._next_edges", "node._only_next_node",
               "node._only_input_nr", "if producer_stream is None"):
            return "call (the engine's side)"
        if has("lock_mutex", "mutex_.unlock"):
            return "the graph task lock"
        return "evaluate_function's own"
    return "other: " + function[:50]


def library_costs(costs, per_node):
    by_library = collections.Counter()
    for (obj, _), cost in costs.items():
        by_library[os.path.basename(obj or "?")] += cost / per_node
    return by_library


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", default=os.path.dirname(HERE),
                        help="a source tree built in place with -g (default: this one)")
    parser.add_argument("--kind", default="chain", choices=["chain", "wide", "grad-inputs"])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--calls", type=int, nargs=2, default=[3, 23], metavar=("FEW", "MANY"))
    parser.add_argument("--lines", action="store_true", help="also each .pyx line's share")
    args = parser.parse_args(argv)
    for tool in ("valgrind", "addr2line"):
        if shutil.which(tool) is None:
            raise SystemExit(f"needs {tool}")
    tree = os.path.abspath(args.tree)
    few, many = args.calls
    with tempfile.TemporaryDirectory() as scratch:
        paths = [os.path.join(scratch, f"{calls}.cg") for calls in (few, many)]
        for calls, path in zip((few, many), paths):
            run_callgrind(tree, args.kind, args.n, calls, path)
        low, high = self_costs(paths[0]), self_costs(paths[1])
    # One node run more than the graph's nodes: the leaf's AccumulateGrad.
    per_node = (many - few) * (args.n + 1)
    difference = {key: high[key] - low.get(key, 0) for key in high}
    core_prefix = os.path.join(tree, "pyengine") + os.sep
    core = {key: cost for key, cost in difference.items()
            if key[0] and key[0].startswith(core_prefix) and cost}
    libraries = library_costs({key: cost for key, cost in difference.items()
                               if key not in core}, per_node)
    source = Source(tree)
    steps = collections.Counter()
    lines = collections.Counter()
    for cost, key, function in attribute(core, source):
        name = step(function, source.text(key))
        steps[name] += cost / per_node
        lines[(name, key)] += cost / per_node
    total = sum(steps.values()) + sum(libraries.values())
    print(f"{args.kind} {args.n:,}, {few} against {many} calls: {total:,.0f} instructions "
          f"per node run")
    print("\nthe compiled core, by step:")
    for name, cost in steps.most_common():
        if abs(cost) >= 0.5:  # the per-call work left over after the difference
            print(f"{cost:8.1f}  {name}")
    print(f"{sum(steps.values()):8.1f}  in all")
    print("\nother libraries:")
    for name, cost in libraries.most_common():
        if cost >= 0.5:
            print(f"{cost:8.1f}  {name}")
    if args.lines:
        print("\nby line (1.5 or more):")
        for (name, key), cost in sorted(lines.items(), key=lambda item: (item[0][0], -item[1])):
            if cost >= 1.5:
                print(f"{cost:8.1f}  {name:28s} {key:34s} {source.text(key)[:70]}")


if __name__ == "__main__":
    main()
