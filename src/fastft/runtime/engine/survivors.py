"""A survivor's part in forming the next epoch: the rollback's barrier.

Survivors of epoch ``E-1`` write their arrival (a key) and count it (one counter); the
lowest survivor still believed alive, the closer, polls the counter, reads the arrival
keys once it says every expected survivor may be in, waits for those it expects (or the
rollback timeout, then declares the missing ones dead), admits registered joiners and
closes ``E`` with at least ``min_replicas`` (else it waits for joiners). The others block
on the closed view. The first to arrive reminds the members still missing (one rollback
request on the bus), and past the deadline a closer that never came is passed over.

This replaced a barrier on the bus in which every member sent a rollback request and an
acknowledgement to every other: 2N(N-1) deliveries a fault, 10 s a round at 256 members
(issue 35; docs/architecture.md "The rollback's barrier"). Its cost now: two requests per
arrival, the closer's polls of one counter, one read of the arrival keys per change of
the count, and a few broadcasts: O(N), and nothing between members.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from fastft.runtime.contract import EpochView, Member
from fastft.runtime.engine import decisions as d
from fastft.runtime.engine.coordinator import Coordinator, form_wait_s
from fastft.runtime.engine.formation import (
    Arrival,
    Recovery,
    SurvivorWait,
    close_after,
    holds_state,
)
from fastft.runtime.groups.hsdp import broken_groups, whole_groups

__all__ = ["ARRIVAL_S", "BEAT_S", "CLOSER_GRACE_S", "REMIND_S", "Round", "Survivors"]

_POLL_S = 0.002
_FINISHED_CHECK_AFTER_S = 0.2
"""A formation waiting longer than this also checks whether the job already finished..."""
_POLL_FINISHED_S = 0.1
"""... this often."""
REMIND_S = 0.05
"""When the first survivor to arrive first reminds the members still missing (one rollback
request on the bus: a member whose fault notice was lost, or that took it for a fault of
an epoch it had left, still waits in the step); each next reminder waits twice as long."""
CLOSER_GRACE_S = 0.5
"""Past the deadline, how long a survivor waits for its closer before it reads whether the
closer arrived; one that never did is passed over (the first arrival declares it dead).
One that arrived is passed over once its beat stood still this long per place in line."""
BEAT_S = 0.2
"""How often a closer at work writes its beat (:meth:`JobKeys.epoch_closer`): a closer that
works is never passed over (at 512 members past the deadline survivors passed over a slow
closer one after another, and 66 closed at once: issue 51)."""
ARRIVAL_S = 0.00025
"""The deadline's allowance per expected member (a server serves N arrivals one after
another: late must not mean dead; +4 s at 16,384)."""


@dataclass(frozen=True)
class Round:
    """What one round of a survivor's wait asks of its executor (a plan: the survivor's
    side never acts on the executor's machine itself)."""

    view: EpochView | None = None
    """The epoch closed: adopt it (or, not listed in it, join as a new worker)."""
    finished: int | None = None
    """The job finished at this step meanwhile: the worker ends (0)."""
    silent: frozenset[int] = frozenset()
    """Expected members that never arrived by the deadline: declare them dead (their
    agents kill them; they come back as joiners)."""
    remind: bool = False
    """Ask the members still missing to roll back (one rollback request on the bus)."""
    below: tuple[int, int] | None = None
    """The epoch this worker closes waits below ``--min-replicas``: (have, need)."""


class Survivors:
    """One worker's survivor side of the formations, over its coordinator's store clients
    (:class:`~fastft.runtime.engine.coordinator.Coordinator`)."""

    def __init__(self, coord: Coordinator) -> None:
        self.c = coord

    def rounds(self, wait: SurvivorWait) -> Iterator[Round]:
        """A survivor's wait for the epoch :meth:`arrive` began, as the rounds its executor
        carries out (:class:`Round`: declare the silent dead, remind the missing, say it
        waits below the floor, end with the job); the last one carries the closed view
        (which may not list this worker: it must then join) or the step the job finished
        at. The executor stops iterating when its formation is cancelled. The closer polls
        the arrivals' counter; the others block on the closed view (the decision store's
        short timeout) when there is one. :mod:`fastft.sim` runs the same :meth:`round`
        from its scheduler."""
        try:
            yield from self._rounds(wait)
        finally:
            if wait.watch is not None:
                wait.watch.close()

    def _rounds(self, wait: SurvivorWait) -> Iterator[Round]:
        look = False  # (read the closed view: the closer each poll, a waiter after a wait)
        while True:
            if look:
                view = self.c.closed(wait.epoch)
                if view is not None:
                    yield Round(view=view)
                    return
            r = self.round(wait)
            yield r
            if r.view is not None or r.finished is not None:
                return
            if wait.closing or self.c.decision_store is self.c.store:
                look = True
                self.c.sleep(_POLL_S)
                continue
            view = self.await_closed(wait)
            if view is not None:
                yield Round(view=view)
                return
            look = True  # (its wait ran out: the full view, if its closer died before the change)

    def arrive(
        self,
        prev: EpochView,
        exclude: frozenset[int],
        *,
        step: int,
        lost_state: bool,
        timeout_s: float,
        kept: tuple[int, int, int] | None = None,
        admit: bool = True,
        suspect: bool = False,
        rewind: int | None = None,
    ) -> SurvivorWait:
        """Write this survivor's arrival at ``prev.epoch + 1``; the wait's state for
        :meth:`round`."""
        epoch = prev.epoch + 1
        arrival = Arrival(self.c.me.incarnation, step, lost_state, kept, suspect, rewind)
        voice = self.c.voice
        first = voice.arrive(epoch, self.c.me.rank, arrival.to_json()) if voice else None
        if first is None:  # (no voice, or its agent did not answer: written here)
            first = self._write_arrival(epoch, arrival)
        expected = sorted(prev.ranks - exclude)
        started = self.c.clock()
        deadline = started + timeout_s + len(expected) * ARRIVAL_S
        return SurvivorWait(prev, expected, step, lost_state, admit, started, deadline, first=first)

    def _write_arrival(self, epoch: int, arrival: Arrival) -> bool:
        """This survivor's arrival key and count (without its node's voice); whether it
        was the epoch's first."""
        self.c.store.set(self.c.keys.epoch_arrival(epoch, self.c.me.rank), arrival.to_json())
        if self.c.reads_many:  # (NATS: an add is a compare-and-set loop; one try here)
            me = str(self.c.me.rank)
            return d.decide_once(self.c.store, self.c.keys.epoch_first(epoch), me) == me
        return int(self.c.store.add(self.c.keys.epoch_arrivals(epoch), 1)) == 1

    def await_closed(self, wait: SurvivorWait) -> EpochView | None:
        """The view of the epoch once closed, as its change of the epoch this survivor
        leaves (a few bytes; :meth:`EpochView.change_from`), waiting for it up to
        :func:`~.coordinator.form_wait_s` (one blocking read: the server answers every
        waiter when it is written; a wait that ran out reads again, so the wait grows with
        the world: 0.5 s waits polled again 16,384 times a second at 16,384 members). With
        a node's voice (:mod:`.voice`) its agent waits for the node's workers, and this
        worker waits for its agent."""
        timeout_s = form_wait_s(len(wait.prev.members))
        asked, got = (False, None)
        if self.c.voice is not None:  # (the node's agent waits for the node's workers)
            asked, got = self.c.voice.closed(wait.epoch, timeout_s)
        if not asked:
            got = self.c.wait_value(self.c.keys.epoch_change(wait.epoch), timeout_s)
        return EpochView.from_change(wait.prev, got) if got is not None else None

    def round(self, wait: SurvivorWait) -> Round:
        """One round of a survivor's wait for the epoch (after it found it not closed):
        ``finished`` when the job finished (with or without its state's last step); the
        lowest expected survivor still alive tries to close the epoch (one that died
        meanwhile hands it on at once, not after the deadline). The first to arrive
        reminds the members still missing, and past the deadline declares a closer that
        never came. What its executor does: :class:`Round`.

        This is the rollback's barrier (issue 35): its cost is the arrivals (2 requests
        each), the closer's polls of one counter, and one read of every arrival key per
        change of the count once it says everyone may be in: O(N) requests, and no
        message between members."""
        prev = wait.prev
        now = self.c.clock()
        if now - wait.started > _FINISHED_CHECK_AFTER_S and now - wait.checked >= _POLL_FINISHED_S:
            wait.checked = now
            done = self.c.finished_at()
            # (also one lost or behind: it waited for finished members; the simulator)
            if done is not None:
                return Round(finished=done)
        broken = broken_groups(prev, self.c.dead, self.c.k)

        def alive(r: int) -> bool:
            return (
                Member(r, prev.incarnation(r)) not in self.c.dead
                and r // self.c.k not in broken
                and r not in wait.passed
            )

        # (the closer is the first alive: a member that waits needs no more; the list of
        # every one alive is O(N), for the closer, the first arrival and past the deadline)
        closer = next((r for r in wait.expected if alive(r)), None)
        wait.closing = closer == self.c.me.rank
        if closer is None:
            return Round()
        late = now >= wait.deadline + CLOSER_GRACE_S
        if not (wait.first or wait.closing or late):
            return Round()
        live = [r for r in wait.expected if alive(r)]
        remind = wait.first and self._remind(wait, live, now)
        if wait.closing:
            self._beat(wait, now)
            return dataclasses.replace(self._try_close(wait, live), remind=remind)
        silent = self._pass_closer(wait, live, now) if late else frozenset()
        return Round(remind=remind, silent=silent)

    def _beat(self, wait: SurvivorWait, now: float) -> None:
        """The closer's beat (:meth:`JobKeys.epoch_closer`), every :data:`BEAT_S`."""
        if now - wait.beat_at >= BEAT_S:
            wait.beat_at = now
            wait.beats += 1
            self.c.store.set(self.c.keys.epoch_closer(wait.epoch), str(wait.beats))

    def _pass_closer(self, wait: SurvivorWait, live: list[int], now: float) -> frozenset[int]:
        """Past the deadline and a grace, the epoch not closed: its closer is dead or hung
        and this worker missed the notice (the bus barrier's deadline once declared it).
        One that never arrived is passed over at once (one read), and the first arrival
        declares it dead (the agent kills it); past one grace more per place in the line,
        this worker closes itself (the compare-and-set keeps one view if the closer was
        only slow). The closer to declare dead, if any."""
        closer = live[0]
        if closer not in wait.checked_closer:
            wait.checked_closer |= {closer}
            if self.c.value(self.c.keys.epoch_arrival(wait.epoch, closer)) is None:
                wait.passed |= {closer}
                return frozenset({closer}) if wait.first else frozenset()
        if now - wait.beat_read >= CLOSER_GRACE_S:  # (a closer that beats is working)
            wait.beat_read = now
            beat = self.c.value(self.c.keys.epoch_closer(wait.epoch))
            if beat is not None and beat != wait.beat_seen:
                wait.beat_seen, wait.beat_moved = beat, now
                return frozenset()
        place = live.index(self.c.me.rank) if self.c.me.rank in live else 0
        since = max(wait.deadline, wait.beat_moved)
        if place and now >= since + (place + 1) * CLOSER_GRACE_S:
            wait.passed |= frozenset(live[:place])
        return frozenset()

    def _remind(self, wait: SurvivorWait, live: list[int], now: float) -> bool:
        """The first arrival's duty while the epoch is not closed: a rollback request to
        the members still missing, after :data:`REMIND_S` and then ever less often (a
        member whose fault notice was lost, or that took it for a fault of an epoch it
        had left, waits in the step's collective). Whether it reminds them now."""
        gap = REMIND_S * 2 ** min(wait.reminders, 4)  # (0.05 s, doubling up to 0.8 s)
        if now - max(wait.reminded, wait.started) >= gap:
            wait.reminded = now
            if self._count(wait) < len(live):
                wait.reminders += 1
                return True
        return False

    def _count(self, wait: SurvivorWait) -> int:
        """How many arrivals the formation counted (NATS: the arrivals read at once)."""
        if self.c.reads_many:
            return len(self._read_arrivals(wait))
        return int(self.c.store.add(self.c.keys.epoch_arrivals(wait.epoch), 0))

    def _read_arrivals(self, wait: SurvivorWait) -> dict[int, Arrival]:
        """Every arrival written so far. NATS: one read. TCPStore (whose read of a missing
        key waits for it): the expected survivors' in one check and one read when they
        are all in (the common case: the counter said so), then the others key by key
        (a member excluded at the fault: usually none or one), else key by key (at the
        deadline). Was key by key always: 2N round trips in a row (issue 51)."""
        ranks = [m.rank for m in wait.prev.members]
        key = {r: self.c.keys.epoch_arrival(wait.epoch, r) for r in ranks}
        if self.c.watches:  # (NATS: what the closer's watch was pushed so far)
            if wait.watch is None:
                wait.watch = self.c.store.watch(self.c.keys.epoch_arrived(wait.epoch))
            seen = wait.watch.values()
            got = {r: seen.get(key[r]) for r in ranks}
            missing = [r for r in ranks if got[r] is None]
            if missing and self.c.clock() >= wait.deadline:  # (read before any is silent)
                again = self.c.store.read_many([key[r] for r in missing])
                got.update(zip(missing, again, strict=True))
        elif self.c.reads_many:
            got = dict(zip(ranks, self.c.store.read_many(list(key.values())), strict=True))
        else:
            got = {}
            expected = set(wait.expected)
            first = [r for r in ranks if r in expected]
            if first and self.c.store.check([key[r] for r in first]):
                batch = self.c.store.multi_get([key[r] for r in first])  # (forged: b"")
                got = {r: bytes(v) or None for r, v in zip(first, batch, strict=True)}
            for r in ranks:
                if r not in got:
                    got[r] = self.c.value(key[r])
        return {r: Arrival.from_json(v) for r, v in got.items() if v}

    def _try_close(self, wait: SurvivorWait, expected: list[int]) -> Round:
        prev, epoch, admit = wait.prev, wait.epoch, wait.admit
        timed_out = self.c.clock() >= wait.deadline
        now = self.c.clock()
        if self.c.reads_many:  # (NATS: every arrival in one read, less often as N grows)
            every = _POLL_S * (1.0 if self.c.watches else max(1.0, len(expected) / 16))
            if now - wait.read_at < every and not timed_out:
                return Round()
            wait.read_at = now
            wait.arrived = self._read_arrivals(wait)
        else:
            count = int(self.c.store.add(self.c.keys.epoch_arrivals(epoch), 0))
            seen = (count, tuple(expected))
            if seen != wait.counted and (count >= len(expected) or timed_out):
                wait.counted = seen  # (the counter says every arrival may be in: read them)
                wait.arrived = self._read_arrivals(wait)
            elif not timed_out and not set(expected) <= set(wait.arrived):
                return Round()  # (someone is missing, and nothing changed since the last read)
            # (everyone is in and the view could not close yet: it waits for joiners, whose
            # registrations change no count; read them every round. Kept to count changes,
            # a restart was found at the deadline: every restart cost 5 s)
        arrived = {  # (one that died after arriving is not waited for)
            r: a for r, a in wait.arrived.items() if Member(r, a.incarnation) not in self.c.dead
        }
        if not set(expected) <= set(arrived) and not timed_out:
            return Round()  # (before reading the joiners: the common case while waiting)
        # (timed out) the missing are silent: the agent kills them; they come back as joiners
        missing = frozenset(expected) - set(arrived) - wait.passed
        wait.passed |= missing
        lives = self.c.joiners()
        # (a newer life of a rank that arrived registered: the one that arrived is dead,
        # and this worker missed the notice; its agent restarts a rank only once it ended)
        arrived = {r: a for r, a in arrived.items() if lives.get(r, 0) <= a.incarnation}
        joiners = {r: inc for r, inc in lives.items() if r not in arrived}
        if self.c.k > 1:  # whole shard groups only (the rest of a broken one is going down)
            broken = broken_groups(prev, self.c.dead, self.c.k)
            arrived = {r: a for r, a in arrived.items() if r // self.c.k not in broken}
            whole = whole_groups([*arrived, *joiners], self.c.k)
            arrived = {r: a for r, a in arrived.items() if r in whole}
            joiners = {r: i for r, i in joiners.items() if r in whole}
        view = close_after(
            prev,
            arrived,
            joiners,
            expected=expected,
            timed_out=timed_out,
            admit=admit,
            min_members=self.c.min_members,
            recovery=Recovery() if holds_state(arrived) else self.c.recovery(),
        )
        if view is None:  # every expected survivor is in: fewer than min_members
            below = None
            if self.c.min_members < self.c.world_size:  # (a fixed world waits by design)
                below = (len(arrived) + len(joiners), self.c.min_members)
            return Round(silent=missing, below=below)
        return Round(
            view=self.c.close(view, {} if view.waiting else joiners, prev=prev), silent=missing
        )
