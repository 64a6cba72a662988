"""The store side of the runtime: one decision per (epoch, step), and epoch formation.

Decisions (S2; a step its collective decided never comes here: docs/architecture.md). A
member that finished a step votes by incrementing ``votes(e, s)``; the vote that completes
the count writes ``C`` into ``decision(e, s)`` by compare-and-set. A member that knows of
a fault writes ``R<reason>`` the same way (:mod:`.decisions`).

Epoch formation. Epoch ``E`` is *closed* when its member list is written into
``epoch_members(E)`` by compare-and-set; every worker adopts the list it reads. Survivors
of ``E-1`` mark their arrival (:mod:`.survivors`). A survivor left out becomes a joiner.
Joiners wait for a view that lists them, except when every slot is a joiner (the first
start, or every worker was lost): the lowest joiner then closes the epoch itself
(:mod:`.joiners`). The coordinator is what both roles share: the store clients, the
decision, the views and the joiner keys; each role's waits are its own module's.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Set
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from fastft.bus.signed import ForgedValue
from fastft.protocol.keys import JobKeys
from fastft.runtime.contract import EpochView, Member
from fastft.runtime.engine import decisions as d
from fastft.runtime.engine.formation import Recovery

if TYPE_CHECKING:
    from fastft.runtime.engine.voice import VoicePort

__all__ = ["DECISION_WAIT_S", "WATCH_FROM", "Coordinator", "form_wait_s"]

log = logging.getLogger(__name__)

_POLL_S = 0.002
DECISION_WAIT_S = 0.5
"""The decision store's timeout: how long one blocking read waits before its caller looks
whether to go on."""
_FORM_WAIT_MAX_S = 5.0
_CLEARERS = 32
"""Joiner keys a NATS closer clears at once."""


WATCH_FROM = 32
"""The world from which a closer on NATS watches keys rather than reading them."""


def form_wait_s(members: int) -> float:
    """How long a member blocks at once for the epoch it waits for: the decision store's
    timeout, growing with the world from 1,024 members (a wait that runs out is read
    again: N members polling every 0.5 s are 2N requests a second on a server the
    formation needs), at most 5 s."""
    return min(_FORM_WAIT_MAX_S, DECISION_WAIT_S * max(1.0, members / 1024))


class Coordinator:
    """Decisions and formations for one worker, over its own store client (the main
    thread's; the listener thread proposes rollbacks through a second client). The
    clients are a :class:`~fastft.bus.signed.SignedStore` in a job (values signed with the
    job secret), or plain store clients in tests."""

    def __init__(
        self,
        store: Any,
        keys: JobKeys,
        rank: int,
        incarnation: int,
        world_size: int,
        min_members: int,
        *,
        dead: Set[Member] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        decision_store: Any = None,
        recovery: Callable[[], Recovery] = Recovery,
        shard_size: int = 1,
    ) -> None:
        self.store = store
        self.k = shard_size
        """Workers per shard group: an epoch admits whole groups (:mod:`.hsdp`)."""
        self.decision_store = decision_store if decision_store is not None else store
        """Where members block for a decision; give it a short timeout (set_timeout): a
        wait that times out returns None and the caller checks whether to go on."""
        self.keys = keys
        self.me = Member(rank, incarnation)
        self.world_size = world_size
        self.min_members = min_members
        self.clock = clock
        self.sleep = sleep
        self.dead: Set[Member] = dead if dead is not None else set()
        """Lives known dead (the worker's one set, read here): never admitted as joiners."""
        self._joiner_keys_exist = False
        self.watches = hasattr(getattr(store, "raw", store), "watch") and world_size >= WATCH_FROM
        """The store pushes every write of a prefix's keys to a watch (NATS): the closer
        watches the arrivals and reads the joiners so, instead of key by key (from
        :data:`WATCH_FROM` members: below, a few reads cost less than a consumer)."""
        self.reads_many = hasattr(getattr(store, "raw", store), "read_many")
        """The store reads many keys in one round trip and its ``add`` is a compare-and-set
        loop (NATS): formations read arrivals instead of counting them."""
        self.recovery = recovery
        """What can replace a lost state (the durable tier's newest checkpoint): asked only
        when an epoch closes without a holder, or at a first start."""
        self.voice: VoicePort | None = None
        """The node's voice (:mod:`.voice`): arrivals handed to the agent, which writes
        them with its other workers' and waits for the closed epoch once for the node."""
        self.heard: dict[int, float] = {}
        """Epoch -> when a member of it last answered this joiner (a live epoch)."""

    def joiner_keys_made(self) -> None:
        """Every joiner key exists (this member made them: it closed the first start), so
        :meth:`joiners` reads them in one round trip without checking first."""
        self._joiner_keys_exist = True

    def answered(self, epoch: int) -> None:
        """A member of ``epoch`` answered this joiner's request (the bus listener): that
        epoch lives (:meth:`.joiners.Joiners.round` waits to be admitted to it)."""
        self.heard[epoch] = self.clock()

    # --- decisions -------------------------------------------------------------------------
    def vote(
        self,
        epoch: int,
        step: int,
        n_members: int,
        *,
        leaving: bool = False,
        joining: bool = False,
        ranks: tuple[int, ...] = (),
    ) -> str | None:
        """Vote yes; the completing vote proposes COMMIT and returns the decision that
        holds (a rollback may have landed first). Other votes return None: wait for it.

        ``joining``: this member saw a worker waiting to join. The vote then adds
        ``JOIN_FLAG + 1`` instead of 1, so the completing vote knows from the counter alone,
        with no extra round trip, whether any member asked, and decides ``CJ`` (commit,
        then re-form the epoch to admit) instead of ``C``.

        ``leaving``: this member drains after the step; it marks itself in the store, then
        adds ``LEAVE_FLAG``, so the completing vote (which knows the members, ``ranks``)
        names the leavers in the decision, ``C...L1,3``: every member re-forms without
        them after the commit, with nothing to roll back."""
        if leaving:
            self.store.set(self.keys.leaving(epoch, step, self.me.rank), "1")
        inc = 1 + (d.JOIN_FLAG if joining else 0) + (d.LEAVE_FLAG if leaving else 0)
        got = int(self.store.add(self.keys.votes(epoch, step), inc))
        joins = got % d.LEAVE_FLAG
        if joins % d.JOIN_FLAG > n_members or joins >= d.JOIN_FLAG * (n_members + 1):
            log.error(
                "the vote counter of epoch %d step %d reads %d with %d members: something "
                "that is not part of this job adds to it (docs/security.md)",
                epoch,
                step,
                got,
                n_members,
            )
        if joins % d.JOIN_FLAG == n_members:
            decision = d.COMMIT + (d.ADMIT if joins >= d.JOIN_FLAG else "")
            if got >= d.LEAVE_FLAG:
                leavers = [
                    r for r in ranks if self.store.check([self.keys.leaving(epoch, step, r)])
                ]
                decision += d.LEAVE + ",".join(map(str, leavers))
            return d.decide_once(self.store, self.keys.decision(epoch, step), decision)
        return None

    def confirm(self, epoch: int, step: int) -> str:
        """A collective's commit that came late (:class:`~fastft.fsm.GradsReady`), made the
        decision of (epoch, step) by compare-and-set: the decision that holds. A rollback
        proposed first holds (the others left the epoch while this member was cut off), as
        it does if the store cannot be reached (this member may still be cut off)."""
        try:
            return d.decide_once(self.store, self.keys.decision(epoch, step), d.COMMIT)
        except Exception as e:  # noqa: BLE001 - any store failure: not confirmed
            why = f"{type(e).__name__}: {e}".splitlines()[0]
            return f"{d.ROLLBACK}the commit could not be confirmed: {why}"[:200]

    def await_decision(self, epoch: int, step: int) -> str | None:
        """The decision of (epoch, step), or None if it was not made within the decision
        store's timeout (one blocking ``get``: the server answers when the key is set)."""
        try:
            got = self.decision_store.get(self.keys.decision(epoch, step))
        except dist.DistStoreError:
            return None
        except ForgedValue:  # no decision: wait for the one a member puts in its place
            self.sleep(_POLL_S)
            return None
        return bytes(got).decode(errors="replace")

    # --- epochs ----------------------------------------------------------------------------
    def value(self, key: str) -> bytes | None:
        """The value of ``key``; None when it is absent or forged (the signed store logs a
        forged one)."""
        if not self.store.check([key]):
            return None
        try:
            return bytes(self.store.get(key))
        except ForgedValue:
            return None

    def wait_value(self, key: str, timeout_s: float) -> bytes | None:
        """The value of ``key``, waiting for it up to ``timeout_s`` on the decision store
        (one blocking read); None if it did not come, or is forged."""
        ds = self.decision_store
        ds.set_timeout(datetime.timedelta(seconds=timeout_s))
        try:
            return bytes(ds.get(key))
        except (dist.DistStoreError, ForgedValue):
            return None
        finally:
            ds.set_timeout(datetime.timedelta(seconds=DECISION_WAIT_S))

    def latest_epoch(self) -> int:
        got = self.value(self.keys.latest_epoch)
        return int(got) if got else 0

    def closed(self, epoch: int) -> EpochView | None:
        got = self.value(self.keys.epoch_members(epoch))
        return EpochView.from_json(got) if got else None

    def committed_step(self, latest: int) -> int:
        """A lower bound of the committed step: the last closed epoch's, or the one the
        key collector recorded since."""
        prev = self.closed(latest) if latest else None
        got = [prev.step] if prev is not None else [0]
        committed = self.value(self.keys.committed)
        if committed:
            got.append(int(committed))
        return max(got)

    def finished_at(self) -> int | None:
        """The step at which a member closed after finishing the job, if one did."""
        got = self.value(self.keys.finished)
        return int(got) if got else None

    def register_joiner(self) -> None:
        """Its joiner key, and one more in the registrations' counter; NATS: the key only
        (an add is a compare-and-set loop there: N joiners at once wrote O(N^2) times,
        24 s at 256; rank 0 reads the keys instead: :meth:`.joiners.Joiners.registered`)."""
        self.store.set(self.keys.joiner(self.me.rank), str(self.me.incarnation))
        if not self.reads_many:
            self.store.add(self.keys.joined, 1)

    def joiners(self, exclude: frozenset[int] = frozenset()) -> dict[int, int]:
        """Registered joiners by rank -> incarnation (one round trip once the keys exist).
        A key holds an incarnation or "" once its worker was admitted or died: cleared by
        compare-and-set, never deleted (a ``get`` of a key that vanished after a ``check``
        blocks for the store's whole timeout)."""
        keys = [self.keys.joiner(r) for r in range(self.world_size)]
        if self.reads_many:  # (one round trip, no key made first)
            if self.watches:  # (the keys there, pushed by the server: none read one by one)
                there = self.store.read_prefix(self.keys.joiners)
                got = [there.get(k) for k in keys]
            else:
                got = self.store.read_many(keys)
            lives = {r: int(v) for r, v in enumerate(got) if v and r not in exclude}
            return {r: inc for r, inc in lives.items() if Member(r, inc) not in self.dead}
        if not self._joiner_keys_exist and not self.store.check(keys):
            for k in keys:  # (a rank that never registered: one after another, rare)
                try:
                    self.store.compare_set(k, "", "")  # creates "" if missing, else no change
                except ForgedValue:
                    pass  # (there, forged: read as no joiner below)
            self._joiner_keys_exist = True
        out = {}
        for r, raw in enumerate(self.store.multi_get(keys)):
            if r in exclude or not raw:
                continue
            inc = int(raw)
            if Member(r, inc) not in self.dead:
                out[r] = inc
        return out

    def close(
        self, view: EpochView, admitted: dict[int, int], prev: EpochView | None = None
    ) -> EpochView:
        """Close ``view.epoch`` with ``view`` unless another view closed it first; the
        closer clears the joiner keys of the joiners it ``admitted`` (rank -> incarnation)
        and writes the view as a change of ``prev`` (what the survivors wait for)."""
        got = d.decide_once(self.store, self.keys.epoch_members(view.epoch), view.to_json())
        agreed = EpochView.from_json(got)
        if agreed == view:
            if prev is not None:
                self.store.set(self.keys.epoch_change(view.epoch), view.change_from(prev))
            self.store.set(self.keys.latest_epoch, str(view.epoch))
            self.clear_joiners(admitted)
            log.info("closed epoch %d: %s", view.epoch, view.to_json())
        return agreed

    def clear_joiners(self, admitted: dict[int, int]) -> None:
        """Clear the joiner keys of the ``admitted`` lives (compare-and-set: a newer life's
        registration stays). NATS: many at once (a round trip is ~1 ms there: the first
        start's N one after another kept its closer 16 s at 16,384; the scale model)."""
        items = [(self.keys.joiner(r), str(inc)) for r, inc in admitted.items()]
        if self.reads_many and len(items) > 1:
            with ThreadPoolExecutor(min(_CLEARERS, len(items))) as pool:
                list(pool.map(lambda kv: self.store.compare_set(kv[0], kv[1], ""), items))
            return
        for key, inc in items:
            self.store.compare_set(key, inc, "")
