"""The CUDA and NCCL paths, checked on a GPU machine (CI has none): run it where
``torch.cuda.is_available()``. Results go to ``bench/results/gpu_check.json`` (or
``--out``) and a printed table; exit 1 if a check fails, 2 without a GPU.

1. ``nccl wait``: the interruptible wait on an NCCL work (a one-rank group: NCCL refuses two
   ranks on one GPU). Its cost on fault-free allreduces against ``work.wait()`` plus
   ``torch.cuda.synchronize()``; a collective stuck behind a long kernel, released by an
   interrupt (latency from the interrupt to the raise), the communicator aborted (time),
   and a new group built and used after it.
2. ``nccl run``: ``fastft run --backend nccl --nproc 1``, the demo's model on the GPU, an
   exception injected: the step rolls back, the next epoch builds a new NCCL group, and the
   final state equals the fault-free run's (S5).
3. ``demo cuda`` / ``demo cuda elastic``: ``fastft demo --device cuda``: 4 workers sharing
   the GPUs (Gloo on CUDA tensors when they are fewer than the workers, NCCL otherwise),
   one fault of each kind, S5 checked by the demo itself; once more with warm spares that
   do not create a CUDA context ahead of time (``--no-spare-cuda``), for the difference.
4. ``demo nccl``: the same demo with a GPU per worker (NCCL), on machines with two GPUs or
   more; elsewhere its row says it was not run.

    python bench/gpu_check.py [--only nccl-wait,nccl-run,demo,demo-no-spare-cuda,demo-elastic,demo-nccl]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table, write  # noqa: E402

from fastft.interrupt import Interrupter, StepInterrupted, allreduce  # noqa: E402


def _nccl_group(prefix: str) -> Any:
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=60)
    return dist.ProcessGroupNCCL(dist.PrefixStore(prefix, dist.HashStore()), 0, 1, opts)


def check_nccl_wait(ops: int = 300, numel: int = 1 << 20) -> dict[str, Any]:
    """The runtime's interruptible allreduce on NCCL against NCCL's own wait."""
    torch.cuda.set_device(0)
    pg = _nccl_group("a")
    it = Interrupter().install()
    it.begin_step(0, 0)
    t = torch.ones(numel, device="cuda")
    for _ in range(20):
        allreduce(pg, [t], it)

    def per_op(fn: Any) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(ops):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / ops * 1e6

    def nccl_own() -> None:
        pg.allreduce([t]).wait()
        torch.cuda.synchronize()

    # interleaved, three rounds each: the machine's noise hits both alike
    ours, own = [], []
    for _ in range(3):
        ours.append(per_op(lambda: allreduce(pg, [t], it)))
        own.append(per_op(nccl_own))
    ours_us, own_us = sorted(ours)[1], sorted(own)[1]

    # a collective stuck behind a 3 s kernel: only an interrupt (and an abort) ends the wait
    try:
        hz = torch.cuda.clock_rate() * 1e6  # MHz, through NVML
    except Exception:
        hz = 2.0e9
    torch.cuda._sleep(int(3.0 * hz))  # type: ignore[attr-defined]
    said: list[float] = []

    def fault() -> None:
        said.append(time.perf_counter())
        it.interrupt("rank 1 died (gpu_check)")

    threading.Timer(0.1, fault).start()
    t0 = time.perf_counter()
    raised = False
    try:
        allreduce(pg, [t], it)
    except StepInterrupted:
        raised = True
    t_raise = time.perf_counter()
    released_ms = (t_raise - said[0]) * 1e3 if said and raised else None
    t1 = time.perf_counter()
    pg.abort()
    abort_ms = (time.perf_counter() - t1) * 1e3
    it.begin_step(1, 0)
    t2 = time.perf_counter()
    pg2 = _nccl_group("b")
    y = torch.full((1024,), 2.0, device="cuda")
    allreduce(pg2, [y], it)
    new_group_ok = bool((y == 2.0).all().item())
    rebuilt_ms = (time.perf_counter() - t2) * 1e3
    it.close()
    ok = raised and new_group_ok and released_ms is not None and released_ms < 50
    return {
        "check": "nccl wait",
        "ok": ok,
        "allreduce_bytes": numel * 4,
        "runtime_wait_us": round(ours_us, 1),
        "nccl_wait_sync_us": round(own_us, 1),
        "interrupt_to_raise_ms": None if released_ms is None else round(released_ms, 3),
        "blocked_ms": round((t_raise - t0) * 1e3, 1),
        "abort_ms": round(abort_ms, 1),
        "new_group_and_allreduce_ms": round(rebuilt_ms, 1),
    }


def _fastft(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastft.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def check_nccl_run(root: Path, steps: int = 60) -> dict[str, Any]:
    from fastft.report import summarize
    from fastft.runtime import read_events

    digests, backends, figures = {}, {}, None
    for name, plan in (
        ("clean", None),
        ("faulty", {"kind": "exception", "rank": 0, "at_step": 20}),
    ):
        run = root / f"nccl-{name}"
        run.mkdir(parents=True)
        flags = ["--nproc", "1", "--backend", "nccl", "--run-dir", str(run), "--job", name]
        if plan:
            (run / "plan.json").write_text(json.dumps({"faults": [plan]}))
            flags += ["--inject", str(run / "plan.json")]
        r = _fastft(
            "run",
            *flags,
            *("-m", "fastft.demo.train", "--", "--steps", str(steps), "--device", "cuda"),
            *("--out", str(run / "out")),
        )
        if r.returncode != 0:
            return {"check": "nccl run", "ok": False, "error": (r.stderr or r.stdout)[-1500:]}
        digests[name] = json.loads((run / "out" / "final-rank0.json").read_text())["digest"]
        backends[name] = sorted(
            {e.get("backend") for e in read_events(run) if e.get("event") == "process_group"}
        )
        if plan:
            figures = summarize(run)
    assert figures is not None
    groups = sum(1 for e in read_events(root / "nccl-faulty") if e.get("event") == "process_group")
    ok = (
        digests["clean"] == digests["faulty"]
        and backends == {"clean": ["nccl"], "faulty": ["nccl"]}
        and groups >= 2
        and figures["steps_rolled_back"] >= 1
        and bool(figures["faults"])
        and all(f["recovered"] for f in figures["faults"])
    )
    return {
        "check": "nccl run",
        "ok": ok,
        "backends": backends,
        "nccl_groups_built": groups,
        "rolled_back": figures["steps_rolled_back"],
        "recover_ms": [f.get("recover_ms") for f in figures["faults"]],
        "digest_clean": digests["clean"],
        "digest_faulty": digests["faulty"],
    }


def check_demo(
    root: Path,
    elastic: bool,
    logs: Path | None,
    spare_cuda: bool = True,
    nproc: int = 4,
    name: str = "",
) -> dict[str, Any]:
    name = name or ("demo cuda elastic" if elastic else "demo cuda")
    if not spare_cuda:
        name += " (spares without CUDA)"
    run = root / name.replace(" ", "-").replace("(", "").replace(")", "")
    t0 = time.monotonic()
    extra = () if spare_cuda else ("--no-spare-cuda",)
    code = (
        "from fastft.demo.main import run_demo; raise SystemExit(run_demo("
        f"run_dir={str(run)!r}, nproc={nproc}, elastic={elastic}, device='cuda', "
        f"extra_flags={extra!r}))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=500)
    if logs is not None:  # the demo's report: its timeline says where recoveries spend time
        (logs / f"{run.name}.log").write_text(r.stdout + r.stderr)
    from fastft.report import summarize
    from fastft.runtime import read_events

    out = {"check": name, "ok": r.returncode == 0, "s": round(time.monotonic() - t0, 1)}
    try:
        figures = summarize(run / "faulty")
        out["recover_ms"] = [f.get("recover_ms") for f in figures["faults"]]
        out["backends"] = sorted(
            {
                e.get("backend")
                for e in read_events(run / "faulty")
                if e.get("event") == "process_group"
            }
        )
    except FileNotFoundError:
        pass
    tail = [ln for ln in r.stdout.splitlines() if ln.strip()][-3:]
    out["result"] = " / ".join(tail)
    if r.returncode != 0:
        out["error"] = r.stderr[-1500:]
    return out


def check_demo_nccl(root: Path, logs: Path | None) -> dict[str, Any]:
    """The demo on NCCL: one GPU per worker, so it needs two GPUs at least."""
    gpus = torch.cuda.device_count()
    if gpus < 2:
        return {"check": "demo nccl", "ok": None, "not_run": f"needs 2 GPUs, {gpus} visible"}
    row = check_demo(root, False, logs, nproc=min(4, gpus), name="demo nccl")
    row["ok"] = row["ok"] and row.get("backends") == ["nccl"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--only", default="nccl-wait,nccl-run,demo,demo-no-spare-cuda,demo-elastic,demo-nccl"
    )
    ap.add_argument("--out", type=Path, default=None, help="also copy the JSON here")
    ap.add_argument("--logs", type=Path, default=None, help="write the demos' output here")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible; run it on a GPU machine", file=sys.stderr)
        return 2
    meta = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    print(json.dumps(meta), flush=True)
    only = set(a.only.split(","))
    root = Path(tempfile.mkdtemp(prefix="fastft-gpu-"))
    rows: list[dict[str, Any]] = []
    checks = [
        ("nccl-wait", check_nccl_wait),
        ("nccl-run", lambda: check_nccl_run(root)),
        ("demo", lambda: check_demo(root, False, a.logs)),
        ("demo-no-spare-cuda", lambda: check_demo(root, False, a.logs, spare_cuda=False)),
        ("demo-elastic", lambda: check_demo(root, True, a.logs)),
        ("demo-nccl", lambda: check_demo_nccl(root, a.logs)),
    ]
    for key, fn in checks:
        if key not in only:
            continue
        try:
            row = fn()
        except Exception as e:  # a check that breaks is a failed check, the others still run
            row = {"check": key, "ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(row), flush=True)
        rows.append(row)
    path = write("gpu_check", rows, meta)
    if a.out:
        a.out.write_text(path.read_text())
    print()
    shown = [{"check": r["check"], "ok": r.get("not_run") or r["ok"]} for r in rows]
    print(table(shown, ["check", "ok"]))
    return 0 if rows and all(r["ok"] is not False for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
