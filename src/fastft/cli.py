"""``fastft``: one console script with subcommands.

* ``fastft inject``       publish a fault of the catalogue for a rank (live injection)
* ``fastft report-error`` publish a fault observed by an external monitor
* ``fastft bus tail``     print bus traffic as it happens
* ``fastft plan check``   validate a fault plan file
* ``fastft fsm-doc``      print the state machine's table as Markdown
* ``fastft store``        host a job's store (ManagerFFT under another launcher)
* ``fastft run``          the node agent: start, watch and restart the workers of a job
* ``fastft report``       the timeline and figures of a finished run
* ``fastft demo``         4 workers, one fault of each kind, checked against a clean run

Flags fall back to environment variables: ``FASTFT_STORE`` and ``FASTFT_JOB`` everywhere,
and every ``fastft run`` flag to ``FASTFT_<FLAG>`` (:mod:`fastft.launch.config`; the whole
table: :mod:`fastft.process.env`). Bad flags and unreachable stores print one line on
stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["main", "ENVIRONMENT"]

ENVIRONMENT = {
    "FASTFT_STORE": "HOST:PORT of the job's store (the node agent hosts it)",
    "FASTFT_JOB": "job id",
}

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        default=os.environ.get("FASTFT_STORE"),
        help="HOST:PORT of the store [env FASTFT_STORE]",
    )
    p.add_argument("--job", default=os.environ.get("FASTFT_JOB"), help="job id [env FASTFT_JOB]")


def _build() -> argparse.ArgumentParser:
    from fastft.inject.plan import FaultKind
    from fastft.launch.config import add_run_flags

    parser = _Parser(prog="fastft", description="Fast fault tolerance for distributed training.")
    sub = parser.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    p = sub.add_parser("inject", help="inject a fault into a running rank")
    _add_target(p)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--kind", required=True, choices=[k.value for k in FaultKind])
    p.add_argument("--at-step", type=int, default=None, help="fire at this step (default: now)")
    p.add_argument("--arg", type=float, default=0.0, help="exit code for --kind exit")

    p = sub.add_parser("report-error", help="publish a fault seen by an external monitor")
    _add_target(p)
    p.add_argument("--rank", type=int, required=True, help="the faulty rank")
    p.add_argument("--incarnation", type=int, default=0)
    p.add_argument(
        "--severity",
        choices=["fault1", "fault2"],
        default="fault1",
        help="fault1: state lost (heal); fault2: transient (roll back only)",
    )
    p.add_argument("--cause", required=True)
    p.add_argument("--detail", default="")
    p.add_argument("--epoch", type=int, default=0)
    p.add_argument("--step", type=int, default=-1)

    bus = sub.add_parser("bus", help="error bus tools")
    bsub = bus.add_subparsers(dest="bus_cmd", required=True, parser_class=_Parser)
    p = bsub.add_parser("tail", help="print bus traffic live")
    _add_target(p)
    p.add_argument("--count", type=int, default=0, help="stop after N messages (0: never)")
    p.add_argument("--timeout", type=float, default=0.0, help="stop after S seconds (0: never)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")

    plan = sub.add_parser("plan", help="fault plans")
    psub = plan.add_subparsers(dest="plan_cmd", required=True, parser_class=_Parser)
    p = psub.add_parser("check", help="validate a fault plan file")
    p.add_argument("path")

    sub.add_parser("fsm-doc", help="print the step state machine as Markdown")

    p = sub.add_parser(
        "store",
        help="host a job's store (for ManagerFFT under another launcher: connect())",
        description="Host a TCPStore that every replica group of a job reaches, until "
        "Ctrl-C. Under `fastft run` node 0's agent hosts it instead.",
    )
    p.add_argument("--bind", default="127.0.0.1:0", help="HOST:PORT (port 0: any free one)")

    p = sub.add_parser(
        "run",
        help="run a training script under the node agent",
        description="Start NPROC workers of SCRIPT on this node, host the job's store (node 0), "
        "restart workers that die or hang. Use `-m module` for a module.",
    )
    add_run_flags(p)
    p.add_argument("-m", dest="module", default=None, help="run a module (like python -m)")
    p.add_argument("script", nargs="?", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")

    p = sub.add_parser("report", help="timeline and figures of a run")
    p.add_argument("run_dir", help="the run directory (fastft run --run-dir)")
    p.add_argument("--json", action="store_true", help="figures as JSON")

    p = sub.add_parser("demo", help="the demo: 4 workers, one fault of each kind")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--no-live", action="store_true", help="no live display")
    p.add_argument(
        "--elastic",
        action="store_true",
        help="survivors go on without a lost worker (--min-replicas nproc/2); the check is "
        "then: every sample consumed once and parameters equal up to summation order",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the workers' models train (cuda: one GPU each where there are enough, "
        "NCCL then; else the GPUs are shared and the process groups are Gloo)",
    )
    return parser


def _fail(msg: str) -> NoReturn:
    print(f"fastft: error: {msg}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def _connect(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from fastft.bus.tcpstore import connect_store
    from fastft.errors import StoreUnreachable

    if not args.store:
        _fail("--store HOST:PORT is required (or set FASTFT_STORE)")
    if not args.job:
        _fail("--job ID is required (or set FASTFT_JOB)")
    if "/" in args.job:
        _fail(f"--job {args.job!r}: a job id cannot contain '/'")
    try:
        return connect_store(args.store, timeout_s=5.0)
    except StoreUnreachable as e:
        _fail(str(e))


def _publisher(args: argparse.Namespace, role: int):  # type: ignore[no-untyped-def]
    from fastft.bus import BusConfig, tcpstore_bus
    from fastft.protocol import Role

    store = _connect(args)
    cfg = BusConfig(
        job=args.job, rank=-1, incarnation=os.getpid(), role=Role(role), subscribe=False
    )
    return tcpstore_bus(store, cfg).start()


def _cmd_inject(args: argparse.Namespace) -> int:
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


def _cmd_report(args: argparse.Namespace) -> int:
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


def _cmd_tail(args: argparse.Namespace) -> int:
    from fastft.bus import BusConfig, tcpstore_bus
    from fastft.protocol import Role

    store = _connect(args)
    cfg = BusConfig(
        job=args.job, rank=-1, incarnation=os.getpid(), role=Role.OPERATOR, idle_pop_s=1.0
    )
    seen = 0
    deadline = time.monotonic() + args.timeout if args.timeout > 0 else None
    with tcpstore_bus(store, cfg) as bus:
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
                        f"{time.strftime('%H:%M:%S', time.localtime(msg.wall_time))} "
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
        if bus.stats.malformed:
            print(f"# {bus.stats.malformed} malformed message(s) dropped", file=sys.stderr)
    return 0


def _cmd_plan_check(args: argparse.Namespace) -> int:
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


def _cmd_store(args: argparse.Namespace) -> int:
    host, _, port = args.bind.rpartition(":")
    if not host or not port.isdigit():
        _fail(f"--bind {args.bind!r}: expected HOST:PORT")
    import signal
    import threading

    from fastft.bus import host_store

    try:
        server = host_store(host, int(port))
    except Exception as e:  # noqa: BLE001 - a port in use, an address not ours
        _fail(f"cannot host a store at {args.bind}: {e}")
    print(f"{host}:{server.port}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    return 0


def _cmd_fsm_doc(args: argparse.Namespace) -> int:
    from fastft.fsm.doc import render

    print(render(), end="")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from fastft.errors import FastFTError
    from fastft.launch import Agent
    from fastft.launch.config import config_from_args

    rest = list(args.args or [])
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if args.module:
        command = [
            sys.executable,
            "-m",
            args.module,
            *([args.script] if args.script else []),
            *rest,
        ]
    elif args.script:
        if not os.path.exists(args.script):
            _fail(f"script {args.script!r} not found")
        command = [sys.executable, args.script, *rest]
    else:
        _fail("no script: fastft run [flags] script.py [args] (or -m module)")
    try:
        cfg = config_from_args(args, tuple(command))
        agent = Agent(cfg)
    except FastFTError as e:
        _fail(str(e))
    return agent.run()


def _cmd_report_run(args: argparse.Namespace) -> int:
    from fastft.report import render_report, summarize

    try:
        figures = summarize(args.run_dir)
    except FileNotFoundError:
        _fail(f"{args.run_dir}: no events.jsonl (is it a fastft run directory?)")
    if args.json:
        print(json.dumps(figures, indent=2, default=str))
    else:
        print(render_report(args.run_dir, figures))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from fastft.demo.main import run_demo

    if args.steps < 20 or args.nproc < 2:
        _fail("demo: use --steps >= 20 and --nproc >= 2")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            _fail("demo --device cuda: no CUDA device is visible (use --device cpu)")
    return run_demo(
        steps=args.steps,
        nproc=args.nproc,
        run_dir=args.run_dir,
        live=not args.no_live,
        elastic=args.elastic,
        device=args.device,
    )


def main(argv: Sequence[str] | None = None) -> int:
    # torch's C++ logging prints multi-line traces for a refused connection; the CLI
    # reports one line instead. Must be set before torch is imported.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from fastft.errors import ConfigError

    try:
        parser = _build()
    except ConfigError as e:  # a malformed FASTFT_* variable behind a flag
        _fail(str(e))
    args = parser.parse_args(argv)
    handlers = {
        "inject": _cmd_inject,
        "report-error": _cmd_report,
        "fsm-doc": _cmd_fsm_doc,
        "store": _cmd_store,
        "run": _cmd_run,
        "report": _cmd_report_run,
        "demo": _cmd_demo,
    }
    if args.cmd == "bus":
        return _cmd_tail(args)
    if args.cmd == "plan":
        return _cmd_plan_check(args)
    return handlers[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
