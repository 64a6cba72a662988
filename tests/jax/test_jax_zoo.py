"""JAX's own idiom (issue 47): a transformer trained with the parameters and the optimizer
state in the script's local variables and an optax chain (tests/zoo/jax_lm.py). Read from
``ft.state`` at the top of each step, the idiom is exact through faults; kept across steps,
a healed member trains from its fresh locals, and the in-band replica check stops the job
at the next step, saying what to change. The mistakes a JAX step can make fail at once,
never after retries."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fastft.runtime import read_events

pytestmark = pytest.mark.timeout(300)

SCRIPT = str(Path(__file__).parents[1] / "zoo" / "jax_lm.py")


def run(
    tmp: Path,
    name: str,
    *args: str,
    plan: list[dict] | None = None,
    expect: int = 0,
    nproc: int = 3,
) -> Path:
    out = tmp / name
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "fastft.cli", "run", "--nproc", str(nproc), "--run-dir", str(out)]
    cmd += ["--job", name]
    if plan is not None:
        (out / "plan.json").write_text(json.dumps({"faults": plan}))
        cmd += ["--inject", str(out / "plan.json")]
    cmd += [SCRIPT, *args, "--out", str(out / "out")]
    with open(out / "launcher.log", "w") as log:
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=280)
    assert p.returncode == expect, (out / "launcher.log").read_text()[-4000:]
    return out


def hashes(out: Path) -> dict[int, str]:
    return {
        int(f.stem.removeprefix("final-rank")): json.loads(f.read_text())["hash"]
        for f in (out / "out").glob("final-rank*.json")
    }


PLAN = [
    {"kind": "sigkill", "rank": 1, "at_step": 3, "life": 0},
    {"kind": "exception", "rank": 2, "at_step": 6, "life": 0},
    {"kind": "sigkill", "rank": 0, "at_step": 9, "life": 0, "point": "commit"},
]


def test_the_local_variable_idiom_read_from_ft_state_is_exact_through_faults(tmp_path):
    clean = hashes(run(tmp_path, "clean"))
    assert len(set(clean.values())) == 1 and len(clean) == 3
    faulty = run(tmp_path, "faulty", plan=PLAN)
    assert hashes(faulty) == clean
    assert any(e["event"] == "heal" for e in read_events(faulty))


def test_locals_kept_across_steps_are_refused_at_the_first_step(tmp_path):
    """Params kept in the script's own variables (never read from ``ft.state``): a retried
    step started from its failed attempt's update on every rank (issue 61: exit 0, the
    ranks equal and off the fault-free run; before, only a heal's divergence was caught,
    a step later). Refused at the first proposal, exit 93, saying what to change."""
    out = run(tmp_path, "locals", "--keep-locals", plan=PLAN[:1], expect=1)
    log = (out / "launcher.log").read_text()
    assert "step 0 proposed new pytrees without reading ft.state" in log, log[-3000:]
    assert "exited with code 93" in log
    assert not any(e["event"] == "commit" for e in read_events(out))
    assert not hashes(out)  # no rank finished as if all were well


@pytest.mark.parametrize(
    ("misuse", "says"),
    [
        ("propose-twice", "tx.propose called twice in step 0"),
        ("no-propose", "step 0 ended without tx.propose"),
        ("type-error", "the step raised TypeError at"),
    ],
)
def test_a_jax_mistake_fails_at_once_saying_what_to_change(tmp_path, misuse, says):
    out = run(tmp_path, misuse, "--misuse", misuse, expect=1, nproc=2)
    log = (out / "launcher.log").read_text()
    assert says in log and "exited with code 93" in log, log[-3000:]
    ev = read_events(out)
    assert not any(e["event"] in ("commit", "restart") for e in ev)
    # a mistake is no fault: never reported as one, so never retried (a peer that rolls
    # back as the first to stop dies is the job ending, not a retry)
    assert not any(e["event"] == "local_fault" for e in ev)
    errors = [e["src"] for e in ev if e["event"] == "script_error"]
    assert errors and len(errors) == len(set(errors))


def test_a_leaf_that_is_not_an_array_is_refused_at_register_by_its_path():
    """In process (the other mistakes need a running job): a Python float among the
    leaves was accepted, then every proposal failed with an internal AttributeError."""
    import jax.numpy as jnp

    from fastft.jax.state import PyTrees, StateMisuse

    trees = PyTrees()
    trees.add("params", {"w": jnp.zeros(3), "b": [jnp.zeros(1)]})
    with pytest.raises(StateMisuse, match=r"the leaf params\['b'\]\[1\] is a float"):
        trees.add("params", {"w": jnp.zeros(3), "b": [jnp.zeros(1), 0.5]})
    with pytest.raises(StateMisuse, match="the leaf scale is a float, not an array"):
        trees.add("scale", 1.0)
