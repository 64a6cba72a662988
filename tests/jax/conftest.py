"""The JAX tier (``make test-jax``, which installs the ``jax`` extra first): fastft.jax in
process, and the fault catalogue against the JAX demo under ``fastft run``. Not collected
by ``make test`` (JAX is an extra); here a missing JAX fails, it is not skipped."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "fault"))  # (the fault tier's runs)

from _jaxruns import JAX_DEMO  # noqa: E402
from _runs import check_s1_s3, fastft_run, finals  # noqa: E402


@pytest.fixture(scope="session")
def clean_jax(tmp_path_factory) -> Path:
    """The fault-free run of the JAX demo (its finals in ``out/``)."""
    run = fastft_run(tmp_path_factory.mktemp("clean"), "clean", script=JAX_DEMO)
    check_s1_s3(run)
    f = finals(run)
    assert len(f) == 3 and len({v["digest"] for v in f.values()}) == 1
    return run
