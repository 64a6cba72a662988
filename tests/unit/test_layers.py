"""The package's layers: no module imports from a layer above its own, and no import cycle
among the modules, counting every import: at module level, inside functions and for type
checking only (a cycle hidden in a lazy import or a ``TYPE_CHECKING`` block is still two
modules that cannot be read, tested or changed apart: issue 34)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fastft

SRC = Path(fastft.__file__).parent

LAYERS = [
    {"errors"},
    {"protocol"},
    {"fsm", "bus", "interrupt", "inject"},
    {"process"},
    {"runtime", "report", "metrics", "plot", "testing"},
    {
        "integrations",
        "jax",
        "lightning",
        "hf",
    },  # faces over the runtime: torchft, JAX, Lightning, HF
    {"launch"},
    {"ray"},  # node agents as Ray actors: the launcher's user
    {"sim"},  # the deterministic simulator: the runtime's and the agent's deciders
    {""},  # the package itself (its lazy ``fastft.init``)
    {"cli", "demo", "__main__"},  # the demo is a user of the public API
]
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def _module(path: Path) -> str:
    parts = ("fastft", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module, top_level_only: bool) -> set[str]:
    out: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] == "fastft":
                    out.add(node.module)
                    # `from fastft.pkg import module` imports that module too
                    out.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name.split(".")[0] == "fastft")
            elif isinstance(node, ast.If):
                if top_level_only and "TYPE_CHECKING" in ast.unparse(node.test):
                    continue
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
            elif not top_level_only:
                visit([c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)])

    visit(tree.body)
    return out


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    return {
        _module(p): _imports(ast.parse(p.read_text()), top_level_only) for p in SRC.rglob("*.py")
    }


def _pkg(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_package_has_a_layer():
    pkgs = {_pkg(m) for m in _graph(False)}
    assert pkgs <= set(RANK), f"give these a layer in LAYERS: {sorted(pkgs - set(RANK))}"


def test_no_import_from_a_higher_layer():
    bad = [
        f"{a} imports {b}"
        for a, deps in _graph(top_level_only=False).items()
        for b in deps
        if RANK[_pkg(b)] > RANK[_pkg(a)]
    ]
    assert not bad, bad


def test_no_import_cycle():
    modules = _graph(top_level_only=False)
    # every import, resolved to modules of the package; importing ``a.b.c`` imports the
    # packages ``a.b`` and ``a`` too, but a module's own enclosing packages are no cycle
    # (they finish importing it before it could import them back)
    graph = {
        m: {
            up
            for d in deps
            for up in (".".join(d.split(".")[:i]) for i in range(2, d.count(".") + 2))
            if up in modules and up != m and not m.startswith(up + ".")
        }
        for m, deps in modules.items()
    }
    state: dict[str, int] = {}
    path: list[str] = []

    def dfs(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if d not in graph:
                continue
            if state.get(d) == 1:
                return path[path.index(d) :] + [d]
            if d not in state and (cycle := dfs(d)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := dfs(m)):
            raise AssertionError(" -> ".join(cycle))


def test_no_module_is_too_big_to_read_in_one_sitting():
    big = {_module(p): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450}
    assert not big, big


def test_the_agents_pure_modules_import_no_torch():
    """The agent's policy and its pure deciders load without torch (the worker runtime's
    exit statuses live in ``protocol``): a node agent's decisions cost no torch import."""
    import subprocess
    import sys

    pure = ["fastft.launch.rules", "fastft.protocol.exits"]
    pure += [f"fastft.launch.rules.{p.stem}" for p in (SRC / "launch" / "rules").glob("[a-z]*.py")]
    code = f"import sys; import {', '.join(pure)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", f"importing {pure} imports torch"


def test_the_agents_flag_checks_import_no_torch():
    """`fastft run`'s flag errors took 3-4 s: importing fastft.runtime.contract imported the
    runtime's api, and torch with it (issues 49, 53)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from fastft.launch.settings.config import LaunchConfig\n"
        "LaunchConfig(command=('-m', 'fastft.demo.train'), nproc=2)\n"
        "import fastft.runtime, fastft.runtime.contract, fastft.runtime.checks\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]


RUNTIME_WINGS = [
    {"checks", "contract", "endings", "view"},  # settings, views, typed endings: no torch
    {"groups"},  # process groups, the data plane, shard layout
    {"state"},  # what is registered, healed, compared
    {"durable"},  # checkpoints
    {"engine"},  # the step engine: its core, the executor and its parts
    {"ports", "sync"},  # the runtime as its parts see it; the sync policies over it
    {"health", "transaction", "restart", "endcheck", "agreement"},
    {"attempt", "closing"},
    {"api"},
    {"heldstep"},  # a step held open across a framework's calls: the api's user
]
"""``runtime/``'s wings, lowest first (issue 49: ``state`` and ``groups`` imported each
other; a lower wing never imports a higher one)."""


LAUNCH_WINGS = [
    {"rules"},  # the agent's pure decisions: no I/O, no torch (the simulator's too)
    {"settings"},  # flags, their bounds, the worker's environment
    {"procs"},  # the agent's processes: workers, the zygote, warm spares, output
    {"ports"},  # the agent as its parts see it
    {"gray", "nodes"},  # gray failures; node liveness
    {"exits", "control"},  # a worker's exit carried out; the agent's bus and store
    {"spawn"},  # a worker's life started
    {"agent"},
]
"""``launch/``'s wings, lowest first (issue 63: 27 modules of six kinds in one folder)."""


@pytest.mark.parametrize(("pkg", "order"), [("runtime", RUNTIME_WINGS), ("launch", LAUNCH_WINGS)])
def test_no_wing_imports_a_higher_one(pkg: str, order: list[set[str]]) -> None:
    rank = {w: i for i, wing in enumerate(order) for w in wing}

    def wing(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if len(parts) > 2 and parts[1] == pkg else None

    graph = _graph(False)
    wings = {w for a in graph if (w := wing(a)) is not None}
    assert wings <= set(rank), f"{pkg} wings without a place: {wings - set(rank)}"
    up = sorted(
        f"{a} imports {b}"
        for a, deps in graph.items()
        if (wa := wing(a)) is not None
        for b in deps
        if (wb := wing(b)) is not None and rank[wb] > rank[wa]
    )
    assert up == []


def test_one_table_from_action_to_effect():
    """The state machine's actions are told apart in one place, the engine's core (issue
    49: the simulator re-implemented the executor's dispatch, 15 action types against its
    17, and the two drifted)."""
    import fastft.fsm.contract as contract

    actions = {
        name
        for name, obj in vars(contract).items()
        if isinstance(obj, type) and issubclass(obj, contract.Action)
    }
    actions |= {"MAIN_ACTIONS", "HEALING_ACTIONS", "EPOCH_ACTIONS"}
    allowed = {SRC / "runtime" / "engine" / m for m in ("core.py", "queue.py")}  # (its queue)
    found = []
    for path in SRC.rglob("*.py"):
        if path in allowed or path.is_relative_to(SRC / "fsm"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance"
                and len(node.args) == 2
            ):
                continue
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            if names & actions:
                found.append(f"{_module(path)}:{node.lineno}")
    assert found == [], f"actions told apart outside the core: {found}"


def test_every_default_the_agent_shares_with_its_workers_is_written_once():
    """``LaunchConfig`` and ``RuntimeConfig`` share the flags passed on to the workers;
    each such default is the worker's, read from ``RuntimeConfig`` (issue 49: 8 literal
    defaults were written twice, free to drift)."""
    import dataclasses

    from fastft.launch.settings.config import LaunchConfig
    from fastft.runtime.contract import RuntimeConfig

    shared = {f.name for f in dataclasses.fields(LaunchConfig)} & {
        f.name for f in dataclasses.fields(RuntimeConfig)
    }
    shared -= {"job", "store"}  # (the agent's own defaults: the worker is always told)
    tree = ast.parse((SRC / "launch" / "settings" / "config.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LaunchConfig")
    own = {
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign)
        and isinstance(n.target, ast.Name)
        and n.target.id in shared
        and not (
            isinstance(n.value, ast.Call)
            and isinstance(n.value.func, ast.Name)
            and n.value.func.id == "_worker"
            and isinstance(n.value.args[0], ast.Constant)
            and n.value.args[0].value == n.target.id
        )
    }
    assert len(shared) >= 20 and own == set(), f"defaults written twice: {sorted(own)}"


def test_every_bench_script_is_readable_and_indexed():
    """``bench/`` under the package's size rule, every script in its README (issue 49:
    6.2k lines under no guard, ``chaos.py`` 817)."""
    bench = SRC.parents[1] / "bench"
    scripts = sorted(bench.glob("*.py"))
    big = {p.name: n for p in scripts if (n := len(p.read_text().splitlines())) > 450}
    assert scripts and not big, big
    index = (bench / "README.md").read_text()
    missing = [p.name for p in scripts if f"`{p.name}`" not in index]
    assert missing == [], f"bench/README.md does not list {missing}"
