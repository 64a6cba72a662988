"""The chaos soak's checks and report (:mod:`chaos`): a job's history against the
fault-free reference (S1, S3, S5, regressions, elastic tiling), the survivors' recovery by
fault kind, the waits past their bound, the spares under load, and the table."""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _common import pct, table  # noqa: E402

from fastft.report import (  # noqa: E402
    shards_by_step,
    summarize,
    unlogged_commits,
    untiled_steps,
)
from fastft.runtime import read_events  # noqa: E402


def check(
    run: Path, reference: dict[int, str], steps: int, elastic: bool = False
) -> dict[str, Any]:
    """The history checks (S1, S3/S5 against ``reference``, regressions) of ``run``. In an
    elastic world a step's digest depends on who trained it: S3 is then every member's
    digest equal per step and epoch, and S5 every sample of every step consumed once (the
    last epoch that committed a step: a restore trains steps again)."""
    ev = read_events(run)
    life: dict[str, int] = {}
    history: dict[tuple[str, int, int], list[int]] = defaultdict(list)
    """(worker, life, restores and heals it went through) -> the steps it committed, in
    order: each stretch between two is contiguous (S1)."""
    healed_to: dict[tuple[str, int, int], int] = {}
    """The step a stretch that began with a fetched heal must begin at."""
    wrong: list[tuple[str, int]] = []
    first_commit: dict[int, float] = {}
    regressions: list[dict[str, Any]] = []
    again: set[int] = set()
    top = -1
    restores: dict[str, int] = defaultdict(int)
    for e in ev:
        if e["event"] == "worker_start":
            life[e["src"]] = e["life"]
        elif e["event"] in ("restore", "join_wait"):
            # a total loss restored, or a worker left out while it healed itself in place
            # joining again: the life goes on from the step it is given
            restores[e["src"]] += 1
        elif e["event"] == "heal" and e.get("role") == "fetch":
            # healed from a peer: its state is that step's (a member that rolled a step
            # back while the others committed it heals forward: the gap is the heal's)
            restores[e["src"]] += 1
            healed_to[(e["src"], life.get(e["src"], 0), restores[e["src"]])] = e["step"]
        elif e["event"] == "commit":
            s = e["step"]
            history[(e["src"], life.get(e["src"], 0), restores[e["src"]])].append(s)
            if e.get("digest") is not None and not elastic and reference.get(s) != e["digest"]:
                wrong.append((e["src"], s))
            first_commit.setdefault(s, e["mono"])
            if s < top and s not in again:  # committed after a later step had been
                again.add(s)
                regressions.append({"step": s, "by": e["src"]})
            top = max(top, s)
    skipped = [
        (who, seq)
        for who, seq in history.items()
        if seq != list(range(seq[0], seq[0] + len(seq))) or healed_to.get(who, seq[0]) != seq[0]
    ]
    untiled: list[int] = []
    if elastic:
        wrong, untiled = _elastic_checks(ev)
    s = summarize(run)
    losses = s["total_losses"]
    return {
        "untiled_steps": untiled[:20],
        "holders_alive_at_a_loss": _holders_alive(ev, losses),
        "applied_twice_or_skipped": [
            f"{w[0]} life {w[1]}"
            + (f" after restore or heal {w[2]}" if w[2] else "")
            + (f" (healed to {healed_to[w]})" if w in healed_to else "")
            + f": {q}"
            for w, q in skipped
        ][:10],
        "never_committed": sorted(set(range(steps)) - set(first_commit))[:20],
        "digest_mismatches": wrong[:20],
        "steps_trained_again": len(regressions),
        "total_losses": losses,
        "summary": s,
    }


def _elastic_checks(ev: list[dict[str, Any]]) -> tuple[list[tuple[str, int]], list[int]]:
    """(commits whose digest differs from another member's for the same step and epoch,
    steps whose last committing epoch did not consume the global batch exactly once)."""
    digests: dict[tuple[int, int], dict[str, str]] = defaultdict(dict)
    last: dict[int, int] = {}
    for e in ev:
        if e["event"] == "commit":
            if e.get("digest") is not None:
                digests[(e["step"], e["epoch"])][e["src"]] = e["digest"]
            last[e["step"]] = max(last.get(e["step"], -1), e["epoch"])
    wrong = [
        (src, step) for (step, _), by in digests.items() if len(set(by.values())) > 1 for src in by
    ]
    commits = [*ev, *unlogged_commits(ev)]  # (voted to commit, then died before its log)
    final = [e for e in commits if e["event"] == "commit" and e["epoch"] == last.get(e["step"])]
    return wrong, untiled_steps(shards_by_step(final))


def _holders_alive(ev: list[dict[str, Any]], losses: list[dict[str, Any]]) -> list[str]:
    """Workers that held the committed state, and had not exited or lost it (a
    ``state_lost`` fault), when an epoch was closed as a total loss (the state discarded
    while a live member held it: never allowed)."""
    out = []
    for loss in losses:
        first = min(
            (e for e in ev if e["event"] == "epoch" and e["epoch"] == loss["epoch"]),
            key=lambda e: e["mono"],
        )
        t, lost = first["mono"], first["lost"]
        last: dict[tuple[int, int], int] = {}
        exited = set()
        lives: dict[str, int] = {}
        for e in ev:
            if e["mono"] >= t:
                break
            if e["event"] == "worker_start":
                lives[e["src"]] = e["life"]
            elif e["event"] == "commit" and e["src"].startswith("rank "):
                last[(int(e["src"][5:]), lives.get(e["src"], 0))] = e["step"]
            elif e["event"] == "injected" and e["kind"] == "state_lost":
                # alive, but it holds no state any more (until it commits again)
                last.pop((int(e["src"][5:]), lives.get(e["src"], 0)), None)
            elif e["event"] == "worker_exit":
                exited.add((e["rank"], e["life"]))
        out += [
            f"rank {r} life {n} (epoch {loss['epoch']})"
            for (r, n), step in last.items()
            if step >= lost - 1 and (r, n) not in exited
        ]
    return out


def recovery_by_kind(s: dict[str, Any], sent: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The survivors' next commit after each injected fault, by kind (ms), and over every
    kind (the last row, ``all``)."""
    by: dict[str, list[float]] = defaultdict(list)
    unrecovered: dict[str, int] = defaultdict(int)
    for f in s["faults"]:
        if "injected" not in f["seen_as"]:
            continue
        if f["recover_ms"] is None:
            unrecovered[f["kind"]] += 1
        else:
            by[f["kind"]].append(f["recover_ms"])
    kinds = sorted(set(by) | set(unrecovered) | {f["kind"] for f in sent})
    rows = []
    for k in kinds:
        v = by.get(k, [])
        rows.append(
            {
                "kind": k,
                "sent": sum(f["kind"] == k for f in sent),
                "landed": len(v) + unrecovered.get(k, 0),
                "p50_ms": round(pct(v, 50), 1) if v else None,
                "p99_ms": round(pct(v, 99), 1) if v else None,
                "max_ms": round(max(v), 1) if v else None,
            }
        )
    every = [x for v in by.values() for x in v]
    rows.append(
        {
            "kind": "all",
            "sent": len(sent),
            "landed": len(every) + sum(unrecovered.values()),
            "p50_ms": round(pct(every, 50), 1) if every else None,
            "p99_ms": round(pct(every, 99), 1) if every else None,
            "max_ms": round(max(every), 1) if every else None,
        }
    )
    return rows


def stalls(s: dict[str, Any], hang_timeout_s: float) -> dict[str, Any]:
    """Each landed fault's wait (the survivors' next commit) against its bound (issue 25:
    3 s; for a GIL hang, known only after the hang timeout, that + 3 s), and what explains
    a wait past it: other faults still in progress when it landed, or landing during its
    wait. A fault is in progress until the survivors' next commit and, where its rank was
    restarted, until that rank commits again (an elastic world goes on without a restarting
    rank, and the next fault may then leave it below ``--min-replicas``, waiting for that
    restart). ``isolated``: the waits of faults nothing overlapped; ``unexplained``: past
    the bound with nothing overlapping (a defect)."""
    landed = [f for f in s["faults"] if "injected" in f["seen_as"]]

    def ends(f: dict[str, Any]) -> float:
        """When ``f`` stops being in progress."""
        if f["recover_ms"] is None:
            return float("inf")
        return f["t"] + max(f["recover_ms"], f.get("rejoin_ms") or 0.0) / 1e3

    isolated: list[float] = []
    past = 0
    unexplained: list[dict[str, Any]] = []
    for f in landed:
        if f["recover_ms"] is None:
            continue
        wait_end = f["t"] + f["recover_ms"] / 1e3
        overlapped = [g for g in landed if g is not f and g["t"] <= wait_end and ends(g) >= f["t"]]
        bound = 1e3 * (3.0 + (hang_timeout_s if f["kind"] == "gil_hang" else 0.0))
        if not overlapped:
            isolated.append(f["recover_ms"])
        if f["recover_ms"] > bound:
            past += 1
            if not overlapped:
                unexplained.append({k: f.get(k) for k in ("kind", "rank", "step", "recover_ms")})
    return {
        "isolated": {
            "faults": len(isolated),
            "p50_ms": round(pct(isolated, 50), 1) if isolated else None,
            "p99_ms": round(pct(isolated, 99), 1) if isolated else None,
            "max_ms": round(max(isolated), 1) if isolated else None,
        },
        "past_bound": past,
        "past_bound_overlapped": past - len(unexplained),
        "unexplained": unexplained,
    }


def spares_under_load(ev: list[dict[str, Any]]) -> dict[str, Any]:
    """Warm spares under the soak's load (issue 37): each spare's warm-up (``spare_start``
    to ``spare_ready``), each used spare's refill (handed out to its replacement ready:
    the agent starts the replacement once the worker that took it has recovered, so this
    is the pool's gap, not a start's cost) and how the restarts started. Hand-outs are
    matched first-in first-out to the spares started after them."""
    started: dict[int, float] = {}
    ready: dict[int, float] = {}
    handed: list[float] = []
    waiting: list[float] = []  # hand-outs whose replacement has not started yet
    replacing: dict[int, float] = {}  # a replacement's pid -> the hand-out it replaces
    how: dict[str, int] = defaultdict(int)
    for e in ev:
        if e["event"] == "spare_start":
            started[e["pid"]] = e["mono"]
            if waiting:
                replacing[e["pid"]] = waiting.pop(0)
        elif e["event"] == "spare_ready":
            ready[e["pid"]] = e["mono"]
        elif e["event"] == "spawn" and e.get("life", 0) > 0:
            kind = "spare" if e.get("warm") else ("fork" if e.get("how") == "fork" else "spawn")
            how[kind] += 1
            if e.get("warm"):
                handed.append(e["mono"])
                waiting.append(e["mono"])
    warm = [1e3 * (ready[p] - t) for p, t in started.items() if p in ready]
    refill = [1e3 * (ready[p] - t) for p, t in replacing.items() if p in ready]

    def dist(v: list[float]) -> dict[str, Any]:
        return {
            "n": len(v),
            "p50_ms": round(pct(v, 50), 1) if v else None,
            "p99_ms": round(pct(v, 99), 1) if v else None,
            "max_ms": round(max(v), 1) if v else None,
        }

    return {
        "warm_up": dist(warm),
        "refill": dist(refill),
        "handed_out": len(handed),
        "never_refilled": len(handed) - len(refill),
        "restarts_by_start": dict(how),
    }


def failed_line(run: Path) -> str | None:
    """The launcher's ``fastft: job failed: ...`` line (why the job failed), or None."""
    try:
        text = (run / "launcher.log").read_text(errors="replace")
    except OSError:
        return None
    found = re.findall(r"^fastft: job failed: (.*)$", text, flags=re.M)
    return found[-1][:300] if found else None


HANGS = ("gil_hang", "sigstop")
"""The kinds of fault a hang check should find (a stopped process makes no progress)."""


def hang_kills(
    events: list[dict[str, Any]], sent: list[dict[str, Any]], within_s: float
) -> dict[str, Any]:
    """The agents' hang kills, and those of a rank no hang was sent to in the
    ``within_s`` before (false kills: a healthy worker taken for hung), with their
    timeouts."""
    hung = [e for e in events if e["event"] == "worker_hung"]
    false = [
        {k: e.get(k) for k in ("rank", "silent_s", "timeout_s", "between")}
        for e in hung
        if not any(
            f["kind"] in HANGS
            and f["rank"] == e["rank"]
            and 0 <= e["detected"] - f["mono"] <= within_s
            for f in sent
        )
    ]
    timeouts = [e["timeout_s"] for e in hung if not e.get("between")]
    return {
        "kills": len(hung),
        "false": false,
        "timeout_s": {
            "min": min(timeouts, default=None),
            "p50": round(pct(timeouts, 50), 3) if timeouts else None,
            "max": max(timeouts, default=None),
        },
    }


def report(one: dict[str, Any]) -> None:
    result = one["result"]
    print(table(one["rows"], ["kind", "sent", "landed", "p50_ms", "p99_ms", "max_ms"]))
    stall = result["stalls"]
    iso = stall["isolated"]
    print(
        f"waits past their bound: {stall['past_bound']} ({stall['past_bound_overlapped']} "
        f"overlapped by other faults, {len(stall['unexplained'])} unexplained); the "
        f"{iso['faults']} faults nothing overlapped: p50 {iso['p50_ms']} ms, p99 "
        f"{iso['p99_ms']} ms, max {iso['max_ms']} ms"
    )
    print(json.dumps({k: v for k, v in result.items() if k != "total_losses"}, indent=1))


def side_by_side(soaks: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per figure, one column per variant (start method or hang check)."""

    def ms(v: Any) -> str:
        return "-" if v is None else f"{v / 1e3:.2f} s" if v >= 1000 else f"{v:.0f} ms"

    def dist(d: dict[str, Any]) -> str:
        return f"{ms(d['p50_ms'])} / {ms(d['p99_ms'])} / {ms(d['max_ms'])} (n {d.get('n', d.get('faults'))})"

    figures: dict[str, Any] = {
        "ok (every check held)": lambda r, rows: r["ok"],
        "faults sent / landed": lambda r, rows: f"{r['faults_sent']} / {rows[-1]['landed']}",
        "survivors' next commit, all kinds: p50 / p99 / max": lambda r, rows: dist(
            {**rows[-1], "n": rows[-1]["landed"]}
        ),
        "faults nothing overlapped: p50 / p99 / max": lambda r, rows: dist(r["stalls"]["isolated"]),
        "waits past their bound (overlapped, unexplained)": lambda r, rows: (
            f"{r['stalls']['past_bound']} ({r['stalls']['past_bound_overlapped']}, "
            f"{len(r['stalls']['unexplained'])})"
        ),
        "total losses (steps trained again)": lambda r, rows: (
            f"{len(r['total_losses'])} ({r['steps_trained_again']})"
        ),
        "committed steps/s vs fault-free": lambda r, rows: r["rate_vs_reference"],
        "hang kills (of a rank sent no hang); timeout p50": lambda r, rows: (
            f"{r['hangs']['kills']} ({len(r['hangs']['false'])}); {r['hangs']['timeout_s']['p50']} s"
        ),
        "restarts: on a spare / forked / spawned": lambda r, rows: " / ".join(
            str(r["spares"]["restarts_by_start"].get(k, 0)) for k in ("spare", "fork", "spawn")
        ),
        "a spare's warm-up: p50 / p99 / max": lambda r, rows: dist(r["spares"]["warm_up"]),
        "a used spare's refill: p50 / p99 / max": lambda r, rows: dist(r["spares"]["refill"]),
        "spares handed out (never refilled)": lambda r, rows: (
            f"{r['spares']['handed_out']} ({r['spares']['never_refilled']})"
        ),
    }
    return [
        {"figure": name, **{m: f(one["result"], one["rows"]) for m, one in soaks.items()}}
        for name, f in figures.items()
    ]
