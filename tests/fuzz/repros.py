"""Minimal repros of what the fuzz found (issue 15), each run on both cores.

``python tests/fuzz/repros.py [name ...]`` runs each repro in a child
process per core and prints, per core, the exception type it raised (or
``ok`` and what it printed, or the signal that killed it). A repro is fixed
when both cores answer alike and neither crashes; ``test_fuzz.py`` checks
the same classes at random.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

PRELUDE = textwrap.dedent("""
    import numpy as np
    import pyengine
    from pyengine import Edge, Node

    class Leaf:
        def __init__(self):
            self.data = np.ones(2)
            self.grad = None
            self.grad_fn = None
            self.output_nr = 0
            self.requires_grad = True

    class Id(Node):
        def apply(self, grads):
            return [np.ones(2)] * len(self.next_edges)

    META = [((2,), np.float64)]
    x = Leaf()
    acc = pyengine.gradient_edge(x)

    def run(node, **kw):
        return pyengine.get_default_engine().execute([Edge(node, 0)], [np.ones(2)], False, False,
                                                     kw.get("accumulate", True), kw.get("outputs"))
""")

REPROS = {
    # Edge input_nr (owner: validation)
    "edge_nr_minus_1000": """
        a = Id([acc], META)
        b = Id([Edge(a, -1000)], META)
        run(b); print(x.grad)
    """,
    "edge_nr_minus_1": """
        a = Id([acc], META)
        b = Id([Edge(a, -1)], META)
        run(b); print(x.grad)
    """,
    "edge_nr_str": """
        a = Id([acc], META)
        b = Id([Edge(a, "0")], META)
        run(b); print(x.grad)
    """,
    "edge_nr_float": """
        a = Id([acc], META)
        b = Id([Edge(a, 1.5)], META)
        run(b); print(x.grad)
    """,
    "edge_nr_2_63": """
        a = Id([acc], META)
        b = Id([Edge(a, 2**63)], META)
        run(b); print(x.grad)
    """,
    # next_edges changed while a node runs (owner: validation)
    "release_variables_shortens_next_edges": """
        class Shrinks(Id):
            def release_variables(self):
                self.next_edges = ()
        a = Id([acc], META)
        b = Shrinks([Edge(a, 0), acc], META)
        run(b); print(x.grad)
    """,
    "post_hook_shortens_next_edges": """
        a = Id([acc], META)
        b = Id([Edge(a, 0), acc], META)
        def hook(grad_inputs, grad_outputs):
            b.next_edges = ()
        b.register_hook(hook)
        run(b); print(x.grad)
    """,
    # private fields (owner: validation)
    "private_next_edges_object": """
        a = Id([acc], META)
        a._next_edges = (object(),)
        run(a); print(x.grad)
    """,
    "private_next_edges_set_by_release_variables": """
        class Bad(Id):
            def release_variables(self):
                self._next_edges = (object(),)
        a = Id([acc], META)
        b = Bad([Edge(a, 0)], META)
        c = Id([Edge(b, 0), Edge(a, 0)], META)
        run(c); print(x.grad)
    """,
    "private_next_edges_none": """
        a = Id([acc], META)
        a._next_edges = None
        run(a); print(x.grad)
    """,
    "private_next_edges_list": """
        a = Id([acc], META)
        a._next_edges = [acc]
        run(a); print(x.grad)
    """,
    "private_input_metadata_tuple": """
        a = Id([acc], META)
        a._input_metadata = tuple(a._input_metadata)
        run(a); print(x.grad)
    """,
    "private_input_metadata_none": """
        a = Id([acc], META)
        a._input_metadata = None
        run(a); print(x.grad)
    """,
    # cycles (owner: passes)
    "cycle_through_setter": """
        a = Id([acc], META)
        b = Id([Edge(a, 0)], META)
        a.next_edges = (Edge(b, 0), acc)
        run(b); print(x.grad)
    """,
    # owner graphs whose collections change during the walk (owner: passes)
    "owner_graph_set_changes_during_walk": """
        class V:
            def __init__(self, kids=()):
                self._kids, self.grad, self.trigger = set(kids), 0.0, None
            @property
            def kids(self):
                if self.trigger is not None:
                    target, self.trigger = self.trigger, None
                    target._kids.add(V())
                return self._kids
            def back(self):
                pass
        mids = [V([V()]) for _ in range(3)]
        root = V(mids)
        mids[0].trigger = root
        pyengine.execute_owner_graph(root, "kids", "back"); print("ran")
    """,
    # execute(outputs=...) types (owner: validation)
    "execute_outputs_object": """
        a = Id([acc], META)
        print(run(a, accumulate=False, outputs=[object()]))
    """,
    "execute_outputs_none_entry": """
        a = Id([acc], META)
        print(run(a, accumulate=False, outputs=[None]))
    """,
    "execute_outputs_str": """
        a = Id([acc], META)
        print(run(a, accumulate=False, outputs="ab"))
    """,
}


def run(name, core):
    env = dict(os.environ, PYENGINE_PURE="1" if core == "pure" else "0")
    script = PRELUDE + textwrap.dedent(REPROS[name])
    try:
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                timeout=60, env=env, cwd=os.path.dirname(os.path.abspath(__file__)))
    except subprocess.TimeoutExpired:
        return "hang (60 s)"
    if result.returncode < 0:
        return f"CRASH (signal {-result.returncode})"
    if result.returncode != 0:
        last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "?"
        return last[:110]
    return "ok: " + " ".join(result.stdout.split())[:80]


def main(names):
    for name in names or REPROS:
        answers = {core: run(name, core) for core in ("compiled", "pure")}
        compiled, pure = answers["compiled"], answers["pure"]
        same = compiled == pure if compiled.startswith("ok") else compiled.split(":")[0] == pure.split(":")[0]
        flag = "" if same and "CRASH" not in answers["compiled"] else "  <-- differs"
        print(f"{name}{flag}\n  compiled: {answers['compiled']}\n  pure:     {answers['pure']}")


if __name__ == "__main__":
    main(sys.argv[1:])
