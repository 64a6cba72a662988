"""Every store key fastft uses, named in one place.

All keys of one job live under ``fastft/{job}/``; the bus under ``.../bus/``. Keeping them
here makes the store's key space auditable: nothing else builds key strings.
"""

from __future__ import annotations

__all__ = ["JobKeys"]


class JobKeys:
    """Key names for one job."""

    def __init__(self, job: str) -> None:
        if not job or "/" in job:
            raise ValueError(f"job id {job!r} must be non-empty and contain no '/'")
        self.job = job
        self.root = f"fastft/{job}"
        self._signed = (f"{self.root}/rt/", f"{self.root}/ep/", f"{self.root}/join/")
        self._signed_exact = (
            f"{self.root}/committed",
            f"{self.root}/finished",
            f"{self.root}/failed",
        )

    def signed(self, key: str) -> bool:
        """Whether ``key``'s value carries the job secret's tag (``fastft.bus.signed``):
        decisions, drain marks, epochs and arrivals, joiners, the committed, finished and
        failed marks, node marks, lives and beat servers. Counters (votes, leases) and the bus's and process
        groups' keys do not."""
        if key.startswith(self._signed):
            return not key.endswith("/votes")
        if key in self._signed_exact:
            return True
        return key.startswith(f"{self.root}/node/") and key.endswith(("/lost", "/lives", "/beats"))

    # --- error bus -------------------------------------------------------------------------
    @property
    def bus_members(self) -> str:
        """Encoded set of live subscriber ids; updated by compare-and-set."""
        return f"{self.root}/bus/members"

    def bus_queue(self, subscriber: str) -> str:
        """The FIFO queue of one subscriber."""
        return f"{self.root}/bus/q/{subscriber}"

    def bus_alive(self, subscriber: str) -> str:
        """A counter the subscriber's reader bumps while it reads (eviction checks it)."""
        return f"{self.root}/bus/alive/{subscriber}"

    @property
    def bus_ids(self) -> str:
        """Counter that hands out subscriber ids."""
        return f"{self.root}/bus/next_id"

    # --- runtime: decisions and epochs ----------------------------------------------------
    def votes(self, epoch: int, step: int) -> str:
        """Counter of yes-votes for (epoch, step)."""
        return f"{self.root}/rt/{epoch}/{step}/votes"

    def decision(self, epoch: int, step: int) -> str:
        """The one decision of (epoch, step): ``C`` (commit) or ``R...`` (rollback, reason);
        written once by compare-and-set."""
        return f"{self.root}/rt/{epoch}/{step}/decision"

    def leaving(self, epoch: int, step: int, rank: int) -> str:
        """Set when ``rank`` voted yes for (epoch, step) with a drain request."""
        return f"{self.root}/rt/{epoch}/{step}/leaving/{rank}"

    @property
    def latest_epoch(self) -> str:
        """Number of the newest formed epoch (absent before the first)."""
        return f"{self.root}/ep/latest"

    def epoch_members(self, epoch: int) -> str:
        """The agreed member list of ``epoch`` (JSON), written once by compare-and-set."""
        return f"{self.root}/ep/{epoch}/members"

    def epoch_change(self, epoch: int) -> str:
        """The view of ``epoch`` as a change of the one before it (who left, who joined:
        :meth:`fastft.runtime.contract.EpochView.change_from`), written by its closer: what
        a survivor, which holds the previous view, waits for (a few bytes, not N members')."""
        return f"{self.root}/ep/{epoch}/change"

    def epoch_closer(self, epoch: int) -> str:
        """A counter the closer of ``epoch`` adds to while it works (its beat: a closer that
        makes progress is not passed over, however long the formation takes)."""
        return f"{self.root}/ep/{epoch}/closer"

    def epoch_arrival(self, epoch: int, rank: int) -> str:
        """A member of the previous epoch arrived at the formation of ``epoch``."""
        return f"{self.epoch_arrived(epoch)}{rank}"

    def epoch_arrived(self, epoch: int) -> str:
        """The prefix of every arrival key of ``epoch`` (NATS: the closer watches it)."""
        return f"{self.root}/ep/{epoch}/arrived/"

    def epoch_first(self, epoch: int) -> str:
        """The rank that arrived first at the formation of ``epoch`` (by compare-and-set,
        where an add is a compare-and-set loop: NATS)."""
        return f"{self.root}/ep/{epoch}/first"

    def epoch_arrivals(self, epoch: int) -> str:
        """How many arrivals the formation of ``epoch`` counted (a counter: its closer reads
        the arrival keys once it says they may all be there)."""
        return f"{self.root}/ep/{epoch}/arrivals"

    @property
    def committed(self) -> str:
        """A lower bound of the job's committed step (set off the training path)."""
        return f"{self.root}/committed"

    def end_sums(self, epoch: int, step: int, rank: int) -> str:
        """A member's replica checksums at the job's end, in ``epoch`` after ``step``
        committed (:mod:`fastft.runtime.endcheck`)."""
        return f"{self.root}/rt/end/{epoch}/{step}/{rank}"

    @property
    def finished(self) -> str:
        """Set (to the final step) by a member that closed after its last committed step:
        a worker still waiting to join learns there is nothing left to join."""
        return f"{self.root}/finished"

    @property
    def started(self) -> str:
        """When the job began (wall clock, seconds), set once (compare-and-set from "") by
        its first agent: every worker's ``ft.elapsed_s`` counts from it."""
        return f"{self.root}/started"

    @property
    def first_lives(self) -> str:
        """The base of the first lives' incarnations (rank ``r``'s is base + r), set once
        by the job's first agent: a first start's view is one run (issue 64)."""
        return f"{self.root}/first-lives"

    def node_first(self, node: int) -> str:
        """Set once by the first agent of ``node``: a later one (a standby, an agent
        started again) draws its lives' incarnations afresh."""
        return f"{self.root}/node/{node}/first"

    @property
    def settings(self) -> str:
        """The settings every node must share (JSON), set once by the first agent; a later
        agent with others fails at its start (``fastft.launch.control``)."""
        return f"{self.root}/settings"

    @property
    def failed(self) -> str:
        """Set once (compare-and-set from "") by the first agent of a multi-node job that
        fails, to why: every other agent's lease round reads it and ends its node too."""
        return f"{self.root}/failed"

    @property
    def slots_gone(self) -> str:
        """A counter: the job's worker slots done for good while it ran (drained, shrunk,
        quarantined), across every node: how far an elastic world is from its floor."""
        return f"{self.root}/slots_gone"

    def joiner(self, rank: int) -> str:
        """A started or restarted worker waiting to be admitted (its incarnation)."""
        return f"{self.joiners}{rank}"

    @property
    def joiners(self) -> str:
        """The prefix of every joiner key (NATS: the closer reads them pushed)."""
        return f"{self.root}/join/"

    @property
    def joined(self) -> str:
        """A counter: registrations as a joiner, ever (a hint that every slot may be there:
        only then does the lowest joiner read every joiner key)."""
        return f"{self.root}/join/count"

    def pg_prefix(self, epoch: int) -> str:
        """Store prefix of the data-plane process group of ``epoch``."""
        return f"{self.root}/pg/{epoch}/"

    # --- node liveness (fastft.launch.nodes.lease) ----------------------------------------------
    def node_lease(self, node: int) -> str:
        """A counter the node's agent increments every heartbeat."""
        return f"{self.root}/node/{node}/lease"

    def node_computes(self, node: int) -> str:
        """The node's workers' recent compute per step, for the straggler check
        (:mod:`fastft.launch.gray.stragglers`): ``{rank: [incarnation, seconds]}``."""
        return f"{self.root}/node/{node}/computes"

    def node_beats(self, node: int) -> str:
        """HOST:PORT of the node's beat server (:mod:`fastft.launch.nodes.peerbeats`)."""
        return f"{self.root}/node/{node}/beats"

    def node_probe(self, node: int) -> str:
        """HOST:PORT of the node's probe server (:mod:`fastft.launch.gray.links`)."""
        return f"{self.root}/node/{node}/probe"

    @property
    def probe_round(self) -> str:
        """The last probe round node 0's agent asked for (a number; "" before any)."""
        return f"{self.root}/probe/round"

    def probe_result(self, round_: int, node: int) -> str:
        """``node``'s probe times in round ``round_``: ``{peer: seconds}``."""
        return f"{self.root}/probe/{round_}/{node}"

    def node_lost(self, node: int) -> str:
        """Set by compare-and-set by the agent that declared ``node`` lost
        (``counter@declarer``, or ``done`` once its agent finished); the node's agent
        clears a declaration once it has fenced its workers."""
        return f"{self.root}/node/{node}/lost"

    def node_lives(self, node: int) -> str:
        """The node's workers: ``rank:incarnation,...`` (written at every spawn)."""
        return f"{self.root}/node/{node}/lives"
