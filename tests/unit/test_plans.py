"""The main thread's and the agent's decisions are written once, as pure plans
(:mod:`fastft.runtime.engine.plans`, :mod:`fastft.launch.rules.exitplan`), and the worker, the
agent and the simulator only carry them out (issue 63). The plans' rules, then a check of
the performers' source: none of their conditions reads a rule's input itself."""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from fastft.fsm import CastVote, Decision, FormEpoch, Phase, StepState
from fastft.launch.rules import exitplan
from fastft.protocol.exits import EXIT_DRAINED, EXIT_SCRIPT_ERROR
from fastft.runtime.contract import EpochView, Member
from fastft.runtime.engine import plans

SRC = Path(__file__).resolve().parents[2] / "src" / "fastft"

A, B, C = Member(0, 1), Member(1, 2), Member(2, 3)
PREV = EpochView(4, (A, B, C), 10, frozenset(), None)


# --- the main thread's plans ----------------------------------------------------------------
def test_a_step_decided_by_its_collective_needs_no_store_and_the_first_member_forgets():
    assert plans.voted(CastVote(4, 10, agreed=True)) == Decision(commit=True)
    assert plans.voted(CastVote(4, 10)) is None
    late = CastVote(4, 10, agreed=True, confirm=True)
    assert plans.voted(late) is None and plans.confirms(late)  # (the store confirms it)
    assert not plans.confirms(CastVote(4, 10, agreed=True)) and not plans.confirms(CastVote(4, 10))
    do = plans.decided(PREV, 0, 10, "C")
    assert do.decision == Decision(commit=True) and do.forget == 9 and do.quiet
    later = plans.decided(PREV, 1, 10, "CJL2")  # (not the first member: it forgets nothing)
    assert later.decision == Decision(commit=True, admit=True, leaving=frozenset({2}))
    assert later.forget is None and not later.quiet
    back = plans.decided(PREV, 0, 10, "Rpeer died")
    assert back.decision == Decision(commit=False) and back.forget is None and not back.quiet
    assert plans.records(PREV, 0) and not plans.records(PREV, 1) and not plans.records(None, 0)


def test_a_shard_group_is_admitted_once_whole():
    a = CastVote(4, 10, joining=True)
    assert plans.vote_joining(a, 1, None) and not plans.needs_joiners(a, 1)
    assert plans.needs_joiners(a, 2)
    assert not plans.vote_joining(a, 2, {2: 7})  # (rank 3 of group 1 not yet registered)
    assert plans.vote_joining(a, 2, {2: 7, 3: 8})


def test_the_formation_plan_leaves_out_the_dead_and_knows_what_it_holds():
    s = StepState(Phase.HEALING, 0, epoch=4, step=10)
    f = plans.form(
        FormEpoch(frozenset({2}), lost_state=False, rollback=True),
        PREV,
        A,
        {B},
        s,
        suspect=False,
        elastic=True,
        verified=8,
        wanted=6,
    )
    assert f.exclude == {1, 2} and not f.admit and f.holds and f.rewind == 8
    lost = plans.form(
        FormEpoch(frozenset(), lost_state=True),
        PREV,
        A,
        (),
        s,
        suspect=False,
        elastic=True,
        verified=8,
        wanted=6,
    )
    assert lost.admit and not lost.holds and lost.rewind == 6
    healing = EpochView(4, (A, B, C), 10, frozenset({0}), 1)  # (rank 0 heals in epoch 4)
    f = plans.form(
        FormEpoch(frozenset(), lost_state=False), healing, A, (), s, suspect=False, elastic=False, verified=None,
        wanted=None,
    )  # fmt: skip
    assert not f.holds  # (not healed yet: it committed nothing in the epoch)


def test_a_drainer_leaves_a_formation_unless_it_is_the_last_holder():
    asked = StepState(Phase.HEALING, 0, epoch=4, step=10, want_drain=True)
    assert (
        plans.drain(PREV, frozenset(), A, (), StepState(Phase.HEALING, 0, epoch=4), True)
        is plans.Drain.NONE
    )
    assert plans.drain(PREV, frozenset(), A, (), asked, True) is plans.Drain.LEAVE_WRITING
    assert plans.drain(PREV, frozenset(), A, (), asked, False) is plans.Drain.LEAVE
    last = plans.drain(PREV, frozenset({1, 2}), A, (), asked, True)
    assert last is plans.Drain.LAST and not last.leaves
    assert plans.holder_leaves(joiners=False) and not plans.holder_leaves(joiners=True)
    assert plans.joiner_leaves(asked) and not plans.joiner_leaves(StepState(Phase.INIT, 0))


def test_the_adopted_views_recovery():
    assert plans.recover(PREV, False) is plans.Recover.NONE
    restore = EpochView(5, (A,), 8, frozenset(), None, restore=8, lost=10)
    assert plans.recover(restore, False) is plans.Recover.RESTORE
    rewind = EpochView(5, (A,), 8, frozenset(), None, restore=8, lost=10, rewind=True)
    assert plans.recover(rewind, False) is plans.Recover.REWIND
    fatal = EpochView(5, (A,), 10, frozenset(), None, lost=10)
    assert fatal.fatal
    assert plans.recover(fatal, False) is plans.Recover.STATE_LOST
    assert plans.recover(fatal, True) is plans.Recover.FRESH_RESTART
    fresh = EpochView(5, (A, B), 0, frozenset({0}), 1, lost=10)
    assert plans.recover(fresh, True) is plans.Recover.FRESH_START
    assert plans.outsider(PREV, A) is None
    out = plans.outsider(PREV, Member(0, 9))  # (a newer life of rank 0: left out)
    assert out is not None and out.epoch == 4 and out.members == frozenset({0, 1, 2})


# --- the agent's exit plan ------------------------------------------------------------------
SEEN = exitplan.AgentSeen(max_restarts=3, world_size=3, first_lives={0: False, 1: None, 2: None})


def test_an_exit_the_agent_caused_is_no_fault_of_the_worker():
    e = exitplan.Exited(rank=1, code=None, sig=9, life=1)
    assert exitplan.fault_of(e, SEEN) == "signal 9"
    assert exitplan.fault_of(exitplan.Exited(1, None, 9, 1, hung=True), SEEN) == "hung"
    for caused in (
        exitplan.Exited(1, None, 9, 1, fenced=True),
        exitplan.Exited(1, None, 9, 1, taken_down=True),
        exitplan.Exited(1, EXIT_DRAINED, None, 1),
        exitplan.Exited(1, 0, None, 1),
    ):
        assert exitplan.fault_of(caused, SEEN) is None, caused
    stopping = exitplan.AgentSeen(max_restarts=3, world_size=3, stopping=True)
    assert exitplan.fault_of(e, stopping) is None


def test_the_exit_plan_restarts_fails_at_start_up_and_keeps_the_floor():
    plan = exitplan.exit_plan(exitplan.Exited(1, 1, None, 1), SEEN)
    assert plan.then.restart and plan.own and plan.first_failed is None
    # the first lives: rank 0's ended well, ranks 1 and 2 fail before their first commit
    one = exitplan.AgentSeen(max_restarts=3, world_size=2, first_lives={0: None, 1: None})
    first = exitplan.exit_plan(exitplan.Exited(0, 1, None, 0), one)
    assert first.first_failed is True and not first.startup and first.then.restart
    both = exitplan.AgentSeen(max_restarts=3, world_size=2, first_lives={0: True, 1: None})
    last = exitplan.exit_plan(exitplan.Exited(1, 1, None, 0), both)
    assert last.startup and last.then.failed and "before its first commit" in last.then.failed
    named = exitplan.exit_plan(exitplan.Exited(1, EXIT_SCRIPT_ERROR, None, 0), both)
    assert not named.startup and named.then.failed  # (its own reason, the policy's)
    hung = exitplan.exit_plan(exitplan.Exited(1, None, 9, 0, hung=True), both)
    assert hung.first_failed is False and not hung.startup  # (the hang timeout's: not failed)
    # a drained worker of an elastic world is done: the floor is asked, and holds or not
    elastic = exitplan.AgentSeen(max_restarts=3, world_size=3, min_replicas=2)
    drained = exitplan.exit_plan(exitplan.Exited(1, EXIT_DRAINED, None, 2), elastic)
    assert drained.then.done and drained.check_floor and not drained.own
    assert exitplan.floor(drained, 2, elastic).then.failed is None
    assert "below --min-replicas 2" in (exitplan.floor(drained, 1, elastic).then.failed or "")
    fixed = exitplan.exit_plan(exitplan.Exited(1, EXIT_DRAINED, None, 2), SEEN)
    assert fixed.then.restart and fixed.free and not fixed.check_floor
    group = exitplan.AgentSeen(max_restarts=3, world_size=4, shard_size=2)
    assert exitplan.exit_plan(exitplan.Exited(1, 1, None, 1), group).group


# --- the performers decide nothing ----------------------------------------------------------
RULE_INPUTS = {
    # the formation, the vote, the adoption (plans)
    "agreed",
    "allow_fresh_start",
    "elastic",
    "fatal",
    "joining",
    "leaving",
    "lost",
    "lost_state",
    "needs_state",
    "restore",
    "rewind",
    "rollback",
    "want_drain",
    # the agent's exit (exitplan)
    "draining",
    "ending",
    "fenced",
    "hung",
    "max_restarts",
    "min_replicas",
    "quarantined",
    "replaced",
    "returncode",
    "shard_size",
    "stopping",
    "taken_down",
    "torchft",
}
"""What a plan reads to decide: a performer's condition on one of them is a decision."""
RULE_CALLS = {
    "after_exit",
    "close_after",
    "floor_lost",
    "has",
    "index",
    "others_hold_state",
    "parse_commit",
    "startup_failed",
    "whole_groups",
}
"""Rules called outside their plan module."""
RAW = {"code", "sig"}
"""An exit's raw status, which only the exit plan reads."""
PLANNED = {"do", "then", "plan", "r", "out", "known", "e", "seen"}
"""The names the performers give the plans they carry out (their fields are the plan's)."""

PERFORMERS: dict[str, dict[str, list[str]]] = {
    "runtime/engine/membership.py": {
        "Membership": [
            "vote",
            "applied",
            "join",
            "form",
            "_rounds",
            "_drain",
            "_drain_from_formation",
            "adopt",
            "_recover",
        ]
    },
    "sim/waits.py": {
        "Waits": [
            "vote",
            "_vote",
            "decided",
            "apply",
            "form",
            "drain_from_formation",
            "_form",
            "join",
            "_join",
            "adopt",
        ]
    },
    "launch/exits.py": {"Exits": ["after_exit", "_perform"]},
    "sim/agents.py": {"Agents": ["_on_exit_seen", "_perform"]},
}


def _conditions(fn: ast.AST) -> Iterator[ast.expr]:
    for node in ast.walk(fn):
        if isinstance(node, ast.If | ast.While):  # (a conditional expression formats)
            yield node.test
        elif isinstance(node, ast.comprehension):
            yield from node.ifs


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def decisions_in(fn: ast.AST) -> list[str]:
    """Each decision ``fn`` makes itself: a condition that reads a rule's input not through
    a plan, or a call of a rule."""
    found = []
    for test in _conditions(fn):
        for n in ast.walk(test):
            if isinstance(n, ast.Attribute) and n.attr in RULE_INPUTS and _root(n) not in PLANNED:
                found.append(f"line {n.lineno}: a condition reads .{n.attr}")
            elif isinstance(n, ast.Name) and n.id in RAW:
                found.append(f"line {n.lineno}: a condition reads {n.id}")
    for n in ast.walk(fn):
        if isinstance(n, ast.Call):
            name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            if name in RULE_CALLS:
                found.append(f"line {n.lineno}: calls {name}()")
    return found


def _methods() -> Iterator[tuple[str, ast.FunctionDef]]:
    for path, classes in PERFORMERS.items():
        tree = ast.parse((SRC / path).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name in classes:
                defs = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
                for name in classes[node.name]:
                    assert name in defs, f"{path}: {node.name}.{name} is gone: update the list"
                    yield f"{path}:{node.name}.{name}", defs[name]


def test_the_worker_the_agent_and_the_simulator_only_carry_out_plans():
    found = {where: got for where, fn in _methods() if (got := decisions_in(fn))}
    assert not found, "decided outside the plan modules (move it into a plan):\n" + "\n".join(
        f"{where}: {'; '.join(got)}" for where, got in found.items()
    )


def test_every_main_thread_action_of_the_simulator_is_checked():
    """A method added to the simulator's waiting actions is listed above (or its check
    would be skipped)."""
    from fastft.sim.waits import Waits

    own = {n for n, f in vars(Waits).items() if inspect.isfunction(f)}
    listed = set(PERFORMERS["sim/waits.py"]["Waits"])
    # (the ports it is given, and the slices that wait on a process group or a heal:
    # the machine's actions, not the formation's)
    ports = {"feed", "wait", "back_to_drive", "local_fault", "declare_silent", "remind"}
    assert own - listed - ports - {"enter", "cancelled", "write_held", "_pg", "_heal"} == set()


@pytest.mark.parametrize(
    "old",
    [
        # (the simulator's own copy of the rules before issue 63, each would be found)
        """
        def form(self, a):
            if a.rollback and self.w.opts.elastic:
                pass
        """,
        """
        def decided(self, epoch, step, got):
            if view.index(self.rank) == 0 and step > 0:
                pass
        """,
        """
        def adopt(self, view):
            if view.lost is not None and view.fatal:
                pass
        """,
        """
        def _on_exit_seen(self, who, code, sig):
            if code == 0:
                slot.finished = True
        """,
        """
        def after_exit(self, slot, code, sig):
            do = policy.after_exit(rank=slot.rank, code=code)
            if code == 0 and not slot.done:
                pass
        """,
    ],
)
def test_the_check_finds_a_decision_made_in_place(old: str):
    fn = ast.parse(textwrap.dedent(old)).body[0]
    assert decisions_in(fn)


def test_the_simulator_imports_the_plans_and_no_rule():
    for path in ("sim/waits.py", "sim/agents.py"):
        text = (SRC / path).read_text()
        for rule in ("others_hold_state", "parse_commit", "floor_lost", "after_exit("):
            assert rule not in text, f"{path} uses {rule} itself"
    assert (
        "from fastft.runtime.engine import decisions, plans" in (SRC / "sim/waits.py").read_text()
    )
    assert "from fastft.launch.rules import exitplan" in (SRC / "sim/agents.py").read_text()
