"""Every node of a job runs the same collectives (issue 51): the settings that decide
which ones (``--decide``, ``--compare-every``, ``--shard-size``, ``--sync``) are recorded by
the first agent, and a node started with others fails at its start, saying which, instead
of its workers waiting in collectives the others never run until the group's timeout."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fastft.launch.control import same_settings
from fastft.launch.settings.config import LaunchConfig
from fastft.protocol import JobKeys


def cfg(**kw) -> LaunchConfig:
    # (a settings check needs no secret nor a real store address: only the flags)
    return LaunchConfig(command=("x.py",), **kw)


def test_the_first_node_records_the_settings_and_a_different_one_is_refused(store):
    keys = JobKeys("settings")
    same_settings(store, keys, cfg(decide="store"))  # the first: recorded
    same_settings(store, keys, cfg(decide="store"))  # alike: joins
    with pytest.raises(Exception, match=r"--decide collective here, store there"):
        same_settings(store, keys, cfg(decide="collective"))
    with pytest.raises(Exception, match=r"--compare-every 5 here, 40 there"):
        same_settings(store, keys, cfg(decide="store", compare_every=5))


@pytest.mark.timeout(60)
def test_a_node_started_with_another_decide_fails_at_start_with_exit_2(store, tmp_path):
    keys = JobKeys("settings2")
    same_settings(store, keys, cfg(decide="store"))  # (node 0's agent, recorded)
    p = subprocess.run(
        [sys.executable, "-m", "fastft.cli", "run", "--nnodes", "2", "--node-rank", "1",
         "--store", f"127.0.0.1:{store.port}", "--job", "settings2", "--decide", "collective",
         "--job-secret-file", str(_secret(tmp_path)), "--run-dir", str(tmp_path / "run"),
         "-m", "fastft.demo.train", "--", "--steps", "3"],
        capture_output=True, text=True, timeout=50,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr[-2000:]
    assert "--decide collective here, store there" in p.stderr, p.stderr[-2000:]


def _secret(tmp_path):
    from fastft.protocol.auth import JobSecret

    return JobSecret.draw().save(tmp_path / "job.secret")
