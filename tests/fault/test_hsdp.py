"""Shard groups (issue 22), real processes: 2 replica groups x 2 shards (FSDP2 on Gloo),
per-step sync, fixed world. A SIGKILL, an exception or a SIGSTOP of one shard rank takes
its group down; the group restarts, heals shard to shard from the other group (each index
from its own, at once), and the job ends bitwise equal to a fault-free run. And sharding
changes nothing but the summation order: SGD over 2 x 2 equals SGD over 4 replicas."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _nodes import Nodes
from _runs import check_s1_s3, fastft_run, finals

from fastft.report import summarize
from fastft.runtime import read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

HSDP = ("--shard-size", "2")


@pytest.fixture(scope="module")
def sharded_clean(tmp_path_factory) -> dict[int, dict]:
    run = fastft_run(tmp_path_factory.mktemp("hsdp"), "hsdp-clean", *HSDP, nproc=4)
    check_s1_s3(run, shard_size=2)
    f = finals(run)
    assert f[0]["digest"] == f[2]["digest"] and f[1]["digest"] == f[3]["digest"]
    assert f[0]["digest"] != f[1]["digest"]  # two halves of the model
    return f


def test_shard_groups_across_nodes_end_as_on_one_node(tmp_path, sharded_clean):
    """2 nodes x 2 workers, --shard-size 2: each node hosts one group, whose replicate
    groups span the nodes. An exception on node 1 (rank 3) restarts its group there,
    which heals from node 0, and every shard ends bitwise equal to the one-node run's."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [{"kind": "exception", "rank": 3, "at_step": 8}]}))
    job = Nodes(tmp_path / "nodes", 2, nproc=2, flags=(*HSDP, "--inject", str(plan)))
    try:
        job.start_all()
        codes = job.wait(180)
        assert codes == {0: 0, 1: 0}, job.logs()
    finally:
        assert job.close() == [], job.logs()
    check_s1_s3(job.run, shard_size=2)
    fetched = [e for e in job.events() if e["event"] == "heal" and e["role"] == "fetch"]
    assert sorted(e["src"] for e in fetched if e["step"] == 8) == ["rank 2", "rank 3"]
    got = {r: v["digest"] for r, v in finals(job.run).items()}
    assert got == {r: v["digest"] for r, v in sharded_clean.items()}


@pytest.mark.parametrize("kind", ["sigkill", "exception", "sigstop"])
def test_a_shard_rank_fault_restarts_its_group_which_heals_shard_to_shard(
    tmp_path, sharded_clean, kind
):
    plan = [{"kind": kind, "rank": 1, "at_step": 8}]
    run = fastft_run(tmp_path, f"hsdp-{kind}", *HSDP, plan=plan, nproc=4)
    check_s1_s3(run, shard_size=2)
    assert {r: v["digest"] for r, v in finals(run).items()} == {
        r: v["digest"] for r, v in sharded_clean.items()
    }  # S5, bitwise
    ev = read_events(run)
    assert not summarize(run)["total_losses"]
    restarts = [e for e in ev if e["event"] == "group_restart"]
    assert [(e["group"], sorted(e["ranks"])) for e in restarts] == [(0, [0, 1])], restarts
    # the new lives met as group 0's next generation, and each fetched its own shard
    assert {(e["src"], e["gen"]) for e in ev if e["event"] == "shard_group" and e["gen"]} == {
        ("rank 0", 1),
        ("rank 1", 1),
    }
    heals = {
        e["src"]: e["heal_group"]
        for e in ev
        if e["event"] == "process_group" and e["epoch"] > 1 and "heal_group" in e
    }
    epochs = [e for e in ev if e["event"] in ("epoch", "heal", "heal_aborted", "process_group")]
    assert heals == {"rank 0": [2, 0], "rank 2": [2, 0], "rank 1": [3, 1], "rank 3": [3, 1]}, epochs
    fetched = [e for e in ev if e["event"] == "heal" and e["role"] == "fetch" and e["step"] == 8]
    assert sorted(e["src"] for e in fetched) == ["rank 0", "rank 1"], epochs


def test_a_death_inside_the_replicate_collective_restarts_only_its_group(tmp_path, sharded_clean):
    """Rank 3 exits as the step's replicate allreduce starts, its peer there (rank 1, the
    other group) inside it: Gloo may tell rank 1 the connection closed before the death's
    notice arrives. That failed collective is no fault of rank 1's group (it entered every
    collective of its group and lives on): it rolls back, and only group 1 restarts (found
    by a loop of the cross-node test: rank 1 restarted its group too, and with both groups
    down the job failed, every holder of the state lost)."""
    plan = [{"kind": "exit", "rank": 3, "at_step": 8, "point": "collective", "arg": 3}]
    run = fastft_run(tmp_path, "hsdp-in-collective", *HSDP, plan=plan, nproc=4)
    check_s1_s3(run, shard_size=2)
    ev = read_events(run)
    restarts = [(e["group"], sorted(e["ranks"])) for e in ev if e["event"] == "group_restart"]
    assert restarts == [(1, [2, 3])], [
        e for e in ev if e["event"] in ("group_fault", "local_fault")
    ]
    assert not [e for e in ev if e["event"] == "group_fault"]
    assert {r: v["digest"] for r, v in finals(run).items()} == {
        r: v["digest"] for r, v in sharded_clean.items()
    }


def _params(run: Path, ranks: list[int]) -> dict[str, torch.Tensor]:
    """The model of ``run`` whole: the members' shards (dim 0) put back together."""
    parts = [torch.load(run / "out" / f"final-rank{r}.pt") for r in ranks]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def test_sharding_changes_nothing_but_the_summation_order(tmp_path):
    """SGD (Adam would hide a wrong scale of the gradients) over 2 groups x 2 shards and
    over 4 replicas: the same model to rounding. A gradient averaged over the wrong count
    would be off by a factor of 2 from the first step on."""
    sgd = ("--sgd",)
    whole = fastft_run(tmp_path, "replicas", nproc=4, steps=12, train=sgd)
    sharded = fastft_run(tmp_path, "shards", *HSDP, nproc=4, steps=12, train=sgd)
    a, b = _params(whole, [0]), _params(sharded, [0, 1])
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
    assert _params(sharded, [2, 3]).keys() == a.keys()


def test_elastic_a_lost_group_leaves_the_other_goes_on_and_it_rejoins_whole(tmp_path):
    """--min-replicas 2: rank 1 dies, group 0 goes down and restarts; group 1 commits the
    next step alone (its members take the whole batch) and group 0 comes back as a whole,
    healed shard to shard. Every sample of every committed step is consumed once."""
    plan = [{"kind": "sigkill", "rank": 1, "at_step": 8}]
    # a cold restart of the group takes ~5 s here, and group 1 alone ran 142 steps in 5.8
    # s in CI once, finishing before the group was back: steps of at least 50 ms
    steps = 150
    run = fastft_run(tmp_path, "hsdp-elastic", *HSDP, "--min-replicas", "2", plan=plan,
                     nproc=4, steps=steps, train=("--step-time", "0.05"))  # fmt: skip
    check_s1_s3(run, steps, shard_size=2)
    ev = read_events(run)
    epochs = {e["epoch"]: e for e in ev if e["event"] == "epoch" and e["src"] == "rank 2"}
    assert [(v["members"], v["step"]) for v in epochs.values()][:2] == [
        ([0, 1, 2, 3], 0),
        ([2, 3], 8),  # group 1 alone, from the step that rolled back
    ]
    back = list(epochs.values())[2]
    assert back["members"] == [0, 1, 2, 3] and back["needs_state"] == [0, 1], back
    parts: dict[int, set[tuple[int, int, int]]] = {}
    for e in ev:
        if e["event"] == "commit":
            parts.setdefault(e["step"], set()).add(tuple(e["shard"]))
    for step, got in parts.items():  # the members' parts tile the batch of 96: once each
        covered = sorted((lo, hi) for lo, hi, _ in got)
        assert covered[0][0] == 0 and covered[-1][1] == 96, (step, covered)
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False)), covered
    f = finals(run)
    assert f[0]["digest"] == f[2]["digest"] and f[1]["digest"] == f[3]["digest"]


EVERY = ("--sync", "every-k:4")  # sync steps 3, 7, ..., 31


@pytest.fixture(scope="module")
def local_sgd_clean(tmp_path_factory) -> dict[int, dict]:
    run = fastft_run(tmp_path_factory.mktemp("every"), "every-clean", *HSDP, *EVERY, nproc=4,
                     steps=32)  # fmt: skip
    check_s1_s3(run, 32, shard_size=2, sync_every=4)
    ev = read_events(run)
    step0 = {e["src"]: e["digest"] for e in ev if e["event"] == "commit" and e["step"] == 0}
    assert step0["rank 0"] != step0["rank 2"]  # a local step: each group its own gradient
    f = finals(run)
    assert f[0]["digest"] == f[2]["digest"] and f[1]["digest"] == f[3]["digest"]
    return f


def test_every_k_a_death_at_a_windows_first_step_is_bitwise_equal(tmp_path, local_sgd_clean):
    """The sync step before it left every group the same: the group that restarts heals
    the state it had, and nothing of the window is lost."""
    plan = [{"kind": "sigkill", "rank": 1, "at_step": 8}]
    run = fastft_run(tmp_path, "every-8", *HSDP, *EVERY, plan=plan, nproc=4, steps=32)
    check_s1_s3(run, 32, shard_size=2, sync_every=4)
    assert {r: v["digest"] for r, v in finals(run).items()} == {
        r: v["digest"] for r, v in local_sgd_clean.items()
    }


def test_every_k_a_death_inside_a_window_replaces_its_groups_local_steps(tmp_path):
    """The documented semantics (docs/hsdp.md): the survivors keep their local steps 8 and
    9; the lost group takes the survivors' state of step 10 (its own steps 8 and 9 are
    gone) and the next sync averages as usual. S1, S3 at every sync step, whole groups."""
    plan = [{"kind": "sigkill", "rank": 1, "at_step": 10}]
    run = fastft_run(tmp_path, "every-10", *HSDP, *EVERY, plan=plan, nproc=4, steps=32)
    check_s1_s3(run, 32, shard_size=2, sync_every=4)
    ev = read_events(run)
    survivors = [e for e in ev if e["event"] == "commit" and e["src"] in ("rank 2", "rank 3")]
    assert [e["step"] for e in survivors if e["src"] == "rank 2"] == list(range(32))
    fetched = [e for e in ev if e["event"] == "heal" and e["role"] == "fetch" and e["step"] == 10]
    assert sorted(e["src"] for e in fetched) == ["rank 0", "rank 1"]
    f = finals(run)
    assert f[0]["digest"] == f[2]["digest"] and f[1]["digest"] == f[3]["digest"]


def test_every_k_an_exception_inside_a_window_loses_nothing(tmp_path):
    """One worker per replica, 3 replicas: an exception rolls back the step in place, each
    replica keeps its local steps, and the result is bitwise the fault-free one's."""
    clean = fastft_run(tmp_path, "every-k1-clean", *EVERY, steps=32)
    plan = [{"kind": "exception", "rank": 1, "at_step": 10}]
    run = fastft_run(tmp_path, "every-k1-exc", *EVERY, plan=plan, steps=32)
    check_s1_s3(run, 32, sync_every=4)
    assert {r: v["digest"] for r, v in finals(run).items()} == {
        r: v["digest"] for r, v in finals(clean).items()
    }
    assert len({v["digest"] for v in finals(run).values()}) == 1  # step 31 synced them
