"""``fastft``: one console script with subcommands.

* ``fastft run``          the node agent: start, watch and restart the workers of a job
* ``fastft report``       the timeline and figures of a finished run
* ``fastft demo``         4 workers, one fault of each kind, checked against a clean run
* ``fastft inject``       publish a fault of the catalogue for a rank (live injection)
* ``fastft report-error`` publish a fault observed by an external monitor
* ``fastft bus tail``     print bus traffic as it happens
* ``fastft plan check``   validate a fault plan file
* ``fastft fsm-doc``      print the state machine's table as Markdown
* ``fastft sim``          the deterministic simulator (a seed, many, or a small world in full)
* ``fastft store``        host a job's store (ManagerFFT under another launcher)
* ``fastft nats up``      a local NATS cluster with JetStream (``fastft run --control``)
* ``fastft ray run``      a job on a Ray cluster: node agents as Ray actors

Flags fall back to environment variables: ``FASTFT_STORE`` and ``FASTFT_JOB`` everywhere,
and every ``fastft run`` flag to ``FASTFT_<FLAG>`` (:mod:`fastft.launch.settings.config`; the whole
table: :mod:`fastft.process.env`). Bad flags and unreachable stores print one line on
stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["main", "ENVIRONMENT"]

ENVIRONMENT = {
    "FASTFT_STORE": "HOST:PORT of the job's store (the node agent hosts it)",
    "FASTFT_JOB": "job id",
    "FASTFT_SECRET_FILE": "the job secret's file (fastft inject, report-error, bus tail)",
}

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: object, **kwargs: object) -> None:
        # defaults in --help (``fastft run``'s flags say theirs in their help already)
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:"):
            message += _did_you_mean(self, message.split(":", 1)[1].split())
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def actions(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """A parser's actions (argparse has no public way to walk them)."""
    return list(p._actions)  # noqa: SLF001 - argparse keeps its actions there


def subcommands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A parser's subcommands by name (its subparsers action's choices; none: empty)."""
    for action in actions(p):
        if isinstance(action.choices, dict) and action.option_strings == []:
            return dict(action.choices)
    return {}


def _did_you_mean(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """ "; did you mean --nproc?" for a flag that is one typo away from one of the
    parser's or its subcommands' flags."""
    import difflib

    known: set[str] = set()
    todo = [parser]
    while todo:
        p = todo.pop()
        for action in actions(p):
            known.update(s for s in action.option_strings if s.startswith("--"))
        todo.extend(subcommands(p).values())
    hints = []
    for arg in unknown:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--"):
            close = difflib.get_close_matches(flag, sorted(known), n=1, cutoff=0.75)
            if close:
                hints.append(f"did you mean {close[0]} (for {flag})?")
    return "; " + "; ".join(hints) if hints else ""


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        default=os.environ.get("FASTFT_STORE"),
        help="HOST:PORT of the store [env FASTFT_STORE]",
    )
    p.add_argument("--job", default=os.environ.get("FASTFT_JOB"), help="job id [env FASTFT_JOB]")
    p.add_argument(
        "--job-secret-file",
        default=os.environ.get("FASTFT_SECRET_FILE"),
        help="the job secret (fastft run prints where: RUN_DIR/job.secret, or its "
        "--job-secret-file) [env FASTFT_SECRET_FILE]",
    )


def _build() -> argparse.ArgumentParser:
    from fastft.inject.plan import FaultKind
    from fastft.launch.settings.flags import add_run_flags

    parser = _Parser(prog="fastft", description="Fast fault tolerance for distributed training.")
    sub = parser.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    p = sub.add_parser(
        "run",
        help="run a training script under the node agent",
        usage="fastft run [flags] SCRIPT [args ...] | fastft run [flags] -m MODULE [-- args ...]",
        description="Start NPROC workers of SCRIPT on this node, host the job's store (node 0), "
        "restart workers that die or hang. Use `-m module` for a module.",
        formatter_class=argparse.HelpFormatter,
        allow_abbrev=False,  # (a script's --d is its own, not a prefix of --decide)
    )
    p.add_argument("-m", dest="module", default=None, help="run a module (like python -m)")
    p.add_argument("script", nargs="?", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    add_run_flags(p)

    p = sub.add_parser("inject", help="inject a fault into a running rank")
    _add_target(p)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--kind", required=True, choices=[k.value for k in FaultKind])
    p.add_argument("--at-step", type=int, default=None, help="fire at this step (default: now)")
    p.add_argument("--arg", type=float, default=0.0, help="exit code for --kind exit")

    p = sub.add_parser(
        "drain",
        help="make a rank, or every rank of a node, leave after its next commit",
        description="Drain: the rank leaves the job after its next commit, with nothing "
        "rolled back; in a fixed world its agent starts it again (it heals), in an elastic "
        "one the world shrinks. --node N drains every worker of node N and its agent ends.",
    )
    _add_target(p)
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--rank", type=int, help="the rank to drain")
    who.add_argument("--node", type=int, help="the node whose workers all drain")
    p.add_argument("--reason", default="", help="logged by the drained workers")

    p = sub.add_parser(
        "report-error",
        help="publish a fault seen by an external monitor",
        description="A fault an outside monitor saw (a GPU Xid, an ECC error). fault1: the "
        "rank's agent kills its worker and starts it again, and the new process heals from a "
        "peer; fault2: the job rolls the current step back and runs it again.",
    )
    _add_target(p)
    p.add_argument("--rank", type=int, required=True, help="the faulty rank")
    p.add_argument(
        "--incarnation",
        type=int,
        default=0,
        help="the life it is about (the worker_start event's incarnation; 0: its current one)",
    )
    p.add_argument(
        "--severity",
        choices=["fault1", "fault2"],
        default="fault1",
        help="fault1: the rank is restarted (a new process, which heals); fault2: transient "
        "(roll back the step only)",
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
    _sim_parser(sub)

    sec = sub.add_parser("secret", help="job secrets")
    ssub = sec.add_subparsers(dest="secret_cmd", required=True, parser_class=_Parser)
    p = ssub.add_parser(
        "new",
        help="write a new job secret to PATH (mode 0600) for --job-secret-file",
        description="Write 32 random bytes (hex) to a new file of mode 0600. Give the same "
        "file to every node's `fastft run --job-secret-file`.",
    )
    p.add_argument("path")

    p = sub.add_parser(
        "store",
        help="host a job's store (for ManagerFFT under another launcher: connect())",
        description="Host a TCPStore that every replica group of a job reaches, until "
        "Ctrl-C. Under `fastft run` node 0's agent hosts it instead.",
    )
    p.add_argument("--bind", default="127.0.0.1:0", help="HOST:PORT (port 0: any free one)")

    ray = sub.add_parser("ray", help="a job on a Ray cluster")
    rsub = ray.add_subparsers(dest="ray_cmd", required=True, parser_class=_Parser)
    p = rsub.add_parser(
        "run",
        help="run a training script on a Ray cluster: one node agent actor per node",
        usage="fastft ray run [--address ADDR] --nodes N [fastft run flags] SCRIPT [args ...]",
        description="Place NODES node agents on the Ray cluster (a placement group of NODES "
        "bundles, one per machine unless --placement spread), each running `fastft run --nnodes NODES "
        "--node-rank i` for its node with every flag given here, node 0 hosting the store; "
        "print their output; exit with the job's status. An agent actor that dies is a lost "
        "node: its standby agent takes it over and its workers join and heal. Needs "
        "fastft[ray].",
        formatter_class=argparse.HelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--address", default=None, help="the Ray cluster (default: ray's own lookup)")
    p.add_argument("--nodes", type=int, default=1, help="node agents (Ray actors)")
    p.add_argument(
        "--cpus-per-node", type=float, default=None, help="each bundle's CPUs (default nproc+1)"
    )
    p.add_argument("--gpus-per-node", type=float, default=0.0, help="each bundle's GPUs")
    p.add_argument(
        "--max-node-restarts",
        type=int,
        default=3,
        help="how many times a node's agent actor may be replaced (by its standby or a new actor)",
    )
    p.add_argument(
        "--no-standby-agents",
        dest="standby_agents",
        action="store_false",
        help="no warm standby agent per node (each one fastft run --standby: a process with "
        "its zygote warm): a dead agent actor is then replaced by a new one, seconds instead "
        "of a fraction of one",
    )
    p.add_argument(
        "--nats-servers",
        type=int,
        default=3,
        help="the control plane: NATS servers as actors of the job, on as many nodes "
        "(one for a single node); 0: node 0's TCPStore; --control URLS: your own NATS",
    )
    p.add_argument(
        "--placement",
        choices=["strict", "spread"],
        default="strict",
        help="strict: each node agent on a machine of its own (STRICT_SPREAD: one machine's "
        "loss is one node's); spread: Ray may put two on one machine (fewer machines than "
        "nodes)",
    )
    p.add_argument(
        "--working-dir",
        default=None,
        help="a directory Ray ships to every node (runtime_env working_dir); the script's "
        "path is relative to it",
    )
    p.add_argument(
        "--runtime-env",
        default=None,
        help='Ray\'s runtime_env for the node agents and their workers, as JSON ({"pip": '
        '["package"], "env_vars": {...}})',
    )
    p.add_argument("-m", dest="module", default=None, help="run a module (like python -m)")
    p.add_argument("script", nargs="?", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    add_run_flags(p)

    nats = sub.add_parser("nats", help="a local NATS control plane")
    nsub = nats.add_subparsers(dest="nats_cmd", required=True, parser_class=_Parser)
    p = nsub.add_parser(
        "up",
        help="start a local NATS cluster with JetStream until Ctrl-C; prints its --control",
        description="Start SERVERS nats-server processes with JetStream on 127.0.0.1 (ports "
        "the OS picks), routed to each other, print the --control value (their URLs) and "
        "run until Ctrl-C or SIGTERM, then stop them. Needs fastft[nats].",
    )
    p.add_argument("--dir", required=True, help="where the servers keep their state and logs")
    p.add_argument("--servers", type=int, default=3, help="how many (3 survive losing one)")

    p = sub.add_parser("report", help="timeline and figures of a run")
    p.add_argument("run_dir", help="the run directory (fastft run --run-dir)")
    p.add_argument("--json", action="store_true", help="figures as JSON")
    p.add_argument(
        "--run",
        type=int,
        default=0,
        help="which run of the directory, 1 the oldest (0: the last; a --run-dir used again "
        "holds several)",
    )
    p.add_argument(
        "--plot", default=None, help="draw the timeline into this file (.png, .svg, .pdf)"
    )
    p.add_argument("--html", default=None, help="the timeline and the report as one HTML page")

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
    p.add_argument(
        "--framework",
        choices=["torch", "jax"],
        default="torch",
        help="jax: the same model in JAX + optax (fastft.jax; pip install 'fastft[jax]')",
    )
    return parser


def _fail(msg: str) -> NoReturn:
    print(f"fastft: error: {msg}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    # Now, not through interpreter finalization: a store client given up on (a port that
    # is not a store) still blocks in torch on a thread that would abort the exit.
    os._exit(EXIT_USAGE)


def _sim_parser(sub: Any) -> None:
    from fastft.cli.sim import add_parser

    add_parser(sub)


def cmd_sim(args: argparse.Namespace) -> int:
    from fastft.cli.sim import cmd_sim as run_sim

    return run_sim(args)


def cmd_fsm_doc(args: argparse.Namespace) -> int:
    from fastft.fsm.doc import render

    print(render(), end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    # torch's C++ logging prints multi-line traces for a refused connection; the CLI
    # reports one line instead. Must be set before torch is imported.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from fastft.errors import ConfigError

    try:
        parser = _build()
    except ConfigError as e:  # a malformed FASTFT_* variable behind a flag
        _fail(str(e))
    if not (sys.argv[1:] if argv is None else argv):
        parser.print_help(sys.stderr)  # (bare `fastft`: what there is, not a parse error)
        return EXIT_USAGE
    args = parser.parse_args(argv)
    from fastft.cli import ops, run  # (after the parse: `fastft --help` stays quick)

    handlers = {
        "inject": ops.cmd_inject,
        "drain": ops.cmd_drain,
        "report-error": ops.cmd_report,
        "fsm-doc": cmd_fsm_doc,
        "sim": cmd_sim,
        "store": ops.cmd_store,
        "run": run.cmd_run,
        "report": run.cmd_report_run,
        "demo": run.cmd_demo,
    }
    if args.cmd == "bus":
        return ops.cmd_tail(args)
    if args.cmd == "plan":
        return ops.cmd_plan_check(args)
    if args.cmd == "secret":
        return ops.cmd_secret_new(args)
    if args.cmd == "nats":
        return ops.cmd_nats_up(args)
    if args.cmd == "ray":
        return run.cmd_ray_run(args)
    return handlers[args.cmd](args)
