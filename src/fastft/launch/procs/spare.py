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

    python -c 'from fastft.launch.procs.spare import main; main()'   # the agent (--warm-spares N)
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import threading
from types import TracebackType
from typing import TYPE_CHECKING, NoReturn

from fastft.launch.settings.config import DEFAULT_PREFAULT_MB
from fastft.process.env import CHECKPOINT_DIR, CUDA_DEVICE, PREFAULT_MB, SPARE_RUN_AHEAD
from fastft.process.order import become, tell_ready

if TYPE_CHECKING:
    import torch

__all__ = ["main", "order_line", "run_script", "warm_imports"]


def order_line(env: dict[str, str], argv: list[str]) -> bytes:
    """What the agent writes to a spare's stdin to make it a worker."""
    return (json.dumps({"env": env, "argv": argv}) + "\n").encode()


def warm_imports() -> None:
    """What every worker imports (a spare's and the zygote's warm-up, :mod:`.zygote`)."""
    import torch

    # the first optimizer constructed in a process imports torch._dynamo (~2 s here)
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    import importlib

    import torch.distributed  # noqa: F401

    importlib.import_module("fastft.runtime.api")  # what the worker it becomes imports


def _warm_up() -> None:
    import torch

    from fastft.process import malloc

    warm_imports()

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


def main() -> None:
    # Ctrl-C reaches every process of the terminal's group: an idle spare leaves quietly
    # (its agent stops it); it takes the default handler back when it becomes a worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _warm_up()
    ahead = os.environ.get(SPARE_RUN_AHEAD)
    if ahead:
        argv: list[str] = json.loads(ahead)  # the order comes in await_order()
    else:
        tell_ready()
        line = sys.stdin.buffer.readline()
        if not line:  # the agent closed the pipe: this spare is not needed
            return
        argv = become(line)
    run_script(argv)


def run_script(argv: list[str]) -> NoReturn:
    """Run the worker's script (``python SCRIPT args`` or ``python -m MODULE args``) in
    this process, as ``python`` would, and exit with its status: a zygote's fork or a warm
    spare. With ``--checkpoint-dir``, and while this process has one thread (always, but
    for a spare that ran ahead), its checkpoint writer is forked first: ready when the
    first checkpoint is due (a writer started as a new Python took ~3 s). An error the
    script raises shows the script's frame first (runpy's and fastft's came first)."""
    if os.environ.get(CHECKPOINT_DIR) and threading.active_count() == 1:
        from fastft.runtime.durable.writer import fork_writer

        fork_writer()
    try:
        if len(argv) >= 3 and argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:  # (runpy makes the script sys.modules["__main__"] while it runs: pickle finds it)
            sys.argv = argv[1:]
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[1])))
            runpy.run_path(argv[1], run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # what python prints, from the script's first frame
        tb = _from_the_script(e.__traceback__)
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        sys.exit(1)
    sys.exit(0)


def _from_the_script(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` from the frame after runpy's last: the script's."""
    first, after = tb, None
    while tb is not None:
        if "runpy" in tb.tb_frame.f_code.co_filename:
            after = tb.tb_next
        tb = tb.tb_next
    return after or first


if __name__ == "__main__":
    main()
