"""``fastft ray run``'s driver without a cluster: it gathers each node's events file that is
not its own (another machine's) into ``RUN_DIR/node<i>/``, in chunks, leaving its own
alone; ``fastft.ray.run`` puts ``--nproc`` in each node's flags."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

from fastft.ray.agent import file_identity
from fastft.ray.driver import gather_events


class _Call:
    def __init__(self, fn):
        self.remote = fn


class _Agent:
    """A node agent actor whose events file is ``data`` on machine ``where``."""

    def __init__(self, where, data: bytes, chunk: int = 7) -> None:
        self.where, self.data, self.chunk = where, data, chunk
        self.events = _Call(self._events)

    def _events(self, offset: int) -> dict:
        if self.where is None:
            return {"where": None, "data": b"", "size": 0}
        return {
            "where": list(self.where),  # (as Ray returns it: a tuple may come back a list)
            "data": self.data[offset : offset + self.chunk],
            "size": len(self.data),
        }


class _Dead:
    def __init__(self) -> None:
        self.events = _Call(self._events)

    def _events(self, offset: int) -> dict:
        raise RuntimeError("The actor died unexpectedly before finishing this task.")


FAKE_RAY = SimpleNamespace(get=lambda value, timeout=None: value)


def test_another_machines_events_are_copied_and_the_drivers_own_are_not(tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text('{"event": "mine"}\n')
    own = _Agent(file_identity(run / "events.jsonl"), b"never read")
    theirs = b"".join(b'{"event": "commit", "step": %d}\n' % i for i in range(20))
    other = _Agent(("another-host", 1, 2), theirs)
    out = io.StringIO()
    gather_events(FAKE_RAY, [own, other, _Agent(None, b""), _Dead()], run, out)
    assert not (run / "node0").exists()
    assert (run / "node1" / "events.jsonl").read_bytes() == theirs  # (every chunk, in order)
    assert not (run / "node2").exists()  # (a node without events)
    assert (run / "events.jsonl").read_text() == '{"event": "mine"}\n'
    said = out.getvalue()
    assert f"node 1's events: {run / 'node1' / 'events.jsonl'}" in said
    assert "node 3's events could not be read: The actor died" in said, said


def test_the_python_entry_point_puts_nproc_in_each_nodes_flags():
    import pytest

    from fastft.errors import RayJobError
    from fastft.ray.plan import with_nproc as _with_nproc

    assert _with_nproc(["train.py", "--nproc", "9"], 4) == [
        "--nproc",
        "4",
        "train.py",
        "--nproc",
        "9",
    ]
    assert _with_nproc(["--step-time", "0.1", "--nproc", "4", "-m", "m"], 4)[:4] == [
        "--step-time", "0.1", "--nproc", "4",
    ]  # fmt: skip
    assert _with_nproc(["--nproc=4", "t.py"], 4) == ["--nproc=4", "t.py"]
    with pytest.raises(RayJobError, match="--nproc 2 in argv, but nproc=4"):
        _with_nproc(["--nproc", "2", "t.py"], 4)
