"""Node leases as beats from agent to agent (issue 64), on the TCPStore plane of a large job.

A TCPStore's one thread serves a request in ~50 µs here: one renewal per agent per 100 ms
round is all of it at 2,048 nodes, before a single read (the scale model: 103 % busy, 3.3
rounds a second). Here each agent runs a beat server (a TCP port the OS picks on the
address it reaches the store from; ``node_beats`` in the store); the agents that watch its
node connect to it, and it writes every beat (the signed message of the NATS plane's
beats, :mod:`fastft.launch.nodes.beats`) to each of them. The store serves only the marks'
backstop reads (:class:`~fastft.launch.nodes.beatlease.BeatLease`) and, at a declaration,
the compare-and-set that decides it (:class:`PeerLease`): a watcher that cannot reach the
store (the one cut off) declares nobody, and of several watchers one wins.

TCP, not UDP: a beat on a congested or throttled link is late, as a store request from that
node would be, and is never dropped while the link carries the job's traffic (a datagram is
dropped at a full queue: a node declared lost for a busy link). A beat never waits, and
none waits behind a lost one: each watcher holds :data:`~fastft.launch.nodes.renewer.
RENEWERS` connections to the node (each introduced by a signed hello), and each beat goes on
the one with the least in flight (``SIOCOUTQ``), as the store's renewals go on idle clients
(issue 60, case 6: a packet lost in a 100-200 ms flap waits for TCP's retransmission, at
least 200 ms, and all sent behind it too). A watcher whose socket buffer is full misses
the beat (that connection is closed and made again). A connection that ends is made again,
the node's address read again (a node's new agent listens on a new port). Up the same connection a watcher tells
the node it declared it lost, and the node fences at once; a node that is done tells its
watchers so before its beats stop.
"""

from __future__ import annotations

import datetime
import fcntl
import logging
import selectors
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable
from typing import Any

from fastft.bus.tcpstore import address_toward
from fastft.launch.nodes.beatlease import BeatLease
from fastft.launch.nodes.beats import Beat, Beats, beat_subject, decode, encode
from fastft.launch.nodes.renewer import RENEWERS
from fastft.launch.rules.leasewatch import DONE, watched
from fastft.launch.rules.lives import mark_lost
from fastft.protocol.keys import JobKeys

__all__ = ["PEERS_ABOVE", "PeerBeats", "PeerLease", "peer_beats"]

log = logging.getLogger(__name__)

PEERS_ABOVE = 256
"""``--node-beats auto``: beats from agent to agent above this many nodes (the store's
renewals alone would be ~25 % of its thread at 100 ms), through the store up to it."""
MAX_FRAME = 4096
"""A frame longer than this is no beat: its connection is closed (counted as forged)."""
HELLO = "watch"
"""A watcher's first frame on each connection (signed, its node as the beat's): the node
sends each beat on one of that watcher's connections, not on all."""
_LEN = struct.Struct(">I")


def _in_flight(sock: socket.socket) -> int:
    """Bytes sent on ``sock`` not yet acknowledged (``SIOCOUTQ``; 0 where not told)."""
    try:
        got = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
        return int(struct.unpack("i", got)[0])
    except OSError:
        return 0


def peer_beats(mode: str, nnodes: int) -> bool:
    """Whether a TCPStore job's agents beat to each other (``--node-beats``)."""
    return mode == "peers" or (mode == "auto" and nnodes > PEERS_ABOVE)


class _Conn:
    """One connection: a watcher's to a node (``node``), or a node's from a watcher (-1;
    ``watcher``: its node once its hello came)."""

    def __init__(self, sock: socket.socket, node: int) -> None:
        self.sock = sock
        self.node = node
        self.watcher = -1
        self.buf = bytearray()


class PeerBeats(Beats):
    """This agent's beat server and its connections to the nodes it watches (see the
    module); the rest is :class:`~fastft.launch.nodes.beats.Beats`'. ``store``: the job's
    (a client of its own is cloned), ``toward``: the store's address (the server listens
    on the address that reaches it)."""

    def __init__(
        self,
        store: Any,
        keys: JobKeys,
        node: int,
        sign: Callable[[str, str], str],
        verify: Callable[[str, bytes], str | None],
        *,
        toward: str,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__([], keys.job, node, sign, verify, timeout_s=timeout_s, clock=clock)
        self.keys = keys
        self.store = store.clone()
        self._server = socket.create_server((address_toward(toward), 0))
        self._server.setblocking(False)
        host, port = self._server.getsockname()[:2]
        self.address = f"{host}:{port}"
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._server, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._watchers: list[_Conn] = []
        """Connections from the agents that watch this node (several each: a beat goes on
        one of each watcher's)."""
        self._to: dict[int, list[_Conn]] = {}
        """This agent's connections to each node it watches."""
        self._want: list[int] = []
        """The nodes to watch, as the rounds last said (the dialer connects to them)."""
        self._dial = threading.Event()
        self._closed = threading.Event()
        self.store.set_timeout(datetime.timedelta(seconds=max(timeout_s, 1.0)))
        self.store.set(keys.node_beats(node), self.address)
        self._threads = [
            threading.Thread(target=self._loop, name="fastft-peer-beats", daemon=True),
            threading.Thread(target=self._dialer, name="fastft-peer-dial", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # --- sending ---------------------------------------------------------------------------
    def sends(self) -> list[Callable[[], None]]:
        return [self.beat]  # (never waits: one "connection" for the renewer)

    def beat(self) -> None:
        if self._closed.is_set():
            return
        with self._lock:
            self._counter += 1
            beat = Beat(self.node, self._counter, self._lives)
            watchers = list(self._watchers)
        frame = self._frame(beat)
        groups: dict[int, list[_Conn]] = {}
        for c in watchers:  # (one beat per watcher: on a connection with nothing in flight)
            groups.setdefault(c.watcher if c.watcher >= 0 else -id(c), []).append(c)
        for conns in groups.values():
            self._write(min(conns, key=lambda c: _in_flight(c.sock)), frame)

    def declare(self, node: int, mark: str) -> None:
        """Tell ``node`` it was declared lost (up this agent's connection to it), or, for
        this node (``DONE``), tell its watchers."""
        with self._lock:
            self._declared[node] = mark
            to = list(self._watchers) if node == self.node else self._to.get(node, [])[:1]
        frame = self._frame(Beat(node, 0, lost=mark))
        for c in to:
            self._write(c, frame)

    def _frame(self, beat: Beat, about: int | None = None) -> bytes:
        """``beat`` framed, signed for the subject of ``about`` (its own node's else)."""
        subject = beat_subject(self.job, beat.node if about is None else about)
        data = encode(beat, self.sign, subject)
        return _LEN.pack(len(data)) + data

    def _write(self, c: _Conn, frame: bytes) -> None:
        try:
            sent = c.sock.send(frame, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except BlockingIOError:
            sent = 0
        except OSError:
            sent = -1
        if sent != len(frame):  # (a full buffer or a broken path: made again)
            self._kill(c)

    def _kill(self, c: _Conn) -> None:
        """No more beats on ``c``: a watcher's is closed by the loop (its read ends), a
        watched node's now (only the rounds' thread reads or writes it), and the dialer
        makes it again."""
        with self._lock:
            if c in self._watchers:
                self._watchers.remove(c)
            if c.node >= 0 and c in self._to.get(c.node, []):
                self._to[c.node].remove(c)
                if not self._to[c.node]:
                    del self._to[c.node]
        try:
            c.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if c.node >= 0:
            c.sock.close()
        self._dial.set()

    # --- hearing ---------------------------------------------------------------------------
    def watch(self, nodes: list[int]) -> None:
        """Watch ``nodes`` (the rounds' thread: it never waits here; the dialer connects)."""
        want = [n for n in nodes if n != self.node]
        with self._lock:
            changed = want != self._want or any(len(self._to.get(n, [])) < RENEWERS for n in want)
            self._want = want
        if changed:
            self._dial.set()

    def _dialer(self) -> None:
        """Connect to the beat servers of the watched nodes not connected yet, their
        addresses read from the store (a thread of its own: a connection to a host that is
        gone waits a lease, and a store read may wait; neither holds up a round or a beat
        heard). One not there yet, or refused, is tried again a lease later."""
        retry: dict[int, float] = {}
        while not self._closed.is_set():
            self._dial.wait(self.timeout_s)
            self._dial.clear()
            with self._lock:
                todo = [n for n in self._want if len(self._to.get(n, [])) < RENEWERS]
            now = self.clock()
            for n in todo:
                if retry.get(n, 0.0) > now or self._closed.is_set():
                    continue
                retry[n] = now + self.timeout_s
                with self._lock:
                    have = len(self._to.get(n, []))
                for _ in range(RENEWERS - have):
                    c = self._connect(n)
                    if c is None:
                        break
                    with self._lock:
                        if n not in self._to:  # (a node's new agent counts from 1 again:
                            self._heard.pop(n, None)  # its beats are heard from the first)
                        self._to.setdefault(n, []).append(c)

    def _connect(self, n: int) -> _Conn | None:
        try:
            key = self.keys.node_beats(n)
            if not self.store.check([key]):
                return None
            host, _, port = bytes(self.store.get(key)).decode().rpartition(":")
            sock = socket.create_connection((host, int(port)), timeout=self.timeout_s)
            sock.sendall(self._frame(Beat(self.node, 0, lost=HELLO), about=n))
        except Exception as e:  # (not started, gone, or the store slow: next time)
            log.debug("peer beats: node %d not reached: %s", n, e)
            return None
        sock.setblocking(False)
        return _Conn(sock, n)

    def silent_for(self) -> float:
        """Never "cut off" by silence in a round: a watcher's declaration is the store's to
        decide (:class:`PeerLease`), which one cut off cannot reach."""
        return 0.0

    def quiet_for(self) -> float:
        """Seconds since a beat of any watched node was heard."""
        return super().silent_for()

    def heard(self, nodes: list[int]) -> dict[int, int]:
        """:meth:`counters` as last taken in (from any thread: it reads no connection)."""
        return super().counters(nodes)

    def _loop(self) -> None:
        while not self._closed.is_set():
            try:
                events = self._sel.select(timeout=1.0)
            except OSError:
                return  # (closed)
            for key, _ in events:
                if key.fileobj is self._server:
                    self._accept()
                elif key.fileobj is self._wake_r:
                    try:
                        self._wake_r.recv(4096)
                    except OSError:
                        pass
                else:
                    self._read(key.data)

    def _accept(self) -> None:
        try:
            sock, _ = self._server.accept()
        except OSError:
            return
        sock.setblocking(False)
        c = _Conn(sock, -1)
        self._sel.register(sock, selectors.EVENT_READ, c)
        with self._lock:
            self._watchers.append(c)

    def _read(self, c: _Conn) -> None:
        """A watcher's connection is readable (the loop's thread)."""
        if not self._receive(c):
            self._drop(c)

    def counters(self, nodes: list[int]) -> dict[int, int]:
        """The beats that arrived are taken in first, in the caller's thread (the rounds'):
        a round judges what the network delivered, not what a busy thread got to (a store's
        counter is read in the round as well)."""
        with self._lock:
            to = [c for conns in self._to.values() for c in conns]
        for c in to:
            if not self._receive(c):
                self._kill(c)
        return super().counters(nodes)

    def _receive(self, c: _Conn) -> bool:
        """Take in what ``c`` holds (never waits); False once it ended or sent no beat."""
        while True:
            try:
                data = c.sock.recv(65536)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not data:
                return False
            c.buf += data
            while len(c.buf) >= _LEN.size:
                (n,) = _LEN.unpack_from(c.buf)
                if n > MAX_FRAME:
                    with self._lock:
                        self.forged += 1
                    return False
                if len(c.buf) < _LEN.size + n:
                    break
                raw = bytes(c.buf[_LEN.size : _LEN.size + n])
                del c.buf[: _LEN.size + n]
                # (from a watcher: its hello, or a declaration of this node; from a node:
                # its beats)
                subject = beat_subject(self.job, self.node if c.node < 0 else c.node)
                if c.node < 0:
                    hello = decode(raw, self.verify, subject)
                    if hello is not None and hello.lost == HELLO:
                        c.watcher = hello.node if c.watcher < 0 else c.watcher
                        continue
                self._heard_msg(subject, raw)

    def _drop(self, c: _Conn) -> None:
        """Close ``c`` (the loop's thread only)."""
        self._kill(c)
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError, OSError):
            pass
        c.sock.close()

    def stop(self) -> None:
        """No more beats; the threads end (:meth:`close` waits for them)."""
        self._closed.set()
        self._dial.set()
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    def close(self) -> None:
        if self._server.fileno() < 0:
            return  # (closed already)
        self.stop()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(self.timeout_s + 2.0)
        with self._lock:
            conns = [*self._watchers, *(c for cs in self._to.values() for c in cs)]
        for c in conns:
            c.sock.close()
        for sock in (self._server, self._wake_r, self._wake_w):
            sock.close()
        self._sel.close()


class PeerLease(BeatLease):
    """:class:`~fastft.launch.nodes.beatlease.BeatLease` over :class:`PeerBeats` (or the
    scale model's), on a TCPStore: a declaration is the store's compare-and-set first, as
    :class:`~fastft.launch.nodes.lease.NodeLease`'s (the store answers in microseconds,
    and a watcher cut off from it must declare nobody), then told to the node itself.

    A watcher whose store did not answer (a declaration's compare-and-set or a marks read
    failed) was likely the one cut off: what it last heard of the others is stale, and
    their beats reach it again only after TCP's backed-off retransmissions (seconds after
    a cut of seconds). Until a node's counter moves past what it was then, this agent does
    not declare it (tests/net: a node cut for 2 s declared both others once its link
    returned, and the job failed); a node that did die then is declared by its other
    watchers."""

    _doubt: dict[int, int] | None = None
    """Since this agent's store failed: each watched node's counter then."""

    def _doubted(self) -> None:
        nodes = watched(self.node, self.nnodes, self.marks, self.watchers)
        heard = getattr(self.beats, "heard", self.beats.counters)(nodes)  # (any thread's)
        self._doubt = {**heard, **(self._doubt or {})}

    def _declare(self, node: int) -> None:
        if self.beats.declared(node) == DONE:
            return  # (it said so before its beats stopped)
        if self._doubt is not None and node in self._doubt:
            if self.beats.counters([node])[node] <= self._doubt[node]:
                self.watch.lost.discard(node)  # (not heard since: judged again later)
                return
            del self._doubt[node]
        quiet = getattr(self.beats, "quiet_for", lambda: 0.0)()
        if quiet > self.config.lease_s and self._answered < self.clock() - quiet:
            # (no watched node heard, and the store not since: this agent may be the one
            # cut off, and a store call would only wait for the link, then declare)
            self.watch.lost.discard(node)
            self._doubted()
            return
        counter = self.watch.counter(node)
        began = self.clock()
        try:
            got = mark_lost(self.store, self.keys, node, self.node, counter)
        except Exception as e:
            log.warning("node %d: not declared, the store did not answer: %s", node, e)
            self.watch.lost.discard(node)
            self._doubted()
            return
        if got is not None and self.clock() - began > self.config.lease_s:
            # (the call waited for this agent's own link: the verdict is stale; undone)
            self.store.compare_set(self.keys.node_lost(node), got[1], "")
            self.watch.lost.discard(node)
            self._doubted()
            return
        if got is None:
            return  # (another watcher's)
        lives, mark = got
        self.beats.declare(node, mark)  # (alive after all, it fences at once)
        self.on_lost(node, lives, counter)

    def stop(self) -> None:
        super().stop()
        stop = getattr(self.beats, "stop", None)  # (the scale model's have none)
        if stop is not None:
            stop()

    def close(self) -> None:
        super().close()
        close = getattr(self.beats, "close", None)
        if close is not None:
            close()
