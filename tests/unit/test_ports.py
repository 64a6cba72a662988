"""Parts decide and return; owners apply (issue 49). A part is handed its owner's port
(:class:`fastft.runtime.engine.ports.Engine`, :class:`fastft.runtime.ports.RuntimePorts`,
:class:`fastft.launch.ports.AgentPorts`, ``StepPorts``); it reads the port and calls its
methods, but never assigns an attribute of it or of anything reached through it, nor
mutates one of its containers in place (``.add``, ``.update``, ``[k] = v``...): the
owner's state changes only in the owner's methods."""

from __future__ import annotations

import ast
from pathlib import Path

import fastft

SRC = Path(fastft.__file__).parent
PORTS = {"Engine", "RuntimePorts", "AgentPorts", "StepPorts"}
MUTATORS = {
    "add",
    "append",
    "appendleft",
    "clear",
    "discard",
    "extend",
    "insert",
    "pop",
    "popleft",
    "remove",
    "setdefault",
    "update",
}


def _names(annotation: ast.expr) -> set[str]:
    return {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)} | {
        n.value
        for n in ast.walk(annotation)
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def _typed_ports(fn: ast.FunctionDef) -> set[str]:
    args = fn.args.args + fn.args.kwonlyargs
    return {a.arg for a in args if a.annotation is not None and _names(a.annotation) & PORTS}


class _Part:
    """One class (or module) of a part: which names and ``self`` attributes hold a port."""

    def __init__(self, body: list[ast.stmt]) -> None:
        self.body = body
        self.held: set[str] = set()  # self.<attr> holding a port
        for node in body:
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and _names(node.annotation) & PORTS
            ):
                self.held.add(node.target.id)
            if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                given = _typed_ports(node)
                for n in ast.walk(node):
                    if (
                        isinstance(n, ast.Assign)
                        and isinstance(n.value, ast.Name)
                        and n.value.id in given
                    ):
                        self.held |= {
                            t.attr
                            for t in n.targets
                            if isinstance(t, ast.Attribute)
                            and isinstance(t.value, ast.Name)
                            and t.value.id == "self"
                        }

    def _through(self, e: ast.expr, ports: set[str]) -> bool:
        """``e`` is an attribute or item reached through a port (``x.a``, ``self.x.a.b``,
        ``alias.a[k]``)."""
        attr_seen = False
        while isinstance(e, ast.Attribute | ast.Subscript):
            if isinstance(e, ast.Attribute):
                if isinstance(e.value, ast.Name) and e.value.id == "self" and e.attr in self.held:
                    return attr_seen
                attr_seen = True
            e = e.value
        return isinstance(e, ast.Name) and e.id in ports and attr_seen

    def writes(self) -> list[tuple[int, str]]:
        found = []
        for fn in self.body:
            if not isinstance(fn, ast.FunctionDef):
                continue
            ports = _typed_ports(fn)
            for n in ast.walk(fn):  # aliases: x = self.x, rt = self.rt, x = rt.engine
                if isinstance(n, ast.Assign) and len(n.targets) == 1:
                    t, v = n.targets[0], n.value
                    pairs = (
                        zip(t.elts, v.elts, strict=False)
                        if isinstance(t, ast.Tuple) and isinstance(v, ast.Tuple)
                        else [(t, v)]
                    )
                    for tt, vv in pairs:
                        if isinstance(tt, ast.Name) and (
                            (isinstance(vv, ast.Name) and vv.id in ports)
                            or (
                                isinstance(vv, ast.Attribute)
                                and (
                                    self._through(vv, ports)
                                    or (
                                        isinstance(vv.value, ast.Name)
                                        and vv.value.id == "self"
                                        and vv.attr in self.held
                                    )
                                )
                            )
                        ):
                            ports.add(tt.id)
            for n in ast.walk(fn):
                targets: list[ast.expr] = []
                if isinstance(n, ast.Assign | ast.Delete):
                    targets = list(n.targets)
                elif isinstance(n, ast.AugAssign | ast.AnnAssign):
                    targets = [n.target]
                for t in targets:
                    for tt in t.elts if isinstance(t, ast.Tuple) else [t]:
                        if self._through(tt, ports):
                            found.append((n.lineno, ast.unparse(tt)))
                if (
                    isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Attribute)
                    and n.func.attr in MUTATORS
                    and self._through(n.func.value, ports)
                    # (a store's add is a request to the store, not a container's)
                    and not (
                        isinstance(n.func.value, ast.Attribute) and n.func.value.attr == "store"
                    )
                ):
                    found.append((n.lineno, ast.unparse(n.func)))
        return found


def _writes(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    scopes = [tree.body] + [c.body for c in ast.walk(tree) if isinstance(c, ast.ClassDef)]
    rel = path.relative_to(SRC)
    return [f"{rel}:{line}: {what}" for body in scopes for line, what in _Part(body).writes()]


def test_no_part_writes_the_port_it_was_given():
    parts = [
        p
        for p in SRC.rglob("*.py")
        if p.name != "ports.py" and any(name in p.read_text() for name in PORTS)
    ]
    assert len(parts) >= 8, [str(p) for p in parts]  # (the scan found the parts)
    found = [w for p in parts for w in _writes(p)]
    assert found == [], "parts write their owner's state:\n" + "\n".join(found)


def test_the_scan_sees_each_kind_of_write():
    code = """
class Part:
    def __init__(self, x: Engine) -> None:
        self.x = x

    def go(self, rt: RuntimePorts) -> None:
        x = self.x
        x.view = None
        self.x.dead.add(1)
        rt.engine.suspect_state = True
        e = rt.engine
        e.counts[3] = 4
        x.store.add("k", 1)
        rt.registry.rollback()
"""
    tree = ast.parse(code)
    got = [
        what
        for body in [c.body for c in ast.walk(tree) if isinstance(c, ast.ClassDef)]
        for _, what in _Part(body).writes()
    ]
    want = {"x.view", "self.x.dead.add", "rt.engine.suspect_state", "e.counts[3]"}
    assert sorted(got) == sorted(want), got
