"""One fault's rollback at scale (issue 35): every member rolled back and in the next epoch,
this code's protocol against the bus barrier it replaced, side by side in one run.

N - 1 simulated members (threads over a few processes), each with the project's real
parts: a bus endpoint subscribed to the job's bus, :func:`fastft.runtime.engine.inbox.route`
for every message, :func:`fastft.fsm.decide` for every event, the real coordinator for the
rollback's proposal and the formation of the next epoch (this code: the formation is the
barrier, :mod:`fastft.runtime.engine.survivors`; before: each member broadcast a rollback
request and an acknowledgement to every other before it formed). The members start in
epoch 1 of N members; rank N - 1 is dead, and its agent's exit notice is the one fault (a
broadcast). Measured: from that broadcast to the last member holding epoch 2's view; the
bus deliveries (messages the members received), the store requests of the members'
coordinators, and the TCPStore host's CPU (a process of its own). "before" runs the commit
named by ``--before`` (its ``src`` taken out of git into a temporary directory).

On NATS (``--control nats``: a local 3-server cluster, as ``fastft run --control`` starts)
the same members run over the NATS bus and key-value store.

    python bench/barrier.py [--sizes 8 64 256 1024] [--before-sizes 8 64 256]
                            [--control tcpstore nats] [--procs 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import QUICK_RESOLVER, StoreHost, table, write  # noqa: E402

BEFORE = "88f5b36"
"""The last commit with the bus barrier (ROLLBACK_REQ/ROLLBACK_SYNC)."""
JOB = "bench-barrier"
ROOT = Path(__file__).resolve().parents[1]


SECRET = b"bench-barrier-secret-32-bytes-long!"
"""With ``--secret``: the job secret every member signs and checks its values with."""


def _signed(store: object, keys: object) -> object:
    from fastft.bus.signed import SignedStore
    from fastft.protocol.auth import JobSecret, ValueAuth

    return SignedStore(store, keys, ValueAuth(JobSecret(SECRET)))


PER_NODE = 8
"""With ``--voice``: workers a node (a node of this harness: its members in one process)."""


def _nodes(address: str, first: int, count: int, keys: object, secret: bool, counts: dict[str, int], lock: object) -> dict[int, tuple[object, object]]:  # fmt: skip
    """With ``--voice``: each node's relay hub, with the agent's bus endpoint (the node's
    one subscriber) and its voice (:class:`~fastft.launch.nodes.voice.AgentVoice`), as a
    job's agent runs them under ``--bus-relay``: node -> (hub, voice)."""
    from fastft.bus import BusConfig, RelayHub, connect_store, open_bus
    from fastft.launch.nodes.voice import AgentVoice
    from fastft.protocol import Role
    from fastft.protocol.auth import JobSecret
    from fastft.testing import CountingStore

    out = {}
    for node in sorted({r // PER_NODE for r in range(first, first + count)}):
        here = len([r for r in range(first, first + count) if r // PER_NODE == node])
        raw = connect_store(address)
        hub = RelayHub()
        cfg = BusConfig(job=JOB, rank=-1, incarnation=node + 1, role=Role.AGENT,
                        secret=JobSecret(SECRET) if secret else None)  # fmt: skip
        open_bus(raw.clone(), cfg, hub=hub).start()  # (it starts the hub)
        store = CountingStore(raw, counts, lock)
        store = _signed(store, keys) if secret else store
        out[node] = (hub, AgentVoice(hub, store, keys, lambda here=here: here).start())
    return out


def members(
    address: str, first: int, count: int, world: int, secret: bool = False, voice: bool = False
) -> None:
    """A child: ``count`` members (ranks first..) in epoch 1, each a bus endpoint, the
    state machine and a coordinator; after "go", waits for each to hold epoch 2's view.
    One JSON line: when each did, the deliveries and the store requests. ``voice``: under
    a relay per node of :data:`PER_NODE`, which speaks for them (issue 64)."""
    import datetime
    import queue

    from fastft import fsm
    from fastft.bus import BusConfig, connect_store, open_bus
    from fastft.protocol import Fault, Severity
    from fastft.protocol.keys import JobKeys
    from fastft.runtime.contract import EpochView, Member
    from fastft.runtime.engine import decisions
    from fastft.runtime.engine.coordinator import Coordinator
    from fastft.runtime.engine.inbox import route
    from fastft.testing import CountingStore

    try:  # (this code)
        from fastft.runtime.engine.survivors import Survivors
    except ImportError:  # (before: the bus barrier)
        Survivors = None  # noqa: N806

    keys = JobKeys(JOB)
    counts: dict[str, int] = {}
    lock = threading.Lock()
    plain = connect_store(address)
    view = EpochView.from_json(
        (_signed(plain, keys) if secret else plain).get(keys.epoch_members(1))
    )
    done: dict[int, float] = {}
    delivered = [0]
    form_s = 5.0 + world * 0.02  # (the formation's deadline: every live member arrives)
    nodes = _nodes(address, first, count, keys, secret, counts, lock) if voice else {}

    class One:
        def __init__(self, rank: int) -> None:
            self.rank = rank
            self.me = Member(rank, 1)
            self.lock = threading.Lock()
            self.dead: set[Member] = set()
            self.main: queue.Queue[object] = queue.Queue()
            raw = connect_store(address)
            # (a worker's three connections: its coordinator's, the listener's side
            # client's, and the decision store's; with --secret, signed as in a job)
            sign = (lambda s: _signed(s, keys)) if secret else (lambda s: s)
            self.side = sign(CountingStore(raw.clone(), counts, lock))  # (proposals)
            quick = raw.clone()
            quick.set_timeout(datetime.timedelta(seconds=0.5))  # (after the connect)
            self.coord = Coordinator(
                sign(CountingStore(raw, counts, lock)),
                keys,
                rank,
                1,
                world,
                1,
                dead=self.dead,
                decision_store=sign(CountingStore(quick, counts, lock)),
            )
            self.state, _ = fsm.decide(fsm.initial_state(rank), fsm.QuorumReady(1, view.ranks, 0))
            bus_secret = None
            if secret:
                from fastft.protocol.auth import JobSecret

                bus_secret = JobSecret(SECRET)
            hub = nodes[rank // PER_NODE][0].address if nodes else None  # type: ignore[attr-defined]
            self.bus = open_bus(
                raw.clone(),
                BusConfig(job=JOB, rank=rank, incarnation=1, secret=bus_secret),
                relay=hub,
            )
            self.bus.subscribe(self.on_message)
            self.bus.start()
            if nodes:
                from fastft.bus import node_voice

                self.coord.voice = node_voice(self.bus)

        def header(self) -> dict[str, object]:
            s = self.state
            return dict(job=JOB, epoch=s.epoch, rank=self.rank, incarnation=1, step=s.step)

        def on_message(self, m: object) -> None:
            with lock:
                delivered[0] += 1
            with self.lock:
                s = self.state
                out = route(m, me=self.me, view=view, epoch=s.epoch, step=s.step, dead=self.dead)
                if getattr(out, "early", False):
                    return
                if out.dead is not None:
                    self.dead.add(out.dead)
                for ev in out.events:
                    self.feed(ev)

        def feed(self, ev: object) -> None:
            self.state, actions = fsm.decide(self.state, ev)
            for a in actions:
                name = type(a).__name__
                if name == "ProposeRollback":
                    decisions.propose_rollback(self.side, keys, a.epoch, a.step, a.reason)
                elif name == "BroadcastRollbackRequest":
                    from fastft.protocol import RollbackRequest

                    self.bus.broadcast(RollbackRequest(**self.header(), reason=a.reason))
                elif name == "BroadcastRollbackAck":
                    from fastft.protocol import RollbackAck  # type: ignore[attr-defined]

                    self.bus.broadcast(RollbackAck(**self.header()))
                elif name in ("FormEpoch", "DeclareDead"):
                    self.main.put(a)

        def remind(self) -> None:
            from fastft.protocol import RollbackRequest

            self.bus.broadcast(RollbackRequest(**self.header(), reason="forming without you"))

        def silent(self, ranks: frozenset[int]) -> None:  # (none here: every member is live)
            for r in ranks:
                f = Fault(
                    **self.header(),
                    severity=Severity.FAULT1,
                    cause="silent",
                    faulty_rank=r,
                    faulty_incarnation=1,
                )
                self.bus.broadcast(f)

        def run(self) -> None:
            a = self.main.get()
            while type(a).__name__ != "FormEpoch":
                a = self.main.get()
            exclude = a.exclude | {m.rank for m in self.dead}
            kw = dict(step=0, lost_state=False, timeout_s=form_s, cancelled=lambda: False)
            if Survivors is not None and hasattr(Survivors, "rounds"):  # (issue 63: rounds)
                survivors = Survivors(self.coord)
                wait = survivors.arrive(
                    view, frozenset(exclude), step=0, lost_state=False, timeout_s=form_s
                )
                got = None
                for rd in survivors.rounds(wait):  # (what a worker's executor carries out)
                    if rd.silent:
                        self.silent(rd.silent)
                    if rd.remind:
                        self.remind()
                    got = rd.view
            elif Survivors is not None:  # (sessions before issue 63: callbacks)
                got = Survivors(self.coord).form(
                    view, frozenset(exclude), silent=self.silent, remind=self.remind, **kw
                )
            else:
                got = self.coord.form_as_survivor(view, frozenset(exclude), **kw)
            assert got is not None and got.epoch == 2, got
            with lock:
                done[self.rank] = time.time()

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:  # (their connections, a few at a time)
        ones = list(pool.map(One, range(first, first + count)))
    threads = [threading.Thread(target=o.run, daemon=True) for o in ones]
    for t in threads:
        t.start()
    print("ready", flush=True)
    sys.stdin.readline()
    cpu0 = time.process_time()
    for t in threads:
        t.join(timeout=600)
    cpu = time.process_time() - cpu0  # (this process's every thread, until all formed)
    time.sleep(0.5)  # (late messages: counted)
    print(
        json.dumps(
            {
                "done": done,
                "delivered": delivered[0],
                "cpu_s": cpu,
                "requests": sum(v for k, v in counts.items() if k != "set_timeout"),
            }
        )
    )
    for o in ones:
        o.bus.close()


def one_row(
    src: Path,
    control: str,
    world: int,
    procs: int,
    nats: str | None,
    secret: bool = False,
    voice: bool = False,
) -> dict[str, object]:
    """One fault among ``world`` members with the code under ``src`` (``voice``: each node
    of :data:`PER_NODE` members under a relay, its agent speaking for them)."""
    from fastft.bus import BusConfig, connect_store, open_bus
    from fastft.protocol import ProcessExited
    from fastft.protocol.keys import JobKeys
    from fastft.runtime.contract import EpochView, Member

    keys = JobKeys(JOB)
    host = StoreHost() if control == "tcpstore" else None
    if host is not None:
        host.__enter__()
        address = f"127.0.0.1:{host.port}"
    else:
        assert nats is not None
        address = nats
    kids: list[subprocess.Popen[str]] = []
    try:
        store = connect_store(address)
        view = EpochView(1, tuple(Member(r, 1) for r in range(world)), 0, frozenset(), None)
        kv = _signed(store, keys) if secret else store
        kv.set(keys.epoch_members(1), view.to_json())  # (as a first start leaves the
        kv.set(keys.latest_epoch, "1")  # store: epoch 1 closed, the joiners admitted
        kv.set(keys.joined, str(world))  # and their keys cleared, as the scale model's
        for r in range(world):  # _first_epoch; without them the closer made each joiner
            kv.set(keys.joiner(r), "")  # key, one request after another, as it closed)
        live = world - 1
        per = -(-live // procs)
        per = -(-per // PER_NODE) * PER_NODE if voice else per  # (whole nodes a process)
        env = {
            **os.environ,
            **QUICK_RESOLVER,
            "PYTHONPATH": str(src),
            "TORCH_CPP_LOG_LEVEL": "ERROR",
        }
        for first in range(0, live, per):
            kids.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        address,
                        str(first),
                        str(min(per, live - first)),
                        str(world),
                        *(["--secret"] if secret else []),
                        *(["--voice"] if voice else []),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=env,
                )
            )
            assert kids[-1].stdout is not None
            assert kids[-1].stdout.readline().strip() == "ready"  # (one at a time: imports)
        time.sleep(1.0)  # (every endpoint subscribed)
        from fastft.protocol.auth import JobSecret

        agent = open_bus(
            store,
            BusConfig(
                job=JOB,
                rank=world + 100,
                incarnation=1,
                subscribe=False,
                secret=JobSecret(SECRET) if secret else None,
            ),
        )
        agent.start()
        cpu0 = host.cpu_s() if host else 0.0
        t0 = time.time()
        agent.broadcast(ProcessExited(job=JOB, epoch=1, rank=-1, incarnation=0, step=0,
                                      exited_rank=world - 1, exited_incarnation=1,
                                      signal=9, role=_agent_role()))  # fmt: skip
        for k in kids:
            assert k.stdin is not None
            k.stdin.write("go\n")
            k.stdin.flush()
        outs = [json.loads(k.communicate(timeout=900)[0].splitlines()[-1]) for k in kids]
        cpu = (host.cpu_s() - cpu0) if host else None
        agent.close()
    finally:
        for k in kids:  # (a failed run: none left behind)
            if k.poll() is None:
                k.kill()
                k.wait()
        if host is not None:
            host.__exit__(None, None, None)
    ends = [t for o in outs for t in o["done"].values()]
    assert len(ends) == live, f"{len(ends)} of {live} members formed epoch 2"
    delivered = sum(int(o["delivered"]) for o in outs)
    return {
        "deliveries": delivered,
        "deliveries_per_member": round(delivered / live, 1),
        "store_requests": sum(int(o["requests"]) for o in outs),
        "reformed_ms": round((max(ends) - t0) * 1e3, 1),
        "member_cpu_ms": round(sum(float(o["cpu_s"]) for o in outs) / live * 1e3, 3),
        "store_cpu_ms": round(cpu * 1e3, 1) if cpu is not None else None,
    }


def _agent_role() -> object:
    from fastft.protocol import Role

    return Role.AGENT


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        a = sys.argv[2:]
        members(a[0], int(a[1]), int(a[2]), int(a[3]), secret="--secret" in a, voice="--voice" in a)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256, 1024])
    ap.add_argument("--before-sizes", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--control", nargs="+", default=["tcpstore"], choices=["tcpstore", "nats"])
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--before", default=BEFORE, help="the commit of the bus barrier")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "before"
        old.mkdir()
        tar = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.before, "src"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=tar, check=True)
        for control in args.control:
            cluster = None
            nats = None
            if control == "nats":
                from fastft.bus.natscluster import LocalCluster

                cluster = LocalCluster(Path(tmp) / "nats").start()
                nats = cluster.address
            try:
                for world in sorted(set(args.sizes) | set(args.before_sizes)):
                    for name, src in (("before", old / "src"), ("this", ROOT / "src")):
                        wanted = args.before_sizes if name == "before" else args.sizes
                        if world not in wanted:
                            continue
                        row = one_row(src, control, world, args.procs, nats)
                        row = {"control": control, "protocol": name, "members": world, **row}
                        print(json.dumps(row), flush=True)
                        rows.append(row)
            finally:
                if cluster is not None:
                    cluster.stop()
    cols = [
        "control",
        "protocol",
        "members",
        "reformed_ms",
        "deliveries",
        "deliveries_per_member",
        "store_requests",
        "store_cpu_ms",
    ]
    print(table(rows, cols))
    path = write("barrier", rows, {"before": args.before, "procs": args.procs})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
