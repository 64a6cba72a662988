"""A pytest plugin: torchft's own test files (shipped in its wheel) with ``torchft.Manager``
rebound to :class:`fastft.integrations.torchft.ManagerFFT`.

    pytest -p fastft_conformance --fastft-mode plain --pyargs torchft.manager_test ...

``--fastft-mode plain``: ManagerFFT without a bus (what a torchft user gets by changing
the class); ``bus``: every ManagerFFT joins an error bus on a TCPStore this plugin hosts on
127.0.0.1 (a fresh job id per test), its replica index read from the ``replica_id``
torchft's test gives it. ``EXCLUDED`` lists the tests left out, each with its reason; they
are reported at the end, apart from torchft's own skips.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest

EXCLUDED: dict[str, str] = {
    # test id (module::class::test) -> why it cannot run against ManagerFFT
}

_STATE: dict[str, Any] = {"job": "conformance", "store": None, "server": None}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fastft-mode", choices=("torchft", "plain", "bus"), default="plain")
    parser.addoption(
        "--fastft-fixtures",
        default=None,
        help="where diloco_regression_test's numeric fixtures are (the wheel leaves them "
        "out); with WRITE_FIXTURE=true, where they are written",
    )


def pytest_configure(config: pytest.Config) -> None:
    import torchft
    import torchft.manager

    from fastft.integrations.torchft import ManagerFFT, connect

    fixtures = config.getoption("--fastft-fixtures")
    if fixtures:
        _fixtures_in(Path(fixtures))
    config.addinivalue_line("markers", "fastft_excluded: left out of the conformance run")
    if config.getoption("--fastft-mode") == "torchft":
        return  # the reference: torchft's own Manager
    cls: type = ManagerFFT
    if config.getoption("--fastft-mode") == "bus":
        from fastft.bus import host_store
        from fastft.protocol.auth import JobSecret

        server = host_store()
        _STATE["server"] = server
        _STATE["store"] = f"127.0.0.1:{server.port}"
        # the job's secret: every replica of the run shares it (as under `fastft run`)
        secret_dir = Path(tempfile.mkdtemp(prefix="fastft-conformance-"))
        _STATE["secret"] = str(JobSecret.draw().save(secret_dir / "job.secret"))

        class BusManagerFFT(ManagerFFT):
            """ManagerFFT on the plugin's bus: one job per test, the replica index from
            the trailing digits of torchft's ``replica_id``."""

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                digits = re.search(r"(\d+)$", str(kwargs.get("replica_id") or "0"))
                replica = int(digits.group(1)) if digits else 0
                kwargs.setdefault(
                    "bus",
                    connect(
                        _STATE["store"],
                        _STATE["job"],
                        replica=replica,
                        replicas=replica + 1,
                        secret_file=_STATE["secret"],
                    ),
                )
                super().__init__(*args, **kwargs)

        cls = BusManagerFFT
    torchft.manager.Manager = cls  # type: ignore[misc]
    torchft.Manager = cls  # type: ignore[attr-defined,misc]


def _fixtures_in(where: Path) -> None:
    """Point ``diloco_regression_test``'s fixtures at ``where`` (its own lookup goes to
    ``site-packages/test_fixtures``, which the wheel does not ship): same read, same
    write, same comparison."""
    import torchft.diloco_regression_test as drt

    def handle_fixture(name: str, results: Any) -> Any:
        path = where / name
        if os.environ.get("WRITE_FIXTURE", "false").lower() == "true":
            where.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(results, indent=2))
            return None
        assert path.exists(), f"fixture {path} does not exist (run.py writes it first)"
        return json.loads(path.read_text())

    drt.handle_fixture = handle_fixture


@pytest.fixture(autouse=True)
def _fresh_job() -> None:
    _STATE["job"] = f"conformance-{uuid.uuid4().hex[:8]}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept, excluded = [], []
    for item in items:
        (excluded if _key(item) in EXCLUDED else kept).append(item)
    if excluded:
        config.hook.pytest_deselected(items=excluded)
        items[:] = kept
    config._fastft_excluded = [_key(i) for i in excluded]  # type: ignore[attr-defined]


def _key(item: pytest.Item) -> str:
    return item.nodeid.split("/")[-1]


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    tr = terminalreporter
    tr.section(f"fastft conformance ({config.getoption('--fastft-mode')} mode)")
    for key in getattr(config, "_fastft_excluded", []):
        tr.write_line(f"excluded: {key}: {EXCLUDED[key]}")
    for rep in tr.stats.get("skipped", []):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        tr.write_line(f"skipped by torchft: {rep.nodeid}: {reason}")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the run's secret (bus mode)."""
    import shutil

    if _STATE.get("secret"):
        shutil.rmtree(Path(_STATE["secret"]).parent, ignore_errors=True)
