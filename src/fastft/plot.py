"""``fastft report RUN_DIR --plot timeline.png`` (and ``--html report.html``): a run's
timeline drawn with matplotlib (``pip install 'fastft[plot]'``).

Top: the committed step over time (a fault shows as a flat stretch). Below, one row per
rank: each worker life as a bar (its start to its exit), its commits as ticks, rollbacks
as orange crosses, heals as green bars (receiver side), faults as red markers with their
kind; dashed lines where an epoch formed; each fault annotated with its detection and the
survivors' next commit (from :func:`fastft.report.summarize`). Time is in seconds from the
run's first event.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from fastft.process.events import read_events
from fastft.report import render_report, summarize

__all__ = ["plot_timeline", "write_html"]


def _rank(e: dict[str, Any]) -> int | None:
    if isinstance(e.get("rank"), int) and str(e.get("src", "")).startswith("agent"):
        return int(e["rank"])
    kind, _, n = str(e.get("src", "")).partition(" ")
    return int(n) if kind in ("rank", "replica") and n.isdigit() else None


def _figure(run_dir: str | Path) -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as missing:
        raise RuntimeError(
            "--plot and --html need matplotlib: pip install 'fastft[plot]'"
        ) from missing
    ev = read_events(run_dir)
    if not ev:
        raise RuntimeError(f"{run_dir}: no events to draw")
    first = min(e["mono"] for e in ev)
    commits = [e["mono"] for e in ev if e["event"] == "commit"]
    # from just before the first commit: start-up (imports, the first epoch) is said in
    # the title, not drawn (it would take most of the width)
    t0 = min(commits) if commits else first
    startup = t0 - first
    s = summarize(run_dir)
    ranks = sorted({r for e in ev if (r := _rank(e)) is not None})
    row = {r: i for i, r in enumerate(ranks)}
    fig, (top, ax) = plt.subplots(
        2,
        1,
        figsize=(12, 2.8 + 0.55 * len(ranks)),
        sharex=True,
        gridspec_kw={"height_ratios": [1.6, max(1.5, 0.55 * len(ranks))]},
    )
    _progress(top, ev, t0)
    end = _lives(ax, ev, t0, row, commits)
    _marks(ax, top, ev, s, t0, row)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylim(-0.8, len(ranks) - 0.2)
    ax.invert_yaxis()
    ax.set_xlim(-0.5, end)
    ax.set_xlabel(f"seconds (0: the first commit; start-up took {startup:.1f} s before it)")
    ax.grid(axis="x", alpha=0.3)
    gp = s["goodput"]
    top.set_title(
        f"{Path(run_dir).name}: {s['outcome']['ended']}, {s['steps_committed']} steps committed, "
        f"{s['steps_rolled_back']} rolled back, {len(s['faults'])} faults, "
        f"{s['restarts']} restarts" + (f", goodput {gp:.2f}" if gp is not None else ""),
        fontsize=10,
    )
    _legend(ax)
    fig.tight_layout()
    return fig


def _progress(top: Any, ev: list[dict[str, Any]], t0: float) -> None:
    """The progress panel: the highest committed step over time."""
    pts, best = [], -1
    for e in sorted((e for e in ev if e["event"] == "commit"), key=lambda e: e["mono"]):
        if e["step"] > best:
            best = e["step"]
            pts.append((e["mono"] - t0, best + 1))
    if pts:
        top.step([p[0] for p in pts], [p[1] for p in pts], where="post", color="#1f77b4")
    top.set_ylabel("steps\ncommitted")
    top.grid(alpha=0.3)


def _lives(
    ax: Any, ev: list[dict[str, Any]], t0: float, row: dict[int, int], commits: list[float]
) -> float:
    """Each rank's row: its lives, commits, rollbacks and heals; the timeline's end."""
    starts: dict[int, float] = {}
    lives: dict[int, int] = {}
    shades = ("#c7c7c7", "#8c8c8c")  # alternate lives of a rank

    def life_bar(r: int, a: float, b: float) -> None:
        shade = shades[lives.get(r, 0) % 2]
        ax.plot([max(a, -0.5), b], [row[r], row[r]], color=shade, lw=6, solid_capstyle="butt")

    for e in sorted(ev, key=lambda e: e["mono"]):
        r, t = _rank(e), e["mono"] - t0
        if r is None or r not in row:
            continue
        y = row[r]
        if e["event"] == "worker_start":
            if r in starts:  # (its previous life's exit was not logged)
                life_bar(r, starts.pop(r), t)
                lives[r] = lives.get(r, 0) + 1
            starts[r] = t
        elif e["event"] in ("worker_exit", "worker_stop") and r in starts:
            life_bar(r, starts.pop(r), t)
            lives[r] = lives.get(r, 0) + 1
        elif e["event"] == "commit":
            ax.plot([t], [y], marker="|", color="#1f77b4", ms=7, alpha=0.5)
        elif e["event"] == "rollback":
            ax.plot([t], [y], marker="x", color="#ff7f0e", ms=8, mew=2)
        elif e["event"] == "heal" and e.get("role") == "fetch":
            ms = float(e.get("heal_ms", 0.0)) / 1e3
            ax.plot([t - ms, t], [y - 0.22, y - 0.22], color="#2ca02c", lw=4)
    # to just after the last commit (the workers' teardown after it is not drawn)
    end = (max(commits) if commits else max(e["mono"] for e in ev)) - t0 + 0.2
    for r, t in starts.items():
        life_bar(r, t, end)
    return end


def _marks(
    ax: Any, top: Any, ev: list[dict[str, Any]], s: dict[str, Any], t0: float, row: dict[int, int]
) -> None:
    """New epochs, the faults (detected, next commit) and the stragglers."""
    for t in sorted({e["mono"] - t0 for e in ev if e["event"] == "epoch"}):
        ax.axvline(t, color="#9467bd", ls="--", lw=0.7, alpha=0.5)
        top.axvline(t, color="#9467bd", ls="--", lw=0.7, alpha=0.5)
    for i, f in enumerate(s["faults"], 1):
        t = f["t"] - t0
        y = row.get(f["rank"], 0) if f["rank"] is not None else 0
        ax.plot([t], [y], marker="*", color="#d62728", ms=16, zorder=5)
        what = [f"#{i} {f['kind']} (rank {f['rank']})"]
        if f["detect_ms"] is not None:
            what.append(f"detected {f['detect_ms']:.0f} ms")
        if f["recover_ms"] is not None:
            what.append(f"next commit {f['recover_ms']:.0f} ms")
            top.axvspan(t, t + f["recover_ms"] / 1e3, color="#d62728", alpha=0.25)
        top.axvline(t, color="#d62728", lw=1)
        top.annotate(  # in the progress panel, clear of the rows
            "\n".join(what),
            (t, 0.97 - 0.33 * ((i - 1) % 3)),
            xycoords=("data", "axes fraction"),
            xytext=(4, 0),
            textcoords="offset points",
            va="top",
            fontsize=8,
            color="#d62728",
        )
    for x in s.get("stragglers", []):  # (a gray failure: no fault, every step waited)
        t, y = x["t"] - t0, row.get(x["rank"], 0)
        ax.plot([t], [y], marker="v", color="#8c564b", ms=12, zorder=5)
        ax.annotate(
            f"straggler {x['ratio']:.2f}x",
            (t, y),
            xytext=(6, -10),
            textcoords="offset points",
            fontsize=8,
            color="#8c564b",
        )


def _legend(ax: Any) -> None:
    """The legend, under the rows."""
    legend: list[tuple[str, dict[str, Any]]] = [
        ("worker life", dict(color="#c7c7c7", lw=6)),
        ("commit", dict(marker="|", color="#1f77b4", ls="")),
        ("rollback", dict(marker="x", color="#ff7f0e", ls="", mew=2)),
        ("heal (receiver)", dict(color="#2ca02c", lw=4)),
        ("fault", dict(marker="*", color="#d62728", ls="", ms=12)),
        ("straggler", dict(marker="v", color="#8c564b", ls="", ms=9)),
        ("new epoch", dict(color="#9467bd", ls="--", lw=0.7)),
    ]
    handles = [ax.plot([], [], **kw)[0] for _, kw in legend]
    ax.legend(
        handles,
        [n for n, _ in legend],
        loc="upper center",
        ncol=7,
        fontsize=8,
        bbox_to_anchor=(0.5, -0.25),
        frameon=False,
    )


def plot_timeline(run_dir: str | Path, out: str | Path) -> Path:
    """Draw ``run_dir``'s timeline into ``out`` (PNG, SVG or PDF by its suffix)."""
    import matplotlib.pyplot as plt

    fig = _figure(run_dir)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)


def write_html(run_dir: str | Path, out: str | Path) -> Path:
    """One self-contained HTML page: the timeline (an embedded PNG) and the report."""
    import matplotlib.pyplot as plt

    fig = _figure(run_dir)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    png = base64.b64encode(buf.getvalue()).decode()
    text = html.escape(render_report(run_dir, summarize(run_dir)))
    title = html.escape(f"fastft: the run in {Path(run_dir).name}")
    Path(out).write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head>"
        f"<body><h1>{title}</h1><img alt='timeline' src='data:image/png;base64,{png}'>"
        f"<pre>{text}</pre></body></html>\n"
    )
    return Path(out)
