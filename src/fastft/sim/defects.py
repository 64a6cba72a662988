"""Defects the protocol had, put back for a while: the simulator must find each.

Each is the old version of a real decider, patched in for the duration of a ``with
reintroduce(name):`` block (the production code has no switch for them). Tests and
``fastft sim --defect NAME`` use them to show that the simulator can fail."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import fastft.launch.rules.policy as policy
import fastft.runtime.engine.core as core
import fastft.runtime.engine.joiners as joiners
import fastft.runtime.engine.plans as plans
import fastft.runtime.engine.survivors as survivors
from fastft.fsm import Deadline, DrainAcked, Phase, StepState
from fastft.fsm.contract import Event
from fastft.fsm.handlers import Result
from fastft.fsm.table import TABLE, Rule
from fastft.runtime.contract import EpochView

__all__ = ["DEFECTS", "reintroduce"]


def _old_regroup(mp: contextlib.ExitStack) -> None:
    """ffa6017: after every worker was lost, the restore waited for every slot."""
    register = joiners.Joiners.register

    def forever(self: Any, start_timeout_s: float, regroup_timeout_s: float) -> Any:
        return register(self, start_timeout_s, float("inf"))

    _patch(mp, joiners.Joiners, "register", forever)


def _old_finished_lost(mp: contextlib.ExitStack) -> None:
    """A survivor that had lost its state never checked whether the job finished: after the
    others finished, it waited in the formation for them (until the agent's between-steps
    timeout, 30 min), or for a joiner's process group (the joiner saw the end and left)."""
    survivor_round = survivors.Survivors.round

    def blind(self: Any, wait: Any, *a: Any, **kw: Any) -> Any:
        if not wait.lost_state:
            return survivor_round(self, wait, *a, **kw)
        self.c.finished_at = lambda: None
        try:
            return survivor_round(self, wait, *a, **kw)
        finally:
            del self.c.finished_at

    _patch(mp, survivors.Survivors, "round", blind)
    route = core.route  # (nor did a peer's end reach it: the core's check came later)
    _patch(mp, core, "route", lambda m, **kw: replace(route(m, **kw), job_done=False))


def _old_first_heal(mp: contextlib.ExitStack) -> None:
    """Before the first commit, a total loss failed the job ("every holder of the committed
    state (step 0) was lost") although a fresh process holds that state."""
    close_after = survivors.close_after

    def fatal_at_zero(prev: EpochView, *a: Any, **kw: Any) -> EpochView | None:
        view = close_after(prev, *a, **kw)
        if view is not None and view.lost == 0 and view.restore is None:
            fresh = kw.get("recovery")
            if not (fresh is not None and fresh.fresh_start):
                return dataclasses.replace(view, step=0, needs_state=frozenset(), source=None)
        return view

    _patch(mp, survivors, "close_after", fatal_at_zero)


def _old_lone_rollback(mp: contextlib.ExitStack) -> None:
    """The rollback without a bus barrier, in its first version: a peer's own transient
    fault of an epoch this worker had left rolled the new epoch back here alone (its peers
    went on in it), and nothing reminded them: the closer declared its live peers dead at
    the deadline. (Each member's request to every other had covered it: N(N-1)
    deliveries.)"""
    route = core.route

    def stale_acted_on(m: Any, **kw: Any) -> Any:
        out = route(m, **kw)
        if out.record and out.record[0] == "stale_fault":
            return route(m, **{**kw, "epoch": m.epoch})
        return out

    def silent(self: Any, *a: Any) -> bool:
        return False

    _patch(mp, core, "route", stale_acted_on)
    _patch(mp, survivors.Survivors, "_remind", silent)


def _old_closer_pass(mp: contextlib.ExitStack) -> None:
    """The rollback without a bus barrier, before a survivor passed over a closer that
    never arrived: a member that missed the closer's death notice (its peers knew) waited
    for that closer forever, the others for it (the bus barrier's deadline had declared the
    silent closer dead)."""

    def wait_for_it(self: Any, *a: Any) -> frozenset[int]:
        return frozenset()

    _patch(mp, survivors.Survivors, "_pass_closer", wait_for_it)


def _old_drain_wait(mp: contextlib.ExitStack) -> None:
    """DRAIN_WAIT had no deadline, and a member's clean exit after the job finished acked
    nothing: a leaver whose notice was lost on the way, or who drained at the last commit,
    waited for an ack forever (and a fixed world for its restart)."""
    rule = TABLE[(Phase.DRAIN_WAIT, Deadline)]
    route = core.route

    def no_ack(*a: Any, **kw: Any) -> Any:
        out = route(*a, **kw)
        if out.record and out.record[0] == "peer_finished":
            return replace(
                out, events=tuple(e for e in out.events if not isinstance(e, DrainAcked))
            )
        return out

    _patch(mp, core, "route", no_ack)

    def ignore(s: StepState, e: Event) -> Result:
        return s, ()

    _patch_rule(mp, (Phase.DRAIN_WAIT, Deadline), Rule((Phase.DRAIN_WAIT,), ignore, rule.doc))


def _old_same_step(mp: contextlib.ExitStack) -> None:
    """Before a step could be decided by its collective, every survivor held the same
    step, and the formation took the lowest holder as the source. A survivor that a fault
    interrupted before it completed the step's collective is one step behind those that
    completed it: as the source, or left unhealed, it splits the state."""
    close_after = survivors.close_after

    def same_step(prev: EpochView, arrived: dict[int, Any], *a: Any, **kw: Any) -> Any:
        top = max((x.step for x in arrived.values() if not x.lost), default=None)
        if top is not None:
            arrived = {r: x if x.lost else replace(x, step=top) for r, x in arrived.items()}
        return close_after(prev, arrived, *a, **kw)

    _patch(mp, survivors, "close_after", same_step)


def _old_drain_last_holder(mp: contextlib.ExitStack) -> None:
    """A worker asked to drain while its epoch re-formed left at once, taking the state
    with it when it was the last holder (a restarted peer still to heal from it): a total
    loss (issue 48, 3)."""
    _patch(mp, plans, "others_hold_state", lambda *a, **kw: True)


def _old_hang_waiter(mp: contextlib.ExitStack) -> None:
    """A step after a recovery was hung once it lasted ``--hang-timeout``, whatever its
    main thread did: a member waiting in it on a peer that hung (the only holder, healing
    a restart that hung) was killed first, and the state with it (issue 60, 1)."""
    verdict = policy.hang_verdict

    def by_length(**kw: Any) -> Any:
        return verdict(**{**kw, "waiting_since": 0.0, "main_beat": 0.0})

    _patch(mp, policy, "hang_verdict", by_length)


def _patch(mp: contextlib.ExitStack, owner: Any, name: str, value: Any) -> None:
    old = getattr(owner, name)
    setattr(owner, name, value)
    mp.callback(setattr, owner, name, old)


def _patch_rule(mp: contextlib.ExitStack, key: Any, rule: Rule) -> None:
    old = TABLE[key]
    TABLE[key] = rule
    mp.callback(TABLE.__setitem__, key, old)


DEFECTS: dict[str, tuple[Callable[[contextlib.ExitStack], None], dict[str, Any]]] = {
    "regroup": (
        _old_regroup,
        {"elastic": True, "min_replicas": 2, "faults": 3, "kinds": ("drain", "kill", "hang")},
    ),
    "first-heal": (_old_first_heal, {}),
    "finished-lost": (_old_finished_lost, {"kinds": ("drain", "kill", "exception")}),
    "lone-rollback": (_old_lone_rollback, {"kinds": ("escape", "exception"), "faults": 3}),
    "closer-pass": (
        _old_closer_pass,
        {"kinds": ("msg_lost", "kill", "store_fail", "exception"), "faults": 3},
    ),
    "drain-wait": (_old_drain_wait, {"kinds": ("drain", "msg_lost")}),
    "same-step": (_old_same_step, {"kinds": ("kill",)}),
    "drain-last-holder": (_old_drain_last_holder, {"kinds": ("drain", "kill"), "faults": 2}),
    "hang-waiter": (_old_hang_waiter, {"kinds": ("hang", "kill", "exception"), "faults": 3}),
}
"""Name -> (what puts it back, the simulator options under which to look for it)."""


@contextlib.contextmanager
def reintroduce(name: str) -> Iterator[None]:
    """Put the defect ``name`` back for the block."""
    patch, _ = DEFECTS[name]
    with contextlib.ExitStack() as mp:
        patch(mp)
        yield
