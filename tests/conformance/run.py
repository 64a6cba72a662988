"""torchft's own tests against ManagerFFT (``make conformance``; CI runs it after the tests).

Runs the test files torchft ships in its wheel with ``torchft.Manager`` rebound to
``ManagerFFT`` (the ``fastft_conformance`` plugin beside this file):

* plain mode: ManagerFFT without a bus, every file that runs on CPU;
* bus mode: the integration files, every ManagerFFT on an error bus.

First the same files run with torchft's own ``Manager`` (the reference: what passes on
this machine, and the numeric fixtures ``diloco_regression_test`` compares with, which the
wheel leaves out). A test that passes there and fails against ManagerFFT fails the run.
Prints a summary (passed, failed, torchft's own skips with their reasons, exclusions with
theirs) and writes it to ``tests/conformance/summary.json``; exits 1 on a regression.

    python tests/conformance/run.py [--mode plain|bus|both]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PLAIN = [
    "torchft.manager_test",
    "torchft.lighthouse_test",
    "torchft.ddp_test",
    "torchft.optim_test",
    "torchft.local_sgd_test",
    "torchft.reconfigure_test",
    "torchft.manager_integ_test",
    "torchft.local_sgd_integ_test",
    "torchft.diloco_regression_test",
]
BUS = ["torchft.manager_integ_test", "torchft.local_sgd_integ_test"]


def run(
    mode: str, modules: list[str], timeout_s: float, fixtures: Path, label: str = ""
) -> dict[str, Any]:
    """One pytest run of ``modules`` (dotted names, or file::Class::test ids) with
    ManagerFFT in ``mode``; ``label`` names the run (its mode by default)."""
    label = label or mode
    xml = HERE / f".junit-{label}.xml"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        "WRITE_FIXTURE": "true" if mode == "torchft" else "false",
    }
    cmd = [
        *(sys.executable, "-m", "pytest", "-q", "-p", "fastft_conformance"),
        *("--fastft-mode", mode, f"--fastft-fixtures={fixtures}"),
        *("-p", "no:cacheprovider", "-rs", "--timeout", "300", f"--junitxml={xml}"),
        *(("--pyargs", *modules) if "::" not in modules[0] else modules),
    ]
    print(f"--- {label}: {' '.join(modules)}", flush=True)
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, cwd=HERE, timeout=timeout_s)
    took = time.monotonic() - t0
    passed, failed, skipped = [], [], []
    if not xml.exists():  # pytest did not get as far as running anything
        print(f"--- {label}: pytest exited {p.returncode} without a report", flush=True)
        failed = [m for m in modules if "::" in m]
    for c in ET.parse(xml).getroot().iter("testcase") if xml.exists() else ():
        name = f"{c.get('classname', '').split('site-packages.')[-1]}::{c.get('name')}"
        if c.find("failure") is not None or c.find("error") is not None:
            failed.append(name)
        elif (s := c.find("skipped")) is not None:
            skipped.append(f"{name}: {s.get('message', '')}")
        else:
            passed.append(name)
    xml.unlink(missing_ok=True)
    return {
        "mode": label,
        "exit_code": p.returncode,
        "seconds": round(took),
        "passed": passed,
        "failed": failed,
        "skipped": skipped,
    }


def _node(name: str) -> str:
    """``torchft.x_test.Class::test`` -> the file's pytest node id."""
    dotted, test = name.split("::")
    module, cls = dotted.rsplit(".", 1)
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, module
    return f"{spec.origin}::{cls}::{test}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("plain", "bus", "both"), default="both")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per mode")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from fastft_conformance import EXCLUDED

    with tempfile.TemporaryDirectory(prefix="fastft-fixtures-") as tmp:
        fixtures = Path(tmp)
        # The reference: torchft's Manager on this machine, which also writes the numeric
        # fixtures diloco_regression_test compares ManagerFFT's runs with.
        ref = run("torchft", PLAIN, args.timeout, fixtures)
        results = [
            run(mode, modules, args.timeout, fixtures)
            for mode, modules in (("plain", PLAIN), ("bus", BUS))
            if args.mode in (mode, "both")
        ]
        for r in results:
            # A test that fails once is run again alone: torchft's integration tests race
            # (e.g. test_ddp_skip_init_sync seeds a torch RNG that the other replica's
            # thread is drawing from). It counts as flaky, reported, not as passed.
            again = (
                run(r["mode"], [_node(f) for f in r["failed"]], 600, fixtures, f"{r['mode']}-retry")
                if r["failed"]
                else None
            )
            r["flaky"] = [f for f in r["failed"] if again and f in again["passed"]]
            r["failed"] = [f for f in r["failed"] if f not in r["flaky"]]
    ok_ref = set(ref["passed"])
    print(
        f"torchft's Manager: {len(ok_ref)} passed, {len(ref['failed'])} failed, {ref['seconds']} s"
    )
    bad = False
    for r in results:
        r["regressions"] = [f for f in r["failed"] if f in ok_ref]
        r["fail_with_torchft_too"] = [f for f in r["failed"] if f not in ok_ref]
        bad = bad or bool(r["regressions"]) or r["exit_code"] not in (0, 1)
        print(
            f"{r['mode']}: {len(r['passed'])} passed, {len(r['regressions'])} failed, "
            f"{len(r['skipped'])} skipped by torchft, {r['seconds']} s"
        )
        for f in r["regressions"]:
            print(f"  FAILED {f}")
        for f in r["flaky"]:
            print(f"  flaky (failed, then passed alone): {f}")
        for f in r["fail_with_torchft_too"]:
            print(f"  fails with torchft's Manager too: {f}")
        for s in r["skipped"]:
            print(f"  skipped by torchft: {s}")
    print(f"excluded: {len(EXCLUDED)}" + "".join(f"\n  {k}: {v}" for k, v in EXCLUDED.items()))
    summary = {"reference": ref, "results": results, "excluded": EXCLUDED}
    (HERE / "summary.json").write_text(json.dumps(summary, indent=2))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
