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


class _GetTimeout(Exception):
    pass


class _ActorError(Exception):
    pass


class _Node:
    """A node agent actor or standby as the driver's ``_Nodes`` calls it."""

    def __init__(self, name: str, answers: bool = True, lines=(), rc=None) -> None:
        self.name, self.answers, self.lines, self.rc = name, answers, list(lines), rc
        self.told: list[dict] = []
        self.go = _Call(self._go)
        self.poll = _Call(lambda offset: {"lines": self.lines, "rc": self.rc})

    def _go(self, env: dict) -> bool:
        if not self.answers:
            raise _GetTimeout()
        self.told.append(env)
        return True


def _fake_ray(killed: list):
    exceptions = SimpleNamespace(RayActorError=_ActorError, GetTimeoutError=_GetTimeout)
    return SimpleNamespace(
        get=lambda value, timeout=None: value,
        wait=lambda refs, timeout=None: (refs, []),
        kill=lambda a, no_restart=False: killed.append(a.name),
        exceptions=exceptions,
    )


def test_a_dead_agent_is_replaced_by_its_standby_and_never_by_two():
    from fastft.ray.driver import _Nodes

    made: list[_Node] = []

    def make(i: int, *, holds: bool = True, warm: bool = False) -> _Node:
        made.append(_Node(f"n{i}-{'standby' if not holds else 'agent'}-{len(made)}"))
        return made[-1]

    killed: list[str] = []
    standby, quiet = _Node("s0"), _Node("s1", answers=False)
    nodes = _Nodes(
        _fake_ray(killed), [_Node("a0"), _Node("a1")], [standby, quiet], make, [True, True]
    )
    nodes.gpus[0] = "2,3"
    nodes.replace(0, "standby")  # (told, with the dead agent's GPUs)
    assert nodes.actors[0] is standby and standby.told == [{"CUDA_VISIBLE_DEVICES": "2,3"}]
    assert nodes.standbys[0] is made[-1] and killed == []  # (a new standby for next time)
    nodes.replace(1, "standby")  # (its standby does not answer: killed, a new agent told)
    assert killed == ["s1"] and nodes.actors[1] is made[-2] and made[-2].told == [{}]
    assert nodes.standbys[1] is made[-1]


def test_the_driver_says_when_a_standby_is_warm_or_ended():
    from fastft.ray.driver import _Nodes

    cold, ended = _Node("s0"), _Node("s1", lines=["fastft: error: bad flag"], rc=2)
    nodes = _Nodes(_fake_ray([]), [_Node("a0"), _Node("a1")], [cold, ended], None, [True, True])
    assert nodes.watch_standby(0) is None  # (not warm yet: nothing said)
    cold.lines = ["fastft: standby agent of node 0 warm in 3.1 s; ..."]
    assert nodes.watch_standby(0) == "fastft ray: node 0's standby agent is warm"
    assert nodes.watch_standby(0) is None  # (said once)
    said = nodes.watch_standby(1)
    assert said is not None and "ended (2); none for it: fastft: error: bad flag" in said
    assert nodes.standbys[1] is None
