"""A warm spare: a process the agent starts ahead of time that pays Python's start-up
(``import torch``, the ``torch._dynamo`` import that the first optimizer triggers, fastft
itself) and then waits. When a worker dies, the agent hands the spare the dead worker's
environment and command line on stdin (one JSON line) and the spare becomes that worker,
running the script in-process with ``runpy``: the restart costs the script's own set-up
and the heal, not the interpreter's start. On a GPU machine the spare also creates the
CUDA context of the GPU the agent assigns it and runs one small step there
(``FASTFT_SPARE_CUDA_DEVICE``), so that a worker on that GPU does not pay it either.

With ``--spare-run-ahead`` the spare goes further: it runs the script at once, up to its
``fastft.init()`` (or ``ManagerFFT(...)``), which waits for the order. What the script does
before that (building the model, the optimizer, a dataset) is then off the recovery path.
The script must not need its rank, or anything else the launcher sets per worker, before
``fastft.init()``: a spare runs that part before it knows which worker it will be.

    python -c 'from fastft.launch.spare import main; main()'   # the agent (--warm-spares N)
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from typing import TYPE_CHECKING

from fastft.runtime.contract import SPARE_RUN_AHEAD

if TYPE_CHECKING:
    import torch

__all__ = ["await_order", "main", "order_line"]


def order_line(env: dict[str, str], argv: list[str]) -> bytes:
    """What the agent writes to a spare's stdin to make it a worker."""
    return (json.dumps({"env": env, "argv": argv}) + "\n").encode()


CUDA_DEVICE = "FASTFT_SPARE_CUDA_DEVICE"
"""Set by the agent: the GPU whose CUDA context the spare creates ahead of time."""
READY_FD = "FASTFT_SPARE_READY_FD"
"""Set by the agent: a pipe the spare writes one byte to once it is warm (waiting for its
order), so that the agent knows which spares are ready (``spare_ready`` event)."""
PREFAULT_MB = "FASTFT_SPARE_PREFAULT_MB"
"""Set by the agent: MiB of heap memory the spare touches ahead of time
(:func:`fastft.runtime.malloc.prefault`); 0: none."""
DEFAULT_PREFAULT_MB = 0
"""Off by default: it makes a spare ready later (the touching is part of its warm-up) and,
on the VM this was measured on, 3 spares touching 192 MiB each slowed the demo's steps
from ~11 to ~14.5 ms (cause not isolated). It pays for large CPU-resident states: the
4.2M model's heal went from 39-43 to 20-30 ms."""


def _warm_up() -> None:
    import torch

    # the first optimizer constructed in a process imports torch._dynamo (~2 s here)
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    import torch.distributed  # noqa: F401

    import fastft.runtime  # noqa: F401
    from fastft.runtime import malloc

    # the worker it becomes faults in its model, gradients and healed state on the
    # recovery path otherwise; the thresholds are the ones fastft.init() sets anyway
    malloc.prefault(int(os.environ.get(PREFAULT_MB, DEFAULT_PREFAULT_MB)) << 20)
    if os.environ.get(CUDA_DEVICE):  # pragma: no cover - GPU machines only
        _warm_cuda(torch.device("cuda", int(os.environ[CUDA_DEVICE])))


def _warm_cuda(dev: torch.device) -> None:  # pragma: no cover - GPU machines only
    """What a worker's first GPU step pays once per process (measured on an H100: the
    context ~0.4 s, the first forward/backward ~0.3 s for cuBLAS and lazily loaded
    kernels): a context on ``dev``, made the current device, and one step of a small MLP
    with Adam on it."""
    import torch
    from torch import nn

    torch.cuda.set_device(dev)
    with torch.random.fork_rng(devices=[dev]):  # the worker's random streams stay untouched
        model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).to(dev)
        opt = torch.optim.Adam(model.parameters())
        x = torch.randn(4, 16, device=dev)
        nn.functional.mse_loss(model(x), torch.zeros(4, 1, device=dev)).backward()
        opt.step()
    torch.cuda.synchronize(dev)


def _tell_ready() -> None:
    """Tell the agent this spare is warm (once; without a pipe, nothing)."""
    fd = os.environ.pop(READY_FD, None)
    if fd is None:
        return
    try:
        os.write(int(fd), b"r")
        os.close(int(fd))
    except (OSError, ValueError):
        pass  # an agent that is gone or did not ask: the order still comes on stdin


def _become(line: bytes) -> list[str]:
    """Take the agent's order: the worker's environment (all of it), stdin like a fresh
    worker's; returns the worker's command line."""
    order = json.loads(line)
    os.environ.clear()
    os.environ.update(order["env"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the worker's stdin, like a fresh one
    return list(order["argv"])


ran_ahead = False
"""Set once this process, a warm spare that ran the script ahead, took its order."""


def await_order() -> None:
    """In a spare that runs ahead: wait here for the agent's order and become the worker it
    names. ``fastft.init()`` and ``ManagerFFT`` call it first; anywhere else (a worker, a
    spare that took its order) it returns at once. A spare the agent no longer needs (its
    pipe closed) ends here, without running the rest of the script."""
    if SPARE_RUN_AHEAD not in os.environ:
        return
    _tell_ready()  # the script's set-up before fastft.init() is done
    line = sys.stdin.buffer.readline()
    if not line:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    _become(line)
    global ran_ahead
    ran_ahead = True


def main() -> None:
    _warm_up()
    ahead = os.environ.get(SPARE_RUN_AHEAD)
    if ahead:
        argv: list[str] = json.loads(ahead)  # the order comes in await_order()
    else:
        _tell_ready()
        line = sys.stdin.buffer.readline()
        if not line:  # the agent closed the pipe: this spare is not needed
            return
        argv = _become(line)
    if len(argv) >= 3 and argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[1:]
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[1])))
        runpy.run_path(argv[1], run_name="__main__")


if __name__ == "__main__":
    main()
