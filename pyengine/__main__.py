"""``python -m pyengine <command>``.

Each command is a module with ``add_arguments(parser)`` and ``main(args) ->
exit status``; adding one is one entry in :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS = {
    "bench": ("pyengine.bench",
              "time pyengine against PyTorch, DeZero and micrograd; tables and a plot"),
    "demo": ("pyengine.frontend.demo",
             "train an MLP on two interleaved spirals with the reference frontend"),
    "stress": ("pyengine.stress",
               "randomized stress batches that check gradients, hangs and leaks"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pyengine",
                                     description="pyengine command-line tools")
    commands = parser.add_subparsers(dest="command", title="commands", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = commands.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command)
        command.set_defaults(run=module.main)
        if name == "demo":  # the logic is pyengine/distributed/demo.py's
            command.add_argument("--distributed", action="store_true",
                                 help="train data-parallel on MPI ranks: mpirun -n 4 python -m "
                                 "pyengine demo --distributed (needs pyengine[mpi])")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "distributed", False):
        from pyengine.distributed.demo import main as distributed_demo

        return distributed_demo(args)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
