"""A warm spare: a process the agent starts ahead of time that pays Python's start-up
(``import torch``, the ``torch._dynamo`` import that the first optimizer triggers, fastft
itself) and then waits. When a worker dies, the agent hands the spare the dead worker's
environment and command line on stdin (one JSON line) and the spare becomes that worker,
running the script in-process with ``runpy``: the restart costs the script's own set-up
and the heal, not the interpreter's start.

    python -c 'from fastft.launch.spare import main; main()'   # the agent (--warm-spares N)
"""

from __future__ import annotations

import json
import os
import runpy
import sys

__all__ = ["main", "order_line"]


def order_line(env: dict[str, str], argv: list[str]) -> bytes:
    """What the agent writes to a spare's stdin to make it a worker."""
    return (json.dumps({"env": env, "argv": argv}) + "\n").encode()


def _warm_up() -> None:
    import torch

    # the first optimizer constructed in a process imports torch._dynamo (~2 s here)
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    import torch.distributed  # noqa: F401

    import fastft.runtime  # noqa: F401


def main() -> None:
    _warm_up()
    line = sys.stdin.buffer.readline()
    if not line:  # the agent closed the pipe: this spare is not needed
        return
    order = json.loads(line)
    argv: list[str] = order["argv"]
    os.environ.clear()
    os.environ.update(order["env"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the worker's stdin, like a fresh one
    if len(argv) >= 3 and argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[1:]
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[1])))
        runpy.run_path(argv[1], run_name="__main__")


if __name__ == "__main__":
    main()
