"""A small transformer language model in JAX, trained the way JAX users write it: the
parameters and the optimizer state in the script's own variables (``params, opt_state =
update(params, opt_state, ...)``), an optax chain (gradient clipping, AdamW, a warmup +
cosine schedule). Under ``fastft.jax`` the idiom is safe with one line: read the
committed state from ``ft.state`` at the top of each step (a rollback or a heal changes
it under the script); ``--keep-locals`` leaves that line out, and the in-band replica
check must catch the result at once.

    fastft run --nproc 3 tests/zoo/jax_lm.py --steps 14 --out OUT
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fastft.jax

VOCAB, CONTEXT, D = 32, 12, 32


def init(key: jax.Array) -> dict:
    k = jax.random.split(key, 6)

    def dense(key: jax.Array, n: int, m: int) -> jax.Array:
        return jax.random.normal(key, (n, m), jnp.float32) / np.sqrt(n)

    return {
        "tok": jax.random.normal(k[0], (VOCAB, D), jnp.float32) * 0.1,
        "pos": jnp.zeros((CONTEXT, D), jnp.float32),
        "qkv": dense(k[1], D, 3 * D),
        "out": dense(k[2], D, D),
        "up": dense(k[3], D, 4 * D),
        "down": dense(k[4], 4 * D, D),
        "ln": {"g": jnp.ones(D), "b": jnp.zeros(D)},
        "head": dense(k[5], D, VOCAB),
    }


def norm(p: dict, x: jax.Array) -> jax.Array:
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + 1e-5) * p["g"] + p["b"]


def forward(p: dict, idx: jax.Array) -> jax.Array:
    x = p["tok"][idx] + p["pos"][: idx.shape[1]]
    q, k, v = jnp.split(norm(p["ln"], x) @ p["qkv"], 3, axis=-1)
    att = q @ k.transpose(0, 2, 1) / np.sqrt(D)
    causal = jnp.tril(jnp.ones((idx.shape[1], idx.shape[1]), bool))
    att = jax.nn.softmax(jnp.where(causal, att, -1e9), -1)
    x = x + (att @ v) @ p["out"]
    x = x + jax.nn.gelu(norm(p["ln"], x) @ p["up"]) @ p["down"]
    return norm(p["ln"], x) @ p["head"]


def loss_fn(p: dict, seq: jax.Array) -> jax.Array:
    logits = forward(p, seq[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, seq[:, 1:]).mean()


def batch(step: int, size: int) -> np.ndarray:
    g = np.random.default_rng(7_000 + step)
    start = g.integers(0, VOCAB, (size, 1))
    stride = g.integers(1, 4, (size, 1))
    return ((start + stride * np.arange(CONTEXT + 1)) % VOCAB).astype(np.int32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--keep-locals", action="store_true", help="the unsafe form of the idiom")
    ap.add_argument(
        "--misuse",
        choices=["propose-twice", "no-propose", "float-leaf", "type-error"],
        default=None,
        help="a mistake fastft must refuse at once, saying what to change",
    )
    a = ap.parse_args()
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 4, a.steps)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))
    params = init(jax.random.key(0))
    opt_state = opt.init(params)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn))

    @jax.jit
    def update(params: dict, opt_state: optax.OptState, grads: dict) -> tuple:
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    ft = fastft.jax.init()
    extra = {"scale": 1.0} if a.misuse == "float-leaf" else {}
    ft.register(params=params, opt=opt_state, **extra)
    while ft.step < a.steps:
        with ft.transaction() as tx:
            if not a.keep_locals:  # the committed state: what a rollback or a heal left
                params, opt_state = ft.state["params"], ft.state["opt"]
            seq = batch(tx.step, a.batch)[tx.shard(a.batch)]
            loss, grads = grad_fn(params, seq)
            grads = tx.pmean(grads)
            if a.misuse == "type-error":
                grads = grads + 1  # (a dict plus a number)
            params, opt_state = update(params, opt_state, grads)
            if a.misuse == "propose-twice":
                tx.propose(params=params)
                tx.propose(opt=opt_state)
            elif a.misuse != "no-propose":
                tx.propose(params=params, opt=opt_state)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        for leaf in jax.tree_util.tree_leaves((ft.state["params"], ft.state["opt"])):
            h.update(np.asarray(leaf).tobytes())
        record = {"step": ft.step, "hash": h.hexdigest()[:16], "commits": ft.commits}
        (a.out / f"final-rank{ft.rank}.json").write_text(json.dumps(record))
    ft.close()


if __name__ == "__main__":
    main()
