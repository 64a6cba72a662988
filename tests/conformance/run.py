"""torchft's own tests against ManagerFFT (``make conformance``; CI runs it after the tests).

Runs the test files torchft ships in its wheel with ``torchft.Manager`` rebound to
``ManagerFFT`` (the ``fastft_conformance`` plugin beside this file):

* plain mode: ManagerFFT without a bus, every file that runs on CPU;
* bus mode: the integration files, every ManagerFFT on an error bus.

Prints a summary (passed, failed, torchft's own skips with their reasons, exclusions with
theirs) and writes it to ``tests/conformance/summary.json``; exits 1 if a test failed.

    python tests/conformance/run.py [--mode plain|bus|both]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

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


def run(mode: str, modules: list[str], timeout_s: float) -> dict[str, object]:
    xml = HERE / f".junit-{mode}.xml"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "TORCH_CPP_LOG_LEVEL": "ERROR",
    }
    cmd = [
        *(sys.executable, "-m", "pytest", "-q", "-p", "fastft_conformance"),
        *("--fastft-mode", mode, "-p", "no:cacheprovider", "-rs"),
        *("--timeout", "300", f"--junitxml={xml}", "--pyargs", *modules),
    ]
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, cwd=HERE, timeout=timeout_s)
    took = time.monotonic() - t0
    cases = ET.parse(xml).getroot().iter("testcase")
    out: dict[str, object] = {"mode": mode, "exit_code": p.returncode, "seconds": round(took)}
    passed, failed, skipped = [], [], []
    for c in cases:
        name = f"{c.get('classname')}::{c.get('name')}"
        if c.find("failure") is not None or c.find("error") is not None:
            failed.append(name)
        elif (s := c.find("skipped")) is not None:
            skipped.append(f"{name}: {s.get('message', '')}")
        else:
            passed.append(name)
    out.update(passed=len(passed), failed=failed, skipped=skipped)
    xml.unlink(missing_ok=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("plain", "bus", "both"), default="both")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per mode")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from fastft_conformance import EXCLUDED

    results = []
    for mode, modules in (("plain", PLAIN), ("bus", BUS)):
        if args.mode in (mode, "both"):
            results.append(run(mode, modules, args.timeout))
    summary = {"results": results, "excluded": EXCLUDED}
    (HERE / "summary.json").write_text(json.dumps(summary, indent=2))
    for r in results:
        print(
            f"{r['mode']}: {r['passed']} passed, {len(r['failed'])} failed, "  # type: ignore[arg-type]
            f"{len(r['skipped'])} skipped by torchft, {r['seconds']} s"  # type: ignore[arg-type]
        )
        for f in r["failed"]:  # type: ignore[attr-defined]
            print(f"  FAILED {f}")
    print(f"excluded: {len(EXCLUDED)} (reasons in tests/conformance/fastft_conformance.py)")
    return 1 if any(r["failed"] or r["exit_code"] not in (0, 5) for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
