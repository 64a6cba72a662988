"""One process of JAX's own multi-controller job (``jax.distributed`` over Gloo on CPU):
the JAX demo's MLP trained with the gradient's all-reduce inside the jitted step. For
bench/jax.py: the fault-free step (``--mode step``) and, with ``jax_enable_recoverability``,
the survivors' next step after a fault (``--mode recover``, the documentation's
``live_devices`` loop). Writes one JSON line per step to ``--out``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from fastft.demo.train_jax import batch, build, loss_fn  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--mode", choices=["step", "recover"], default="step")
    ap.add_argument("--heartbeat", type=int, default=3)
    ap.add_argument("--fault", default="", help="recover: KIND@STEP for this process")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    recover = a.mode == "recover"
    if recover:
        jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(
        a.coordinator,
        num_processes=a.nproc,
        process_id=a.pid,
        heartbeat_timeout_seconds=a.heartbeat,
        initialization_timeout=60,
    )
    opt = optax.adam(1e-2)
    params = build(a.hidden, 0, a.layers)
    state = opt.init(params)
    out = open(a.out, "a", buffering=1)  # noqa: SIM115 (closed before os._exit)

    def train_step(p, s, x, y):  # the batch sharded over the mesh: XLA all-reduces the grad
        g = jax.grad(loss_fn)(p, x, y)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    compiled: dict[tuple, object] = {}
    placed: dict[str, object] = {}  # the global arrays of the current device set

    def run(devices, step, p, s):
        """One step over ``devices``; ``p``, ``s``: this process's copies of the state, put
        on the mesh only when the device set changes (a fault)."""
        key = tuple(d.id for d in devices)
        mesh = Mesh(np.array(devices), ("d",))
        rep, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
        if key not in compiled:
            compiled[key] = jax.jit(train_step, out_shardings=(rep, rep))
        if placed.get("key") != key:

            def put(v):
                return jax.make_array_from_process_local_data(rep, np.asarray(v))

            placed.update(
                key=key, p=jax.tree_util.tree_map(put, p), s=jax.tree_util.tree_map(put, s)
            )
        x, y = batch(step, 0, a.batch)
        mine = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
        n = len(devices)
        lo, hi = mine[0] * a.batch // n, (mine[0] + 1) * a.batch // n
        gx = jax.make_array_from_process_local_data(shard, x[lo:hi], (a.batch // n * n, 32))
        gy = jax.make_array_from_process_local_data(shard, y[lo:hi], (a.batch // n * n, 1))
        np_, ns = compiled[key](placed["p"], placed["s"], gx, gy)
        jax.block_until_ready(np_)
        placed.update(p=np_, s=ns)  # (a failed step leaves the last good state placed)
        local = jax.tree_util.tree_map(lambda v: v.addressable_data(0), (np_, ns))
        return local

    kind, _, at = a.fault.partition("@")
    step = 0
    from jax.experimental.multihost_utils import live_devices

    while step < a.steps:
        if kind and step == int(at):
            out.write(json.dumps({"fault": kind, "t": time.time(), "step": step}) + "\n")
            if kind == "sigkill":
                os.kill(os.getpid(), 9)
            if kind == "sigstop":
                os.kill(os.getpid(), 19)
            if kind == "exception":
                raise RuntimeError("injected exception")
        t0 = time.time()
        try:
            if recover:
                with live_devices(jax.devices()) as devices:
                    params, state = run(devices, step, params, state)
            else:
                params, state = run(jax.devices(), step, params, state)
        except Exception as e:  # (recover: a peer failed; the step did not happen)
            out.write(json.dumps({"failed": repr(e)[:200], "t": time.time(), "step": step}) + "\n")
            continue
        n = len(devices) if recover else a.nproc
        out.write(
            json.dumps({"step": step, "t": time.time(), "ms": (time.time() - t0) * 1e3, "n": n})
            + "\n"
        )
        step += 1
    out.close()
    sys.stdout.flush()
    os._exit(0)  # (jax.distributed's shutdown waits for the dead peers)


if __name__ == "__main__":
    main()
