"""The fault tier's shared fixture: one clean run of the demo, every faulty run's reference."""

from __future__ import annotations

import pytest
from _runs import check_s1_s3, fastft_run, finals


@pytest.fixture(scope="session")
def clean(tmp_path_factory) -> dict[int, dict]:
    run = fastft_run(tmp_path_factory.mktemp("clean"), "clean")
    check_s1_s3(run)
    f = finals(run)
    assert len(f) == 3 and len({v["digest"] for v in f.values()}) == 1
    return f
