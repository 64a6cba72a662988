"""The JAX demo (and the JAX tests' script): the torch demo's MLP and data in JAX + optax.

Run it under ``fastft run`` (``fastft demo --framework jax`` does): each worker is a
single-controller JAX program; fastft reduces the gradient, decides every step, rolls
back, heals and restarts (:mod:`fastft.jax`). The global batch of step ``s`` comes from
a generator seeded with (seed, s) and is split over the epoch's members by ``tx.shard``,
so a run with faults ends bitwise equal to a fault-free one in a fixed world.

    fastft run --nproc 3 -m fastft.demo.train_jax -- --steps 300 --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fastft.jax


def build(hidden: int, seed: int, layers: int = 2) -> list[dict[str, jax.Array]]:
    """The MLP's parameters: 32 -> hidden (x layers, tanh) -> 1."""
    sizes = [32] + [hidden] * layers + [1]
    keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    out = []
    for k, (n, m) in zip(keys, zip(sizes, sizes[1:], strict=False), strict=True):
        bound = 1.0 / np.sqrt(n)
        kw, kb = jax.random.split(k)
        out.append(
            {
                "w": jax.random.uniform(kw, (n, m), jnp.float32, -bound, bound),
                "b": jax.random.uniform(kb, (m,), jnp.float32, -bound, bound),
            }
        )
    return out


def forward(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params: list[dict[str, jax.Array]], x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((forward(params, x) - y) ** 2)


def batch(step: int, seed: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of ``step``: the same samples whoever is alive."""
    g = np.random.default_rng(seed * 100_003 + step)
    x = g.standard_normal((size, 32), dtype=np.float32)
    y = np.sin(x[:, :1] * 3) + 0.1 * x[:, 1:2]
    return x, y


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=96, help="global batch per step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        help="simulated compute: extra seconds per step for a part of batch/nproc samples",
    )
    ap.add_argument("--out", type=Path, default=None, help="write the final state here")
    a = ap.parse_args(argv)

    ft = fastft.jax.init()  # first: JAX's compilation cache then covers every function
    params = build(a.hidden, a.seed, a.layers)
    opt = optax.adam(a.lr)
    grad_fn = jax.jit(jax.grad(loss_fn))
    update = jax.jit(
        lambda p, s, g: (lambda u, s2: (optax.apply_updates(p, u), s2))(*opt.update(g, s, p))
    )
    ft.register(params=params, opt=opt.init(params))
    while ft.step < a.steps:
        with ft.transaction() as tx:
            x, y = batch(tx.step, a.seed, a.batch)
            mine = tx.shard(a.batch)  # this member's samples of the step's global batch
            grads = grad_fn(ft.state["params"], x[mine], y[mine])
            if a.step_time:
                time.sleep(a.step_time * (mine.stop - mine.start) * ft.config.world_size / a.batch)
            grads = tx.pmean(grads)  # the mean over the epoch, weighed by shares
            p, s = update(ft.state["params"], ft.state["opt"], grads)
            tx.propose(params=p, opt=s)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        final = np.concatenate([np.ravel(v) for v in jax.tree_util.tree_leaves(ft.state["params"])])
        np.save(a.out / f"final-rank{ft.rank}.npy", final)
        (a.out / f"final-rank{ft.rank}.json").write_text(
            json.dumps(
                {
                    "step": ft.step,
                    "digest": ft.digest(),
                    "pid": os.getpid(),
                    "commits": ft.commits,
                    "rollbacks": ft.rollbacks,
                    "loss": float(
                        loss_fn(ft.state["params"], *map(jnp.asarray, batch(0, a.seed, a.batch)))
                    ),
                }
            )
        )
    ft.close()


if __name__ == "__main__":
    main()
