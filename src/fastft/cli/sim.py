"""``fastft sim``: the deterministic simulator (:mod:`fastft.sim`, docs/simulation.md).

``fastft sim --seed S`` replays one seed with its trace; ``--seeds N`` runs N seeds and
prints the ones that failed; ``--exhaustive`` checks a small world exhaustively;
``--defect NAME`` puts a defect of the past back first (the simulator must find it)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastft.sim import Options

__all__ = ["add_parser", "cmd_sim"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sim",
        help="the deterministic simulator: replay a seed, run many, or a small world exhaustively",
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument("--seed", type=int, default=None, help="replay this seed with its trace")
    what.add_argument("--seeds", type=int, default=1000, help="run this many seeds (1000)")
    what.add_argument(
        "--exhaustive", action="store_true", help="every interleaving of a small world"
    )
    what.add_argument(
        "--scale",
        type=int,
        default=None,
        metavar="N",
        help="the scale model: N members' control plane over calibrated servers (docs/simulation.md)",
    )
    p.add_argument(
        "--scenario",
        choices=("reform", "start", "leases"),
        default="reform",
        help="--scale: one fault re-formed, the first start, or N node agents' leases",
    )
    p.add_argument("--plane", choices=("tcpstore", "nats"), default="tcpstore", help="--scale")
    p.add_argument("--first", type=int, default=0, help="the first seed of --seeds (0)")
    p.add_argument("--budget", type=float, default=float("inf"), help="stop after SEC seconds")
    p.add_argument("--members", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="steps per run (6; exhaustive: 2)")
    p.add_argument("--faults", type=int, default=None, help="at most N faults (2; exhaustive: 1)")
    p.add_argument(
        "--kinds", default=None, help="fault kinds, comma-separated (default: every kind)"
    )
    p.add_argument("--elastic", action="store_true")
    p.add_argument("--min-replicas", type=int, default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument(
        "--decide",
        choices=("collective", "store"),
        default="collective",
        help="how a fault-free step is decided (fastft run --decide)",
    )
    p.add_argument(
        "--defect", default=None, help="put this defect of the past back first (docs/simulation.md)"
    )
    p.add_argument("--json", action="store_true", help="the result as JSON")


def _options(args: argparse.Namespace, exhaustive_: bool) -> Options:
    from fastft.sim import ALL_KINDS, Options
    from fastft.sim.defects import DEFECTS

    if args.defect is not None and args.defect not in DEFECTS:
        raise SystemExit(_usage(f"unknown --defect {args.defect!r}; known: {sorted(DEFECTS)}"))
    kinds = tuple(k for k in (args.kinds or "").split(",") if k)
    bad = [k for k in kinds if k not in ALL_KINDS]
    if bad:
        raise SystemExit(_usage(f"unknown fault kinds {bad}; the kinds are {', '.join(ALL_KINDS)}"))
    if args.members < 1:
        raise SystemExit(_usage("--members must be at least 1"))
    base = DEFECTS[args.defect][1] if args.defect else {}
    opts = Options(**base)
    fields = dict(
        world_size=args.members,
        steps=args.steps or (2 if exhaustive_ else opts.steps),
        faults=args.faults if args.faults is not None else (1 if exhaustive_ else opts.faults),
        elastic=args.elastic or opts.elastic,
        min_replicas=args.min_replicas or opts.min_replicas,
        checkpoint_every=args.checkpoint_every,
        decide=args.decide,
    )
    if kinds:
        fields["kinds"] = kinds
    return Options(**{**opts.__dict__, **fields})


def _usage(msg: str) -> int:
    print(f"fastft: error: {msg}", file=sys.stderr)
    return 2


def cmd_sim(args: argparse.Namespace) -> int:
    from fastft.sim.defects import reintroduce
    from fastft.sim.explore import seeds

    if args.scale is not None:
        return _scale(args)
    ex = args.exhaustive
    opts = _options(args, ex)
    with reintroduce(args.defect) if args.defect else _nothing():
        if args.seed is not None:
            return _replay(opts, args)
        if ex:
            return _exhaustive(opts, args)
        rep = seeds(opts, range(args.first, args.first + args.seeds), args.budget)
    out = {
        "seeds": rep.ran,
        "seconds": round(rep.seconds, 2),
        "seeds_per_s": round(rep.per_second, 1),
        "events": rep.events,
        "outcomes": rep.outcomes,
        "failed": {str(k): v for k, v in rep.failed.items()},
    }
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(
            f"{rep.ran} seeds in {rep.seconds:.1f} s ({rep.per_second:.0f}/s, "
            f"{rep.events} events): {rep.outcomes}"
        )
        for seed, why in list(rep.failed.items())[:20]:
            print(f"  seed {seed}: {why}")
        if rep.failed:
            seed = next(iter(rep.failed))
            print(f"replay one: fastft sim --seed {seed}{_flags(args)}")
    return 1 if rep.failed else 0


def _flags(args: argparse.Namespace) -> str:
    out = f" --members {args.members}"
    for name in ("steps", "faults", "kinds", "min_replicas", "defect"):
        v = getattr(args, name)
        if v is not None:
            out += f" --{name.replace('_', '-')} {v}"
    if args.elastic:
        out += " --elastic"
    if args.checkpoint_every:
        out += f" --checkpoint-every {args.checkpoint_every}"
    if args.decide != "collective":
        out += f" --decide {args.decide}"
    return out


def _replay(opts: Options, args: argparse.Namespace) -> int:
    from fastft.sim.explore import digest, replay

    w = replay(opts, args.seed)
    if args.json:
        print(
            json.dumps(
                {
                    "seed": args.seed,
                    "outcome": w.outcome,
                    "failures": w.checks.failures,
                    "faults": w.plan.describe(),
                    "trace": digest(w.lines),
                }
            )
        )
    else:
        print(f"seed {args.seed}: {w.plan.describe()}")
        print("\n".join(w.lines))
        print(f"outcome: {w.outcome}; {w.events} events; trace {digest(w.lines)}")
        for f in w.checks.failures:
            print(f"FAILED {f}")
    return 1 if w.checks.failures else 0


def _exhaustive(opts: Options, args: argparse.Namespace) -> int:
    from fastft.sim.explore import exhaustive

    rep = exhaustive(opts, faults=opts.faults, budget_s=args.budget)
    out = {
        "members": opts.world_size,
        "steps": opts.steps,
        "faults": opts.faults,
        "states": rep.states,
        "runs": rep.runs,
        "pruned": rep.pruned,
        "seconds": round(rep.seconds, 1),
        "complete": rep.complete,
        "failure": rep.failure,
        "choices": rep.choices,
    }
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(
            f"{opts.world_size} members, {opts.steps} steps, up to {opts.faults} faults: "
            f"{rep.states} states, {rep.runs} runs, {rep.pruned} pruned, {rep.seconds:.1f} s"
            + ("" if rep.complete else " (budget spent: not complete)")
        )
        if rep.failure:
            print(f"FAILED {rep.failure}\n  after: " + "\n  then: ".join(rep.choices[-12:]))
    return 1 if rep.failure or not rep.complete else 0


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def _scale(args: argparse.Namespace) -> int:
    from fastft.sim import scale

    if args.scale < 2:
        return _usage("--scale must be at least 2")
    run: Any = {"reform": scale.reform, "start": scale.start, "leases": scale.leases}[args.scenario]
    with scale.memo():
        r = run(args.scale, args.plane)
    row = r.row()
    if args.json:
        print(json.dumps(row))
    else:
        print("  ".join(f"{k} {v}" for k, v in row.items()))
    return 0 if r.errors == 0 and r.done_s is not None else 1
