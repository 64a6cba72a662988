"""A JAX restart (issue 52) with the example transformer (``examples/jax_transformer.py
--size small``: optax clipping + AdamW + warmup-cosine, dropout from ``tx.key``, three
pytrees registered as a build), 3 workers under ``fastft run``, fixed world:

- a restarted worker is healed and never runs the build, and the compilation cache gives
  back every executable its first step needs;
- a warm spare that ran ahead rehearsed the first step: once it replaces a worker, its
  first step traces and compiles nothing;
- every run ends bitwise equal to the fault-free one (the example runs by the tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _runs import check_s1_s3

from fastft.runtime import read_events

pytestmark = pytest.mark.timeout(300)

EXAMPLE = Path(__file__).parents[2] / "examples" / "jax_transformer.py"
STEPS = 14


def _run(tmp: Path, name: str, *flags: str, plan: list[dict] | None = None) -> Path:
    run = tmp / name
    run.mkdir(parents=True)
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", "3", "--run-dir", str(run)]
    cmd += ["--check-every", "1", "--job", name, *flags]
    if plan is not None:
        (run / "plan.json").write_text(json.dumps({"faults": plan}))
        cmd += ["--inject", str(run / "plan.json")]
    cmd += [str(EXAMPLE), "--", "--size", "small", "--steps", str(STEPS), "--out", str(run / "out")]
    with open(run / "launcher.log", "w") as log:
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=240)
    assert p.returncode == 0, (run / "launcher.log").read_text()[-3000:]
    check_s1_s3(run, steps=STEPS)
    return run


def _hashes(run: Path) -> set[str]:
    got = [json.loads(f.read_text()) for f in sorted((run / "out").glob("final-rank*.json"))]
    assert len(got) == 3 and all(r["step"] == STEPS for r in got)
    return {r["hash"] for r in got}


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    run = _run(tmp_path_factory.mktemp("clean"), "clean")
    assert len(_hashes(run)) == 1
    builds = [e["src"] for e in read_events(run) if e["event"] == "jax_build"]
    assert builds == ["rank 0"], builds  # (the others were healed from it at step 0)
    return run


def _restarted_after(ev: list[dict], kind: str) -> list[dict]:
    t = next(e["mono"] for e in ev if e["event"] == "injected" and e["kind"] == kind)
    return [e for e in ev if e["mono"] > t]


def test_a_restarted_worker_is_healed_and_never_builds(tmp_path, clean):
    plan = [
        {"kind": "sigkill", "rank": 1, "at_step": 5},
        {"kind": "exception", "rank": 2, "at_step": 9},
    ]
    run = _run(tmp_path, "cold", plan=plan)
    assert _hashes(run) == _hashes(clean)
    ev = read_events(run)
    after = _restarted_after(ev, "sigkill")
    assert [e for e in after if e["event"] == "jax_build"] == []
    (first,) = [e for e in after if e["event"] == "jax_first_step" and e["src"] == "rank 1"]
    assert first["step"] == 5 and not first["ran_ahead"]
    # a new process traces its step again, and the compilation cache (its rank's, warmed
    # by its last life) gives every executable back: nothing is compiled
    assert first["traces"] > 0 and first["cache_hits"] > 0 and first["cache_misses"] == 0, first


def test_a_spare_that_ran_ahead_has_nothing_left_to_compile(tmp_path, clean):
    """(The example reads ``tx.step``, ``tx.rank`` and ``tx.world`` after the block: on the
    promoted spare that raised AttributeError and it restarted cold, issue 65, 1.)"""
    plan = [{"kind": "sigkill", "rank": 1, "at_step": 8}]
    run = _run(tmp_path, "spare", "--warm-spares", "1", "--spare-run-ahead", plan=plan)
    assert _hashes(run) == _hashes(clean)
    ev = read_events(run)
    after = _restarted_after(ev, "sigkill")
    (start,) = [e for e in after if e["event"] == "worker_start" and e["src"] == "rank 1"]
    assert start["ran_ahead"], start  # (the spare was warm by step 8: it had rehearsed)
    assert [e for e in after if e["event"] == "jax_build"] == []
    (first,) = [e for e in after if e["event"] == "jax_first_step" and e["src"] == "rank 1"]
    assert first["ran_ahead"] and first["traces"] == 0 and first["compile_ms"] == 0, first


COUNTED = """
import json, sys, torch, jax, jax.numpy as jnp, fastft.jax
from fastft.testing.collectives import count_allreduces
reduces = count_allreduces()
ft = fastft.jax.init()
ft.register(w=jnp.ones(8))
grad = jax.jit(jax.grad(lambda w, x: jnp.sum((w * x) ** 2)))
per_step = []
while ft.step < 10:
    with ft.transaction() as tx:
        before = reduces[0]
        g = tx.pmean(grad(ft.state["w"], jnp.full(8, 1.0 + tx.rank)))
        tx.propose(w=ft.state["w"] - 0.01 * g)
    if tx.committed:
        per_step.append(reduces[0] - before)
with open(f"{sys.argv[1]}/reduces-{ft.rank}.json", "w") as f:
    json.dump(per_step, f)
ft.close()
"""


def test_a_jax_step_makes_one_allreduce_its_pmean_which_carries_the_vote(tmp_path):
    """The step's vote rides its gradients' pmean (issue 65: fastft.runtime.state.inband),
    so a fault-free JAX step decided by its collective makes one allreduce, not a second
    of the agreement's."""
    script, out = tmp_path / "counted.py", tmp_path / "out"
    script.write_text(COUNTED)
    out.mkdir()
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", "2", "--run-dir"]
    # (decided by the collective: before the vote rode the pmean, its own allreduce)
    cmd += [str(tmp_path / "run"), "--decide", "collective", str(script), str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert p.returncode == 0, p.stderr[-3000:]
    counts = [json.loads(f.read_text()) for f in sorted(out.glob("reduces-*.json"))]
    assert len(counts) == 2
    # (from step 2: an epoch's first two steps run the replica check, its own allreduce)
    assert all(c[2:] == [1] * 8 for c in counts), counts
