"""fastft.jax's parts in one process: pytrees as tensors and back, the flat gradient
buffer, and the committed state kept by reference (propose, commit, rollback, heal)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from fastft.jax.state import PyTrees, StateMisuse
from fastft.jax.trees import as_tensor, from_tensor, from_tensors, layout_of, split, to_flat
from fastft.runtime.state.registry import StateRegistry


def _tree(scale: float = 1.0) -> dict:
    return {
        "w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) * scale,
        "b": [jnp.ones(3, jnp.bfloat16) * scale, jnp.array(7, jnp.int32)],
    }


def test_a_leaf_leaves_without_a_copy_and_comes_back_as_a_new_array():
    x = jnp.arange(4, dtype=jnp.float32)
    t = as_tensor(x)
    assert t.data_ptr() == x.unsafe_buffer_pointer()  # DLPack: the same buffer
    back = from_tensor(t * 2, x)
    assert back.dtype == x.dtype and back.sharding == x.sharding
    assert np.array_equal(np.asarray(back), [0, 2, 4, 6])


def test_a_heals_leaves_are_placed_in_one_call_as_copies_placed_as_before():
    """(from_tensors: one ``device_put`` that copies, ``may_alias=False``; the receive
    buffer is reused after the load, so a view of it would change under the state.)"""
    cpu = jax.devices("cpu")[0]
    likes = [
        jnp.arange(6.0).reshape(2, 3),
        jnp.zeros((), jnp.int32),
        jnp.ones(4, jnp.bfloat16),
        jax.device_put(jnp.ones(3), cpu),  # committed to its device
    ]
    recv = [torch.randn(2, 3), torch.tensor(7, dtype=torch.int32)]
    recv += [torch.randn(4).to(torch.bfloat16), torch.randn(3)]
    want = [t.clone() for t in recv]
    placed = from_tensors(recv, likes)
    for t in recv:
        t.fill_(0)  # the receive buffer, reused
    for x, w, like in zip(placed, want, likes, strict=True):
        assert x.dtype == like.dtype and x.shape == like.shape
        assert x.committed == like.committed
        got = np.asarray(x.view(jnp.int16) if x.dtype == jnp.bfloat16 else x)
        ref = (w.view(torch.int16) if w.dtype == torch.bfloat16 else w).numpy()
        assert np.array_equal(got, ref)


def test_the_flat_buffer_is_the_tensor_the_collective_writes():
    g = {"a": jnp.ones((2, 2), jnp.float32), "b": jnp.full(3, 2, jnp.bfloat16)}
    leaves, treedef = jax.tree_util.tree_flatten(g)
    flat, t = to_flat(leaves)
    assert t.dtype == torch.float32 and t.numel() == 7  # bfloat16 reduced as float32
    t.mul_(3)  # what an allreduce does in place
    out = jax.tree_util.tree_unflatten(treedef, split(flat, layout_of(leaves)))
    assert out["a"].dtype == jnp.float32 and np.array_equal(
        np.asarray(out["a"]), np.full((2, 2), 3)
    )
    assert out["b"].dtype == jnp.bfloat16 and np.array_equal(
        np.asarray(out["b"], np.float32), [6, 6, 6]
    )
    with pytest.raises(TypeError, match="floating point"):
        to_flat([jnp.array([1, 2], jnp.int32)])


def test_a_proposal_is_adopted_by_a_commit_and_dropped_by_a_rollback():
    s = PyTrees()
    s.add("params", _tree())
    before = s.committed["params"]
    s.propose({"params": _tree(2.0)})
    assert s.committed["params"] is before  # nothing changes before the commit
    s.rollback()
    s.commit()
    assert s.committed["params"] is before  # the rolled-back proposal is gone
    s.propose({"params": _tree(3.0)})
    s.commit()
    assert float(s.committed["params"]["w"][0, 1]) == 3.0


def test_a_proposal_must_keep_the_registered_structure_shapes_and_dtypes():
    s = PyTrees()
    s.add("params", _tree())
    with pytest.raises(StateMisuse, match="no pytree 'opt'"):
        s.propose({"opt": _tree()})
    with pytest.raises(StateMisuse, match="tree structure"):
        s.propose({"params": {"w": _tree()["w"]}})
    bad = _tree()
    bad["w"] = bad["w"].astype(jnp.float16)
    with pytest.raises(StateMisuse, match=r"params\['w'\] is float16"):
        s.propose({"params": bad})


def test_a_donated_committed_buffer_is_refused_with_the_reason():
    s = PyTrees()
    s.add("params", {"w": jnp.ones(4)})
    step = jax.jit(lambda p: jax.tree_util.tree_map(lambda x: x * 2, p), donate_argnums=0)
    new = step(s.committed["params"])
    with pytest.raises(StateMisuse, match="donate"):
        s.propose({"params": new})


def test_the_registry_heals_and_digests_the_pytrees_through_the_wire():
    def registry(scale: float) -> tuple[StateRegistry, PyTrees]:
        r, s = StateRegistry(), PyTrees()
        s.add("params", _tree(scale))
        r.by_reference = s
        return r, s

    sender, _ = registry(5.0)
    receiver, got = registry(1.0)
    assert sender.digest(3) != receiver.digest(3)
    header, wires = sender.pack(3)
    assert b"by_reference" in header and b"pickle" not in header
    copies = [w.clone() for w in wires]  # (what arrives: the receiver's own buffers)
    assert receiver.load_packed(header, copies) == 3
    assert receiver.digest(3) == sender.digest(3)
    assert float(got.committed["params"]["w"][1, 2]) == 25.0
    assert got.committed["params"]["b"][0].dtype == jnp.bfloat16
    # a checkpoint's round trip: the same state dict, as torch.save writes it
    st = sender.state(3)
    assert receiver.load_state(st) == 3 and receiver.digest(3) == sender.digest(3)


def test_a_heal_into_another_layout_is_refused():
    sender, receiver = PyTrees(), PyTrees()
    sender.add("params", {"w": jnp.ones(4)})
    receiver.add("params", {"w": jnp.ones(5)})
    with pytest.raises(ValueError, match="every worker must register the same pytrees"):
        receiver.load_state_dict(sender.state_dict())


def test_a_lost_state_is_nan_until_healed():
    s = PyTrees()
    s.add("params", _tree())
    s.lose()
    leaves = jax.tree_util.tree_leaves(s.committed["params"])
    assert bool(jnp.isnan(leaves[2]).all())  # (w: float32)
    assert int(leaves[1]) == 7  # (an integer leaf has no NaN: kept)


def test_a_typed_prng_key_in_the_state_heals_as_a_key():
    def holder(seed: int) -> StateRegistry:
        r, s = StateRegistry(), PyTrees()
        s.add("train", {"rng": jax.random.key(seed), "w": jnp.ones(3) * seed})
        r.by_reference = s
        return r

    sender, receiver = holder(7), holder(1)
    header, wires = sender.pack(2)
    assert receiver.load_packed(header, [w.clone() for w in wires]) == 2
    got = receiver.by_reference.committed["train"]["rng"]
    assert jnp.issubdtype(got.dtype, jax.dtypes.prng_key)
    assert np.array_equal(jax.random.key_data(got), jax.random.key_data(jax.random.key(7)))
    assert receiver.digest(2) == sender.digest(2)


def _counting_build(calls: list[int], seed: int = 1):
    def build() -> dict:
        traced = isinstance(jnp.zeros(()) + 0, jax.core.Tracer)
        if not traced:  # (jax.eval_shape calls it too, with nothing computed)
            calls.append(seed)
        params = {"w": jnp.ones((2, 3)) * seed, "rng": jax.random.key(seed)}
        return {"params": params, "count": {"n": jnp.asarray(0.0)}}  # (a weakly typed leaf)

    return build


def test_a_build_healed_before_it_runs_never_runs():
    """A restarted worker registers a build and is healed: it never builds (the cost of
    a JAX restart was the script's build, not the heal)."""
    calls: list[int] = []
    sender, receiver = StateRegistry(), StateRegistry()
    sender.by_reference, receiver.by_reference = PyTrees(), PyTrees()
    sender.by_reference.add_build(_counting_build(calls, seed=5))
    assert calls == [] and sender.by_reference.pending  # (traced, not run)
    receiver.by_reference.add_build(_counting_build(calls, seed=1))
    header, wires = sender.pack(4)  # the sender's state is read: it builds now
    assert calls == [5] and not sender.by_reference.pending
    assert receiver.load_packed(header, [w.clone() for w in wires]) == 4
    assert calls == [5] and not receiver.by_reference.pending  # the receiver never built
    got = receiver.by_reference.committed
    assert float(got["params"]["w"][1, 2]) == 5.0
    assert jnp.issubdtype(got["params"]["rng"].dtype, jax.dtypes.prng_key)
    assert got["count"]["n"].weak_type  # (a strongly typed leaf would trace every jit again)
    assert receiver.digest(4) == sender.digest(4)


def test_a_build_runs_once_when_nothing_heals_it_and_must_match_its_trace():
    calls: list[int] = []
    s = PyTrees()
    assert sorted(s.add_build(_counting_build(calls))) == ["count", "params"]
    s.materialize()
    s.materialize()
    assert calls == [1] and float(s.committed["params"]["w"][0, 0]) == 1.0
    shapes = iter([(2,), (3,)])

    def changes() -> dict:
        return {"w": jnp.zeros(next(shapes))}

    s = PyTrees()
    s.add_build(changes)
    with pytest.raises(StateMisuse, match="other shapes or dtypes when run than when traced"):
        s.materialize()
    with pytest.raises(StateMisuse, match="not a dict of pytrees"):
        PyTrees().add_build(lambda: [jnp.ones(2)])


def test_the_health_check_does_not_run_a_build_a_heal_may_replace():
    from fastft.runtime.health import state_damage

    calls: list[int] = []
    r, s = StateRegistry(), PyTrees()
    s.add_build(_counting_build(calls))
    r.by_reference = s
    assert state_damage(r) is None and calls == []


def test_pmean_names_the_leaves_it_cannot_average():
    with pytest.raises(TypeError, match=r"\['count'\] \(int32\) not floating point.*propose it"):
        to_flat([jnp.ones(2), jnp.zeros((), jnp.int32)], ["['w']", "['count']"])


def test_a_padded_shard_has_the_same_shape_in_any_world():
    """``tx.shard_padded``: a fixed count of rows (ceil(n / fewest members)) and a weight
    per row, so a world that shrinks or grows, and a spare's rehearsal, trace nothing new.
    Checked on a rehearsal's transaction (member 0 of the job's world, no runtime)."""
    from fastft.jax.rehearsal import Rehearsal
    from fastft.jax.runtime import JaxRuntime

    for world, rows in ((3, 3), (2, 4)):  # (7 samples: member 0 takes 3 of 3 members, 4 of 2)
        tx = JaxRuntime(None, Rehearsal(world=world, fewest=2)).transaction()
        assert tx.rehearsal and tx.rank == 0 and tx.world == world
        idx, w = tx.shard_padded(7)
        assert idx.shape == w.shape == (4,)
        assert list(idx[:rows]) == list(range(rows)) and w.sum() == rows
        assert set(idx[rows:]) <= {0} and not w[rows:].any()
        # the rehearsal's pmean: its own tree, through the flat buffer
        got = tx.pmean({"g": jnp.ones(3)})
        assert np.array_equal(np.asarray(got["g"]), np.ones(3))
    with pytest.raises(ValueError, match="size must be at least"):
        JaxRuntime(None, Rehearsal(world=2)).transaction().shard_padded(7, size=2)
