"""``fastft run``, ``report`` and ``demo``: the agent, a finished run's figures, the demo."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from fastft.cli import _fail


def _module_exists(name: str) -> bool:
    """Whether ``python -m name`` would find the module, without importing it or its
    packages (their imports may be slow, or have effects): the top-level name through
    the import system's finders, the rest by path."""
    import importlib.machinery
    import importlib.util

    head, *rest = name.split(".")
    if not head:
        return False
    sys.path.insert(0, os.getcwd())  # as `python -m` does
    try:
        spec = importlib.util.find_spec(head)
    except (ImportError, ValueError):
        return False
    finally:
        sys.path.pop(0)
    for part in rest:
        where = spec.submodule_search_locations if spec is not None else None
        if not where:
            return False
        spec = importlib.machinery.PathFinder.find_spec(part, list(where))
    return spec is not None


def _command(args: argparse.Namespace, base: str | None = None) -> list[str]:
    """The worker command ``fastft run``'s arguments name (a script's path relative to
    ``base`` when given: ``fastft ray run --working-dir``)."""
    rest = list(args.args or [])
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if args.module:
        command = [
            sys.executable,
            "-m",
            args.module,
            *([args.script] if args.script else []),
            *rest,
        ]
    elif args.script:
        if not os.path.exists(os.path.join(base or "", args.script)):
            where = f" in --working-dir {base}" if base else ""
            _fail(f"script {args.script!r} not found{where}")
        command = [sys.executable, args.script, *rest]
    else:
        _fail("no script: fastft run [flags] script.py [args] (or -m module)")
    return command


def cmd_run(args: argparse.Namespace) -> int:
    from fastft.errors import FastFTError
    from fastft.launch import Agent
    from fastft.launch.settings.flags import config_from_args

    command = _command(args)
    try:
        cfg = config_from_args(args, tuple(command))
        if args.module and not _module_exists(args.module):  # (after the flags' checks)
            _fail(
                f"module {args.module!r} not found (from {os.getcwd()}, on this Python's "
                "path): check its name, or run from the directory that holds it"
            )
        if cfg.checkpoint_dir:
            _fail_unless_writable(cfg.checkpoint_dir)
        warm = None
        if cfg.standby:  # (warm now; the job only once told to go)
            from fastft.launch.procs.standby import wait_for_go, warm_up

            began = time.monotonic()
            warm = warm_up(cfg)
            print(
                f"fastft: standby agent of node {cfg.node_rank} warm in "
                f"{time.monotonic() - began:.1f} s; it takes the node over when told",
                file=sys.stderr,
                flush=True,
            )
            env = wait_for_go()
            if env is None:  # (not needed)
                if warm.zygote is not None:
                    warm.zygote.stop()
                return 0
            os.environ.update(env)
        agent = Agent(cfg, warm)
    except FastFTError as e:
        _fail(str(e))
    return agent.run()


def _fail_unless_writable(directory: str) -> None:
    """``--checkpoint-dir`` must take a checkpoint: created if missing, and a file written
    and removed there now, not at the first checkpoint (a read-only mount trained to the
    end with no checkpoint at all)."""
    probe = Path(directory) / f".fastft-probe-{os.getpid()}"
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"fastft")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        _fail(
            f"--checkpoint-dir {directory}: cannot write there ({e.strerror or e}): give a "
            "directory this user can create and write (a shared file system for several nodes)"
        )


def cmd_report_run(args: argparse.Namespace) -> int:
    from fastft.report import render_report, summarize

    try:
        figures = summarize(args.run_dir, run=args.run - 1 if args.run > 0 else -1)
    except FileNotFoundError:
        _fail(f"{args.run_dir}: no events.jsonl (is it a fastft run directory?)")
    except IndexError:
        _fail(f"--run {args.run}: {args.run_dir} holds fewer runs")
    if args.json:
        print(json.dumps(figures, indent=2, default=str))
    else:
        print(render_report(args.run_dir, figures))
    if args.plot or args.html:
        from fastft.plot import plot_timeline, write_html

        try:
            if args.plot:
                print(f"timeline: {plot_timeline(args.run_dir, args.plot)}", file=sys.stderr)
            if args.html:
                print(f"report: {write_html(args.run_dir, args.html)}", file=sys.stderr)
        except (RuntimeError, ValueError) as e:  # no matplotlib, an unknown file type
            _fail(str(e))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from fastft.demo.main import run_demo

    if args.steps < 20 or args.nproc < 2:
        _fail("demo: use --steps >= 20 and --nproc >= 2")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            _fail("demo --device cuda: no CUDA device is visible (use --device cpu)")
    if args.framework == "jax":
        import importlib.util

        if args.device != "cpu":
            _fail("demo --framework jax: the JAX demo trains on the CPU (--device cpu)")
        missing = [m for m in ("jax", "optax") if importlib.util.find_spec(m) is None]
        if missing:
            _fail(
                f"demo --framework jax: {' and '.join(missing)} not installed; install the "
                "extra: pip install 'fastft[jax]' (make demo-jax does)"
            )
    return run_demo(
        framework=args.framework,
        steps=args.steps,
        nproc=args.nproc,
        run_dir=args.run_dir,
        live=not args.no_live,
        elastic=args.elastic,
        device=args.device,
    )


_NODE_FLAGS = frozenset(
    {"nnodes", "node_rank", "store", "job_secret_file", "run_dir", "job", "control", "standby"}
)
"""``fastft run`` flags that ``fastft ray run`` sets for each node itself."""


def cmd_ray_run(args: argparse.Namespace) -> int:
    import secrets

    from fastft.errors import FastFTError
    from fastft.launch.settings.flags import config_from_args, run_argv
    from fastft.process.rundir import default_run_dir

    runtime_env = _runtime_env(args)
    shipped = runtime_env.get("working_dir")
    command = _command(args, shipped if isinstance(shipped, str) else None)
    given = [
        flag
        for flag, value in (
            ("--nnodes", args.nnodes != 1),
            ("--node-rank", args.node_rank != 0),
            ("--store", args.store),
            ("--job-secret-file", args.job_secret_file),
            ("--standby", args.standby),
        )
        if value
    ]
    if given:
        _fail(
            f"fastft ray run sets {', '.join(given)} itself (one agent per node, the "
            "control plane's servers as actors of the job); leave them out"
        )
    if args.nodes < 1:
        _fail(f"--nodes {args.nodes}: must be >= 1")
    try:  # the flags' own checks, as one node's agent will make them
        config_from_args(args, tuple(command))
    except FastFTError as e:
        _fail(str(e))
    if args.module and not _module_exists(args.module):
        _fail(f"module {args.module!r} not found (from {os.getcwd()}, on this Python's path)")
    # (-m MODULE or the script's path, the same on every node; `--` before a module's
    # arguments, as `fastft run -m` needs them)
    script = [*command[1:3], "--", *command[3:]] if args.module else command[1:]
    from fastft.ray import RayJobError, run

    job = args.job or f"ray-{secrets.token_hex(3)}"
    try:
        return run(
            [*run_argv(args, _NODE_FLAGS), *script],
            nodes=args.nodes,
            nproc=args.nproc,
            address=args.address,
            run_dir=os.path.abspath(args.run_dir or default_run_dir("ray")),
            job=job,
            cpus_per_node=args.cpus_per_node,
            gpus_per_node=args.gpus_per_node,
            max_node_restarts=args.max_node_restarts,
            standby=args.standby_agents,
            control=args.control,
            nats_servers=args.nats_servers,
            placement=args.placement,
            runtime_env=runtime_env or None,
        )
    except RayJobError as e:
        print(f"fastft: error: {e}", file=sys.stderr)
        return 2


def _runtime_env(args: argparse.Namespace) -> dict[str, object]:
    """``--runtime-env`` (JSON) with ``--working-dir`` in it; a bad one fails (exit 2)."""
    import json

    env: dict[str, object] = {}
    if args.runtime_env:
        try:
            env = json.loads(args.runtime_env)
        except json.JSONDecodeError as e:
            _fail(f'--runtime-env: not JSON ({e}); e.g. \'{{"pip": ["einops"]}}\'')
        if not isinstance(env, dict):
            _fail('--runtime-env: a JSON object, e.g. \'{"pip": ["einops"]}\'')
    if args.working_dir:
        if not os.path.isdir(args.working_dir):
            _fail(f"--working-dir {args.working_dir!r}: not a directory")
        if "working_dir" in env:
            _fail("--working-dir and --runtime-env's working_dir: give one")
        env["working_dir"] = os.path.abspath(args.working_dir)
    return env
