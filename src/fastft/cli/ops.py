"""``fastft inject``, ``report-error``, ``bus tail``, ``plan check`` and ``store``: the
operator's commands on a job's store and bus."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from fastft.cli import _fail


def _connect(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from fastft.bus import connect_store
    from fastft.errors import StoreUnreachable

    if not args.store:
        _fail("--store HOST:PORT is required (or set FASTFT_STORE)")
    if not args.job:
        _fail("--job ID is required (or set FASTFT_JOB)")
    if "/" in args.job:
        _fail(f"--job {args.job!r}: a job id cannot contain '/'")
    try:
        return connect_store(args.store, timeout_s=5.0, torch_free=True)
    except StoreUnreachable as e:
        _fail(str(e))


def _secret(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The job secret these commands must hold; exit 2 saying where to find it if not."""
    from fastft.errors import ConfigError
    from fastft.process.env import insecure
    from fastft.protocol.auth import JobSecret

    if insecure():
        return None
    if not args.job_secret_file:
        _fail(
            f"fastft {args.cmd} needs the job secret: pass --job-secret-file PATH (fastft run "
            "printed it at start: RUN_DIR/job.secret, or its --job-secret-file) or set "
            "FASTFT_SECRET_FILE"
        )
    try:
        return JobSecret.load(args.job_secret_file)
    except ConfigError as e:
        _fail(str(e))


def _publisher(args: argparse.Namespace, role: int):  # type: ignore[no-untyped-def]
    from fastft.bus import BusConfig, open_bus
    from fastft.protocol import Role

    secret = _secret(args)
    store = _connect(args)
    cfg = BusConfig(
        job=args.job,
        rank=-1,
        incarnation=os.getpid(),
        role=Role(role),
        subscribe=False,
        secret=secret,
    )
    return open_bus(store, cfg).start()


def cmd_inject(args: argparse.Namespace) -> int:
    from fastft.protocol import NO_STEP, Inject, Role

    if args.rank < 0:
        _fail(f"--rank {args.rank}: use a rank >= 0")
    if args.at_step is not None and args.at_step < 0:
        _fail(f"--at-step {args.at_step}: use a step >= 0")
    bus = _publisher(args, Role.OPERATOR)
    try:
        sent = bus.broadcast(
            Inject(
                job=args.job,
                epoch=0,
                rank=-1,
                incarnation=os.getpid(),
                role=Role.OPERATOR,
                target_rank=args.rank,
                fault_kind=args.kind,
                at_step=NO_STEP if args.at_step is None else args.at_step,
                arg=args.arg,
            )
        )
    finally:
        bus.close()
    print(f"injected {args.kind} for rank {args.rank} (seq {sent.seq})")
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    from fastft.protocol import NO_RANK, DrainRequest, Role

    target = args.rank if args.rank is not None else args.node
    what = "--rank" if args.rank is not None else "--node"
    if target < 0:
        _fail(f"{what} {target}: use a number >= 0")
    bus = _publisher(args, Role.OPERATOR)
    try:
        bus.broadcast(
            DrainRequest(
                job=args.job,
                epoch=0,
                rank=NO_RANK,
                incarnation=os.getpid(),
                role=Role.OPERATOR,
                target_rank=target if args.rank is not None else NO_RANK,
                target_node=target if args.node is not None else NO_RANK,
                reason=args.reason[:500] or f"fastft drain {what} {target}",
            )
        )
    finally:
        bus.close()
    print(f"asked {'rank' if args.rank is not None else 'node'} {target} to drain")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from fastft.protocol import Fault, Role, Severity

    if args.rank < 0:
        _fail(f"--rank {args.rank}: use a rank >= 0")
    bus = _publisher(args, Role.MONITOR)
    try:
        bus.broadcast(
            Fault(
                job=args.job,
                epoch=max(args.epoch, 0),
                rank=-1,
                incarnation=os.getpid(),
                step=max(args.step, -1),
                role=Role.MONITOR,
                severity=Severity.FAULT1 if args.severity == "fault1" else Severity.FAULT2,
                cause=args.cause,
                faulty_rank=args.rank,
                faulty_incarnation=args.incarnation,
                detail=args.detail,
            )
        )
    finally:
        bus.close()
    print(f"reported {args.severity} of rank {args.rank}: {args.cause}")
    return 0


def describe(msg: object) -> dict[str, object]:
    """A message as a flat JSON-able dict (``kind`` first)."""
    from dataclasses import fields

    out: dict[str, object] = {"kind": type(msg).__name__}
    for f in fields(msg):  # type: ignore[arg-type]
        v = getattr(msg, f.name)
        out[f.name] = v.name.lower() if hasattr(v, "name") else v
    return out


def cmd_tail(args: argparse.Namespace) -> int:
    from fastft.bus import BusConfig, open_bus
    from fastft.protocol import Role

    secret = _secret(args)
    store = _connect(args)
    cfg = BusConfig(
        job=args.job,
        rank=-1,
        incarnation=os.getpid(),
        role=Role.OPERATOR,
        idle_pop_s=1.0,
        secret=secret,
    )
    seen = 0
    deadline = time.monotonic() + args.timeout if args.timeout > 0 else None
    with open_bus(store, cfg) as bus:
        print(f"# tailing bus of job {args.job} at {args.store}", file=sys.stderr, flush=True)
        try:
            while not args.count or seen < args.count:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                msg = bus.recv(timeout_s=min(left, 0.5) if left is not None else 0.5)
                if msg is None:
                    continue
                seen += 1
                d = describe(msg)
                if args.json:
                    print(json.dumps(d), flush=True)
                else:
                    head = (
                        f"{time.strftime('%H:%M:%S', time.localtime(msg.wall_time))}"
                        f".{int(msg.wall_time * 1e3) % 1000:03d} "
                        f"{d['kind']:<15} from {msg.rank}.{msg.incarnation} "
                        f"epoch {msg.epoch} step {msg.step}"
                    )
                    body = " ".join(
                        f"{k}={v}"
                        for k, v in d.items()
                        if k
                        not in (
                            "kind",
                            "job",
                            "epoch",
                            "rank",
                            "incarnation",
                            "step",
                            "seq",
                            "wall_time",
                            "role",
                        )
                    )
                    print(f"{head} {body}", flush=True)
        except KeyboardInterrupt:
            pass
        st = bus.stats
        if st.malformed:
            print(f"# {st.malformed} malformed message(s) dropped", file=sys.stderr)
        if st.forged or st.replayed:
            print(
                f"# {st.forged} forged and {st.replayed} replayed frame(s) dropped "
                f"(without the job secret), by claimed sender: {st.rejected_by}",
                file=sys.stderr,
            )
    return 0


def cmd_plan_check(args: argparse.Namespace) -> int:
    from fastft.errors import ConfigError
    from fastft.inject.plan import FaultPlan

    try:
        plan = FaultPlan.load(args.path)
    except ConfigError as e:
        _fail(str(e))
    for f in plan.faults:
        at = "now" if f.at_step is None else f"step {f.at_step}"
        print(f"rank {f.rank} life {f.life}: {f.kind.value} at {at}")
    return 0


def cmd_secret_new(args: argparse.Namespace) -> int:
    from fastft.errors import ConfigError
    from fastft.protocol.auth import JobSecret

    try:
        path = JobSecret.draw().save(args.path)
    except (ConfigError, OSError) as e:
        _fail(f"cannot write {args.path}: {e}")
    print(
        f"wrote a new job secret to {path} (mode 0600): give it to every node's "
        f"fastft run --job-secret-file {path}"
    )
    return 0


def cmd_store(args: argparse.Namespace) -> int:
    host, _, port = args.bind.rpartition(":")
    if not host or not port.isdigit():
        _fail(f"--bind {args.bind!r}: expected HOST:PORT")
    import signal
    import threading

    from fastft.bus import host_store

    try:
        server = host_store(host, int(port))
    except Exception as e:
        _fail(f"cannot host a store at {args.bind}: {e}")
    print(f"{host}:{server.port}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    return 0


def cmd_nats_up(args: argparse.Namespace) -> int:
    import signal
    import threading

    from fastft.bus.natscluster import LocalCluster
    from fastft.errors import FastFTError

    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    try:
        cluster = LocalCluster(args.dir, args.servers).start()
    except FastFTError as e:
        _fail(str(e))
    try:
        print(cluster.address, flush=True)
        done.wait()
    finally:
        cluster.stop()
    return 0
