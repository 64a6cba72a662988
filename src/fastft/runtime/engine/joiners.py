"""A joiner's part in forming an epoch: a restarted worker (or every worker at the first
start) registers its joiner key and waits for a view that lists it; when every slot is a
joiner, the lowest closes the epoch itself (:func:`~.formation.close_first`).

Like :mod:`.survivors`, each round returns what its executor does (a :class:`JoinRound`:
announce itself on the bus, the job finished, the view); :meth:`Joiners.rounds` is the
blocking loop a worker iterates, and the simulator runs :meth:`Joiners.round` from its
scheduler.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from fastft.runtime.contract import EpochView
from fastft.runtime.engine.coordinator import Coordinator, form_wait_s
from fastft.runtime.engine.formation import JoinerWait, close_first
from fastft.runtime.groups.hsdp import whole_groups

__all__ = ["ALIVE_S", "ANNOUNCE_S", "BLOCK_FROM", "JoinRound", "Joiners"]

_POLL_S = 0.002
ALIVE_S = 1.0
"""A member's answer to a joiner's request (sent every 0.2 s) says its epoch lives this
long: a joiner never forms a world of its own meanwhile (:func:`close_first`)."""
ANNOUNCE_S = 0.2
"""How often a joiner asks the members of a live epoch to admit it (a join request)."""
BLOCK_FROM = 64
"""From this many workers a TCPStore first start's joiners block instead of polling."""
_SCAN_LATE_S = 0.25
"""After its timeout, how often a joiner reads every joiner key (the lowest closes)."""


@dataclass(frozen=True)
class JoinRound:
    """What one round of a joiner's wait asks of its executor."""

    view: EpochView | None = None
    """An epoch that lists this life closed (or it closed one): adopt it."""
    finished: int | None = None
    """The job finished at this step meanwhile: the worker ends (0)."""
    announce: bool = False
    """Ask the members to admit it (one join request on the bus; none before any epoch)."""


class Joiners:
    """One worker's joiner side of the formations, over its coordinator's store clients."""

    def __init__(self, coord: Coordinator) -> None:
        self.c = coord

    def register(self, start_timeout_s: float, regroup_timeout_s: float) -> JoinerWait:
        """Register as a joiner; the wait's state for :meth:`round`."""
        self.c.register_joiner()
        return JoinerWait(self.c.clock(), self.c.latest_epoch(), start_timeout_s, regroup_timeout_s)

    def rounds(self, wait: JoinerWait) -> Iterator[JoinRound]:
        """A joiner's wait as the rounds its executor carries out; the last carries the
        view or the step the job finished at. The executor stops iterating when it is
        cancelled."""
        c = self.c
        while True:
            r = self.round(wait)
            yield r
            if r.view is not None or r.finished is not None:
                return
            if wait.seen == 0 and c.me.rank != 0 and self._blocks_at_start():
                # The first start: block on the first epoch's view (the server answers
                # every waiter when it is written), a little longer as the world grows;
                # each wait that runs out is a round (polling every 10 ms x N/64, 1,024
                # workers made 18 requests each; the scale model).
                t0 = c.clock()
                got = c.wait_value(c.keys.epoch_members(1), form_wait_s(c.world_size))
                if got is not None and EpochView.from_json(got).has(c.me.rank, c.me.incarnation):
                    yield JoinRound(view=EpochView.from_json(got))
                    return
                if got is None and c.clock() - t0 < _POLL_S:
                    c.sleep(_POLL_S)  # (a forged value answers at once: no busy loop)
                continue
            # Rank 0 polls the registrations (10 ms apart, further from 1,024 workers; NATS:
            # it reads every joiner key, less often from 64); below BLOCK_FROM every joiner
            # polls so, further apart from 64; a restarted worker as the survivors do.
            per = 64 if c.reads_many or c.me.rank != 0 else 1024
            c.sleep(0.01 * max(1.0, c.world_size / per) if wait.seen == 0 else _POLL_S)

    def round(self, wait: JoinerWait) -> JoinRound:
        """One round of a joiner's wait: the closed epoch that lists this life, or the one
        it closes itself when every slot is a joiner (:func:`close_first`), or nothing
        yet; ``finished`` if the members finished meanwhile."""
        c = self.c
        now = c.clock()
        announce = now >= wait.announce_at and wait.seen > 0  # (no epoch yet: nobody to tell)
        if announce:
            wait.announce_at = now + ANNOUNCE_S
        done = c.finished_at()
        if done is not None:
            return JoinRound(finished=done)
        latest = c.latest_epoch()
        for e in range(max(wait.seen, 1), latest + 1):
            view = c.closed(e)
            if view is not None and view.has(c.me.rank, c.me.incarnation):
                return JoinRound(view=view, announce=announce)
        wait.seen = latest
        if not self._may_close(wait, now, latest):
            return JoinRound(announce=announce)
        return JoinRound(view=self._close(wait, now, latest), announce=announce)

    def _close(self, wait: JoinerWait, now: float, latest: int) -> EpochView | None:
        """Close the epoch after ``latest`` if this joiner is the one to (every slot a
        joiner, or enough of them past the timeout); the view if it lists this life."""
        c = self.c
        joiners = c.joiners()
        if c.k > 1:  # whole shard groups only
            whole = whole_groups(joiners, c.k)
            joiners = {r: i for r, i in joiners.items() if r in whole}
        arguments = dict(
            me=c.me.rank,
            latest=latest,
            world_size=c.world_size,
            min_members=c.min_members,
            waited_s=now - wait.started,
            start_timeout_s=wait.start_timeout_s,
            regroup_timeout_s=wait.regroup_timeout_s,
            # (a member of the latest epoch answered lately: it lives, busy or not)
            live=now - c.heard.get(latest, float("-inf")) < ALIVE_S,
        )
        view = close_first(joiners, **arguments)  # type: ignore[arg-type]
        if view is None:
            return None
        # this joiner closes: with what can replace the state
        view = close_first(
            joiners,
            **arguments,  # type: ignore[arg-type]
            last_step=c.committed_step(latest),
            recovery=c.recovery(),
        )
        assert view is not None
        agreed = c.close(view, joiners)
        return agreed if agreed.has(c.me.rank, c.me.incarnation) else None

    def _may_close(self, wait: JoinerWait, now: float, latest: int) -> bool:
        """Whether this joiner reads every joiner key now, to close if it is the one
        (:func:`close_first`): rank 0 once every slot may be a joiner (the registrations'
        counter), each a few times a second after the timeout. (Every joiner read every key
        every 10 ms: O(world^2); 1,024 did not form within 100 s: issue 35.)"""
        timeout = wait.start_timeout_s if latest == 0 else wait.regroup_timeout_s
        if now - wait.started > timeout:
            if now - wait.scanned < _SCAN_LATE_S:
                return False
            wait.scanned = now
            return True
        return self.c.me.rank == 0 and self.registered() >= self.c.world_size

    def registered(self) -> int:
        """How many joiners registered: TCPStore the counter (one request); NATS the
        joiner keys that hold a life, read at once."""
        c = self.c
        if c.reads_many:
            return len(c.joiners())
        return int(c.store.add(c.keys.joined, 0))

    def _blocks_at_start(self) -> bool:
        """Whether a first start's joiner blocks on the first view rather than polling:
        on NATS, and on TCPStore from :data:`BLOCK_FROM` workers, where polling costs the
        store more than what a TCPStore wait that times out may (its client reconnects:
        torch 2.13 stalled 1 in ~25 for 5 s in jobs)."""
        c = self.c
        if c.decision_store is c.store:
            return False
        return c.reads_many or c.world_size >= BLOCK_FROM
