"""One process of a small ``jax.distributed`` job on CPU (Gloo), for the canaries of JAX's
own fault behaviour (``test_jax_canaries.py``): each step all-reduces a vector over the
live devices (``jax_enable_recoverability`` and ``live_devices``, the documented loop).
Writes one JSON line per event to ``--out``:

- ``{"step": s, "n": devices, "t": ...}`` after each step;
- ``{"failed": repr, "step": s, "t": ...}`` when a step raised;
- ``{"reinit_ms": ...}`` for ``--reinit`` (``jax.distributed`` shut down and started again
  in this process).

``--die STEP``: this process ends itself (``os._exit``) before that step;
``--stop STEP``: it stops itself (SIGSTOP) inside that step, before the collective.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.multihost_utils import live_devices  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--heartbeat", type=int, default=2)
    ap.add_argument("--die", type=int, default=-1)
    ap.add_argument("--stop", type=int, default=-1)
    ap.add_argument("--reinit", action="store_true")
    ap.add_argument("--plain", action="store_true", help="without jax_enable_recoverability")
    ap.add_argument("--step-s", type=float, default=0.2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = open(a.out, "a", buffering=1)  # noqa: SIM115 (closed by os._exit)

    def say(**rec: object) -> None:
        out.write(json.dumps({**rec, "t": time.time()}) + "\n")

    jax.config.update("jax_enable_recoverability", not a.plain)

    def start() -> None:
        jax.distributed.initialize(
            a.coordinator,
            num_processes=a.nproc,
            process_id=a.pid,
            heartbeat_timeout_seconds=a.heartbeat,
            initialization_timeout=30,
        )

    start()
    if a.reinit:
        t0 = time.monotonic()
        jax.distributed.shutdown()
        if a.pid:  # (process 0 hosts the service: registering before it restarted it
            time.sleep(2.0)  # could reach the old one, whose end is then fatal)
        start()
        say(reinit_ms=(time.monotonic() - t0) * 1e3, n=len(jax.devices()))

    def total(devices: list, step: int) -> float:
        mesh = Mesh(np.array(devices), ("d",))
        mine = np.full((1, 4), float(step + 1), np.float32)
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), mine)
        if step == a.stop:
            os.kill(os.getpid(), signal.SIGSTOP)
        s = jax.jit(lambda v: jnp.sum(v, axis=0), out_shardings=NamedSharding(mesh, P()))(x)
        return float(np.asarray(s.addressable_data(0))[0])

    step = 0
    while step < a.steps:
        if step == a.die:
            say(died=step)
            os._exit(1)
        try:
            if a.plain:
                devices = jax.devices()
                got = total(devices, step)
            else:
                with live_devices(jax.devices()) as devices:
                    got = total(devices, step)
            say(step=step, n=len(devices), sum=got)
            step += 1
        except Exception as e:  # a peer failed: the step did not happen
            say(failed=repr(e)[:300], step=step)
        time.sleep(a.step_s)
    out.close()
    os._exit(0)  # (jax.distributed's shutdown waits for dead peers)


if __name__ == "__main__":
    main()
