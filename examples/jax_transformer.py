"""A decoder-only transformer language model in JAX under fastft: optax (gradient clipping,
AdamW, a warmup-cosine schedule), dropout keyed by ``tx.key``, and three registered pytrees
(parameters, optimizer state, counters). Written the way docs/jax.md says: ``init()``
first, the state registered as a build (a restarted worker is healed and never builds it),
the committed state read from ``ft.state`` at each step, each member's rows padded to a
fixed count (``tx.shard_padded``: an elastic world's change of size compiles nothing).

    fastft run --nproc 3 examples/jax_transformer.py -- --steps 60
    fastft run --nproc 3 --warm-spares 1 --spare-run-ahead examples/jax_transformer.py
    fastft run --nproc 3 --inject '{"faults": [{"kind": "sigkill", "rank": 1, "at_step": 20}]}' \\
        examples/jax_transformer.py

``--size 4m`` (the default) is 4.2M parameters (5 layers, width 256, 4 heads, context 64,
vocabulary 512); ``--size small`` is the tests' (2 layers, width 32).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fastft.jax

SIZES = {  # layers, width, heads, context, vocabulary
    "4m": (5, 256, 4, 64, 512),
    "small": (2, 32, 2, 16, 64),
}


def init_params(key: jax.Array, layers: int, d: int, context: int, vocab: int) -> dict:
    keys = iter(jax.random.split(key, 2 + 4 * layers))

    def dense(n: int, m: int) -> jax.Array:
        return jax.random.normal(next(keys), (n, m), jnp.float32) / np.sqrt(n)

    def norm() -> dict:
        return {"g": jnp.ones(d), "b": jnp.zeros(d)}

    blocks = [
        {
            "ln1": norm(),
            "qkv": dense(d, 3 * d),
            "out": dense(d, d),
            "ln2": norm(),
            "up": dense(d, 4 * d),
            "down": dense(4 * d, d),
        }
        for _ in range(layers)
    ]
    return {
        "tok": jax.random.normal(next(keys), (vocab, d), jnp.float32) * 0.02,
        "pos": jnp.zeros((context, d), jnp.float32),
        "blocks": blocks,
        "ln": norm(),
        "head": dense(d, vocab),
    }


def layer_norm(p: dict, x: jax.Array) -> jax.Array:
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + 1e-5) * p["g"] + p["b"]


def forward(p: dict, idx: jax.Array, key: jax.Array, heads: int, rate: float) -> jax.Array:
    b, t = idx.shape
    x = p["tok"][idx] + p["pos"][:t]
    causal = jnp.tril(jnp.ones((t, t), bool))
    for i, blk in enumerate(p["blocks"]):
        q, k, v = jnp.split(layer_norm(blk["ln1"], x) @ blk["qkv"], 3, axis=-1)
        q, k, v = (z.reshape(b, t, heads, -1).transpose(0, 2, 1, 3) for z in (q, k, v))
        att = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
        att = jax.nn.softmax(jnp.where(causal, att, -1e9), -1)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, -1) @ blk["out"]
        keep = jax.random.bernoulli(jax.random.fold_in(key, i), 1 - rate, y.shape)
        x = x + jnp.where(keep, y / (1 - rate), 0)
        x = x + jax.nn.gelu(layer_norm(blk["ln2"], x) @ blk["up"]) @ blk["down"]
    return layer_norm(p["ln"], x) @ p["head"]


def batch(step: int, size: int, context: int, vocab: int) -> np.ndarray:
    """The global batch of ``step``: sequences of an arithmetic progression mod ``vocab``
    (learnable), the same whoever is alive."""
    g = np.random.default_rng(11_000 + step)
    start = g.integers(0, vocab, (size, 1))
    stride = g.integers(1, 8, (size, 1))
    return ((start + stride * np.arange(context + 1)) % vocab).astype(np.int32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--size", choices=sorted(SIZES), default="4m")
    ap.add_argument("--batch", type=int, default=6, help="global batch (sequences) per step")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--out", type=Path, default=None, help="write the final state's hash here")
    a = ap.parse_args()
    layers, d, heads, context, vocab = SIZES[a.size]

    ft = fastft.jax.init()  # first: JAX's compilation cache then covers every function
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, max(1, a.steps // 10), a.steps)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))

    def build() -> dict[str, Any]:  # run at a first start; a restarted worker is healed
        params = init_params(jax.random.key(0), layers, d, context, vocab)
        counters = {"tokens": jnp.zeros((), jnp.int32), "loss_sum": jnp.zeros(())}
        return {"params": params, "opt": opt.init(params), "counters": counters}

    ft.register(build)

    def loss_fn(params: dict, seq: jax.Array, weight: jax.Array, key: jax.Array) -> jax.Array:
        logits = forward(params, seq[:, :-1], key, heads, a.dropout)
        per_seq = optax.softmax_cross_entropy_with_integer_labels(logits, seq[:, 1:]).mean(-1)
        return (per_seq * weight).sum() / weight.sum()  # (padding rows weigh 0)

    grad_fn = jax.jit(jax.value_and_grad(loss_fn))

    @jax.jit
    def update(
        params: dict, opt_state: Any, counters: dict, grads: dict, loss: jax.Array, tokens: int
    ) -> tuple:
        updates, opt_state = opt.update(grads, opt_state, params)
        counters = {"tokens": counters["tokens"] + tokens, "loss_sum": counters["loss_sum"] + loss}
        return optax.apply_updates(params, updates), opt_state, counters

    while ft.step < a.steps:
        with ft.transaction() as tx:
            params, opt_state, counters = (ft.state[k] for k in ("params", "opt", "counters"))
            # this member's rows, padded to a fixed count: the same shapes in any world
            rows, weight = tx.shard_padded(a.batch)
            seq = batch(tx.step, a.batch, context, vocab)[rows]
            loss, grads = grad_fn(params, seq, weight, tx.key)
            grads = tx.pmean(grads)  # the mean over the epoch, weighed by shares
            loss = tx.pmean(loss)
            params, opt_state, counters = update(
                params, opt_state, counters, grads, loss, a.batch * context
            )
            tx.propose(params=params, opt=opt_state, counters=counters)
        step, rank, world = tx.step, tx.rank, tx.world  # (read after the block, as scripts do)
        if tx.committed and rank == 0 and step % 20 == 0:
            print(
                f"step {step} of {world} loss {float(loss):.3f} t={ft.elapsed_s:.1f}s", flush=True
            )
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        for leaf in jax.tree_util.tree_leaves(dict(ft.state)):
            h.update(np.asarray(leaf).tobytes())
        record = {"step": ft.step, "hash": h.hexdigest()[:16], "commits": ft.commits}
        (a.out / f"final-rank{ft.rank}.json").write_text(json.dumps(record))
    ft.close()


if __name__ == "__main__":
    main()
