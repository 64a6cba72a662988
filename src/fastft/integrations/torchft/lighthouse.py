"""A torchft lighthouse that listens to the error bus.

It speaks torchft's ``LighthouseService`` (gRPC: ``Quorum``, ``Heartbeat``), so an unchanged
torchft ``Manager`` uses it like torchft's own lighthouse, and decides quorums by torchft's
rule with torchft's default settings (:mod:`.quorum`). The differences: deaths the node
agents see (a process exit, a stop, a hang they kill) reach it over the bus, and that
replica is out of the next quorum at once instead of ``heartbeat_timeout`` later; and a
quorum after a failed commit gets a new id, so every member rebuilds its communicator.

``fastft run --torchft`` starts one on node 0 (127.0.0.1 for a single-node job). The
protobuf messages are built at run time from their field numbers; fields this module does
not know (newer torchft releases add some to ``QuorumMember``) are kept as received and
sent back unchanged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent import futures
from typing import Any

from fastft.integrations.torchft.quorum import (
    LighthouseOptions,
    QuorumMember,
    QuorumState,
    compute_quorum,
    parse_replica_id,
    quorum_changed,
)
from fastft.protocol.faults import fault_of
from fastft.protocol.messages import (
    Message,
    Severity,
)

__all__ = ["BusLighthouse"]

log = logging.getLogger(__name__)


def _messages() -> dict[str, Any]:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, timestamp_pb2

    F = descriptor_pb2.FieldDescriptorProto
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
    fdp = descriptor_pb2.FileDescriptorProto(
        name="fastft_torchft_lighthouse.proto",
        package="torchft",
        syntax="proto3",
        dependency=["google/protobuf/timestamp.proto"],
    )

    def msg(name: str, *fields: tuple[str, int, int, str | None, bool]) -> None:
        d = fdp.message_type.add(name=name)
        for fname, num, ftype, tname, repeated in fields:
            f = d.field.add(name=fname, number=num, type=ftype)
            f.label = F.LABEL_REPEATED if repeated else F.LABEL_OPTIONAL
            if tname:
                f.type_name = tname

    S, I64, U64, B, M = F.TYPE_STRING, F.TYPE_INT64, F.TYPE_UINT64, F.TYPE_BOOL, F.TYPE_MESSAGE
    msg(
        "QuorumMember",
        ("replica_id", 1, S, None, False),
        ("address", 2, S, None, False),
        ("store_address", 3, S, None, False),
        ("step", 4, I64, None, False),
        ("world_size", 5, U64, None, False),
        ("shrink_only", 6, B, None, False),
        ("data", 7, S, None, False),
        ("commit_failures", 8, I64, None, False),
    )
    msg(
        "Quorum",
        ("quorum_id", 1, I64, None, False),
        ("participants", 2, M, ".torchft.QuorumMember", True),
        ("created", 3, M, ".google.protobuf.Timestamp", False),
    )
    msg("LighthouseQuorumRequest", ("requester", 1, M, ".torchft.QuorumMember", False))
    msg("LighthouseQuorumResponse", ("quorum", 1, M, ".torchft.Quorum", False))
    msg("LighthouseHeartbeatRequest", ("replica_id", 1, S, None, False))
    msg("LighthouseHeartbeatResponse")
    pool.Add(fdp)
    return {
        d.name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"torchft.{d.name}"))
        for d in fdp.message_type
    }


class BusLighthouse:
    """torchft's lighthouse service on ``bind`` (``host:port``; port 0: the OS picks).

    :meth:`on_message` is an error-bus callback: feed it every bus message (the agent
    does). ``emit(kind, **fields)`` receives one event per quorum issued and per replica
    marked dead. ManagerFFTs that reuse their quorum do not ask the lighthouse until told,
    so it tells them (callbacks run under the lighthouse's lock: keep them short):
    ``on_join(replica_id)`` when a replica outside the last quorum waits to join (the
    lighthouse process broadcasts a :class:`JoinRequest`), and ``on_waiting(replica_id,
    step, quorum_id)`` when a member of the last quorum waits for ``step`` and the quorum
    cannot be formed at once, once per quorum (a :class:`RollbackRequest`: peers in a
    reused step at or past ``step`` void it, since that member is in none of its
    collectives).
    """

    def __init__(
        self,
        bind: str = "127.0.0.1:0",
        options: LighthouseOptions | None = None,
        *,
        emit: Callable[..., None] | None = None,
        on_join: Callable[[str], None] | None = None,
        on_waiting: Callable[[str, int, int], None] | None = None,
        max_workers: int = 256,
    ) -> None:
        import grpc

        self.options = options or LighthouseOptions()
        self._emit = emit or (lambda kind, **f: None)
        self._on_join = on_join
        self._on_waiting = on_waiting
        self._announced: set[str] = set()
        """Joiners announced since the last quorum issued."""
        self._waiting_told = False
        """A member waiting was announced since the last quorum issued."""
        self._pb = _messages()
        self._state = QuorumState()
        self._dead_lives: set[tuple[int, int]] = set()
        self._cond = threading.Condition()
        self._gen = 0
        self._issued: deque[tuple[int, Any, frozenset[str]]] = deque(maxlen=64)
        self._stop = threading.Event()
        pb = self._pb
        handler = grpc.method_handlers_generic_handler(
            "torchft.LighthouseService",
            {
                "Quorum": grpc.unary_unary_rpc_method_handler(
                    self._quorum,
                    request_deserializer=pb["LighthouseQuorumRequest"].FromString,
                    response_serializer=pb["LighthouseQuorumResponse"].SerializeToString,
                ),
                "Heartbeat": grpc.unary_unary_rpc_method_handler(
                    self._heartbeat,
                    request_deserializer=pb["LighthouseHeartbeatRequest"].FromString,
                    response_serializer=pb["LighthouseHeartbeatResponse"].SerializeToString,
                ),
            },
        )
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers))
        self._server.add_generic_rpc_handlers((handler,))
        host = bind.rpartition(":")[0] or "127.0.0.1"
        self.port = self._server.add_insecure_port(bind)
        if not self.port:
            raise OSError(f"lighthouse: cannot bind {bind!r}")
        self.host = host.strip("[]")
        self._ticker = threading.Thread(
            target=self._tick_loop, name="fastft-lighthouse", daemon=True
        )

    @property
    def address(self) -> str:
        """What workers put in ``TORCHFT_LIGHTHOUSE``."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> BusLighthouse:
        self._server.start()
        self._ticker.start()
        return self

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._server.stop(grace=0)

    def __enter__(self) -> BusLighthouse:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the bus ---------------------------------------------------------------------------
    def on_message(self, m: Message) -> None:
        r = fault_of(m)
        # An exit, a stop or a hang (its agent kills it), a replica declared dead by
        # peers, or its own report that it is dying (ManagerFFT's uncaught-exception
        # hook): either way that life is over. A Fault2 is a report of one step.
        if r is not None and r.severity is Severity.FAULT1:
            self.mark_dead(r.rank, r.incarnation, r.cause)

    def mark_dead(self, rank: int, incarnation: int, why: str = "") -> None:
        """Replica life (rank, incarnation) is gone: unhealthy now, and re-run the quorum."""
        with self._cond:
            if (rank, incarnation) in self._dead_lives:
                return
            self._dead_lives.add((rank, incarnation))
            gone = [r for r in self._state.heartbeats if parse_replica_id(r) == (rank, incarnation)]
            for r in gone:
                self._state.dead.add(r)
                self._state.participants.pop(r, None)
            self._tick_locked()
        self._emit("lighthouse_dead", rank=rank, incarnation=incarnation, why=why, replicas=gone)

    # --- service ---------------------------------------------------------------------------
    def _seen(self, replica_id: str, now: float) -> bool:
        """Record a sign of life; False if that life was reported dead."""
        if parse_replica_id(replica_id) in self._dead_lives:
            self._state.dead.add(replica_id)
            return False
        self._state.heartbeats[replica_id] = now
        return True

    def _heartbeat(self, req: Any, ctx: Any) -> Any:
        with self._cond:
            self._seen(req.replica_id, time.monotonic())
        return self._pb["LighthouseHeartbeatResponse"]()

    def _quorum(self, req: Any, ctx: Any) -> Any:
        import grpc

        r = req.requester
        rid = r.replica_id
        if not rid:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "missing requester")
        member = QuorumMember(
            rid, int(r.step), bool(r.shrink_only), r.SerializeToString(), int(r.commit_failures)
        )
        with self._cond:
            gen = self._gen
            if self._seen(rid, time.monotonic()):
                self._state.participants[rid] = (time.monotonic(), member)
            self._tick_locked()
            self._announce_locked(rid, member.step)
            while not self._stop.is_set():
                for g, quorum, ids in list(self._issued):
                    if g <= gen:
                        continue
                    gen = g
                    if rid in ids:
                        return self._pb["LighthouseQuorumResponse"](quorum=quorum)
                    # Not in it: ask again for the next one (torchft does the same).
                    if rid not in self._state.dead:
                        self._state.participants[rid] = (time.monotonic(), member)
                        self._announce_locked(rid, member.step)
                remaining = ctx.time_remaining()
                if remaining is not None and remaining <= 0 or not ctx.is_active():
                    ctx.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no quorum in time")
                self._cond.wait(0.5 if remaining is None else min(0.5, remaining))
        ctx.abort(grpc.StatusCode.UNAVAILABLE, "lighthouse stopping")
        raise AssertionError("unreachable")

    def _announce_locked(self, rid: str, step: int) -> None:
        """``rid`` asked and no quorum took it at once: tell the members that reuse their
        quorum, if ``rid`` was outside the last quorum (a joiner, once each per quorum
        issued) or is the first member of it to wait (once per quorum issued)."""
        st = self._state
        if rid not in st.participants or st.prev is None:
            return
        try:
            if not any(m.replica_id == rid for m in st.prev):
                if self._on_join is not None and rid not in self._announced:
                    self._announced.add(rid)
                    self._on_join(rid)
            elif self._on_waiting is not None and not self._waiting_told:
                self._waiting_told = True
                self._on_waiting(rid, step, st.quorum_id)
        except Exception:
            log.exception("could not announce %s waiting", rid)

    def _tick_loop(self) -> None:
        period = self.options.quorum_tick_ms / 1000
        while not self._stop.wait(period):
            with self._cond:
                self._tick_locked()

    def _tick_locked(self) -> None:
        st = self._state
        members, why = compute_quorum(time.monotonic(), st, self.options)
        if members is None:
            log.debug("no quorum yet: %s", why)
            return
        changed = quorum_changed(members, st.prev)
        if changed:
            st.quorum_id += 1
        pb = self._pb
        quorum = pb["Quorum"](quorum_id=st.quorum_id)
        for m in members:
            quorum.participants.append(pb["QuorumMember"].FromString(m.raw))
        quorum.created.GetCurrentTime()
        st.prev = members
        st.participants.clear()
        self._announced.clear()
        self._waiting_told = False
        self._gen += 1
        self._issued.append((self._gen, quorum, frozenset(m.replica_id for m in members)))
        self._cond.notify_all()
        if not changed:
            return
        log.info("quorum %d: %s (%s)", st.quorum_id, [m.replica_id for m in members], why)
        self._emit(
            "lighthouse_quorum",
            quorum_id=st.quorum_id,
            members=[m.replica_id for m in members],
            steps=[m.step for m in members],
            why=why,
        )


def lighthouse_key(job: str) -> str:
    """Store key where the running lighthouse publishes its address."""
    return f"fastft/{job}/torchft/lighthouse"
