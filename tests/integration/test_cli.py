"""The CLI: bad flags and unreachable stores give one line and exit code 2; inject,
report-error and bus tail work against a real store."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from fastft.bus import BusConfig, tcpstore_bus
from fastft.inject import FaultKind
from fastft.protocol import Fault, Heartbeat, Inject, Severity
from fastft.protocol.auth import JobSecret


@pytest.fixture(scope="module")
def secret(tmp_path_factory) -> str:
    return str(JobSecret.draw().save(tmp_path_factory.mktemp("sec") / "job.secret"))


def fastft(*args, env=None, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "fastft.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "args",
    [
        ["inject", "--store", "127.0.0.1:1", "--job", "j", "--rank", "0", "--kind", "meteor"],
        ["inject", "--job", "j", "--rank", "0", "--kind", "sigkill"],
        ["inject", "--store", "nonsense", "--job", "j", "--rank", "0", "--kind", "sigkill"],
        ["inject", "--store", "127.0.0.1:PORT", "--job", "j", "--rank", "0", "--kind", "sigkill"],
        ["inject", "--store", "127.0.0.1:1", "--job", "j", "--rank", "-3", "--kind", "sigkill"],
        ["report-error", "--store", "127.0.0.1:PORT", "--job", "j", "--rank", "0"],
        ["bus", "tail", "--store", "127.0.0.1:PORT", "--job", "j"],
        ["run", "--backend", "mpi", "--nproc", "2", "-m", "fastft.demo.train"],
        ["run", "--warm-spares", "1", "--spare-prefault-mb", "999", "-m", "fastft.demo.train"],
        ["run", "--spare-prefault-mb", "-1", "-m", "fastft.demo.train"],
        ["run", "--nproc", "4", "--shard-size", "3", "-m", "fastft.demo.train"],
        ["run", "--nproc", "4", "--shard-size", "2", "--min-replicas", "3", "-m", "m"],
        ["run", "--nproc", "2", "--sync", "diloco:0", "-m", "fastft.demo.train"],
        ["run", "--sync", "every-k:4", "--torchft", "fastft", "-m", "fastft.demo.train"],
        ["run", "--stage", "2/2", "--flow", "127.0.0.1:1", "-m", "fastft.demo.pipeline"],
        ["run", "--stage", "0/2", "-m", "fastft.demo.pipeline"],
        ["run", "--stage", "0/2", "--flow", "h:1", "--max-ahead", "0", "-m", "m"],
        ["run", "--quarantine", "3", "-m", "fastft.demo.train"],
        ["run", "--health-host-mb", "-5", "-m", "fastft.demo.train"],
        ["frobnicate"],
        ["run", "--nproc", "2", "-m", "fastft.demo.no_such_module"],
        ["run", "--checkpoint-dir", "/proc/fastft-ckpt", "-m", "fastft.demo.train"],
        ["run", "--checkpoint-dir", "/dev/null/ckpt", "-m", "fastft.demo.train"],
    ],
)
def test_bad_flags_and_unreachable_stores_give_one_line_and_exit_2(args, secret):
    port = str(free_port())
    env = {"FASTFT_STORE": "", "FASTFT_SECRET_FILE": secret}
    r = fastft(*[a.replace("PORT", port) for a in args], env=env)
    assert r.returncode == 2, r
    lines = [
        ln
        for ln in r.stderr.splitlines()
        if ln.strip() and "NumPy" not in ln and "_conversion_method_template" not in ln
    ]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("fastft") and "error" in lines[0]


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (["run", "--nprocs", "2", "-m", "fastft.demo.train"], "did you mean --nproc"),
        (["run", "--chekpoint-dir=/tmp/c", "-m", "m"], "did you mean --checkpoint-dir"),
        (["report", "--jsn", "RUN"], "did you mean --json"),
    ],
)
def test_a_flag_typo_gets_a_suggestion(args, hint):
    r = fastft(*args, env={"FASTFT_STORE": ""})
    assert r.returncode == 2 and hint in r.stderr, r


@pytest.mark.parametrize("cmd", [["inject", "--rank", "0", "--kind", "sigkill"],
                                 ["report-error", "--rank", "0", "--cause", "x"],
                                 ["bus", "tail", "--count", "1"]])  # fmt: skip
def test_the_operator_commands_need_the_job_secret(store, cmd):
    r = fastft(*cmd, "--store", f"127.0.0.1:{store.port}", "--job", "cli",
               env={"FASTFT_SECRET_FILE": ""})  # fmt: skip
    assert r.returncode == 2, r
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--job-secret-file" in lines[0], r.stderr


def test_inject_and_report_error_reach_a_subscriber(store, secret):
    cfg = BusConfig(job="cli", rank=0, incarnation=1, secret=JobSecret.load(secret))
    with tcpstore_bus(store, cfg) as sub:
        addr = f"127.0.0.1:{store.port}"
        r = fastft(
            "inject",
            "--job-secret-file",
            secret,
            "--store",
            addr,
            "--job",
            "cli",
            "--rank",
            "0",
            "--kind",
            "sigstop",
            "--at-step",
            "12",
        )
        assert r.returncode == 0, r.stderr
        m = sub.recv(10)
        assert isinstance(m, Inject) and m.target_rank == 0 and m.at_step == 12
        assert FaultKind(m.fault_kind) is FaultKind.SIGSTOP
        r = fastft(
            "report-error",
            "--rank",
            "3",
            "--cause",
            "Xid 79: GPU fell off the bus",
            "--severity",
            "fault1",
            env={"FASTFT_STORE": addr, "FASTFT_JOB": "cli", "FASTFT_SECRET_FILE": secret},
        )
        assert r.returncode == 0, r.stderr
        m = sub.recv(10)
        assert isinstance(m, Fault) and m.faulty_rank == 3 and m.severity is Severity.FAULT1
        assert m.cause.startswith("Xid 79")


@pytest.mark.parametrize("cmd", [["inject", "--rank", "0", "--kind", "sigkill"],
                                 ["report-error", "--rank", "0", "--cause", "x"],
                                 ["drain", "--rank", "0"],
                                 ["bus", "tail", "--count", "1", "--timeout", "0.5"]])  # fmt: skip
def test_the_operator_commands_import_no_torch(store, secret, cmd):
    """They start in ~0.15 s, not the ~1.5 s of ``import torch`` (issue 24)."""
    code = (
        "import sys\n"
        "from fastft.cli import main\n"
        f"rc = main({cmd!r})\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "sys.exit(rc)\n"
    )
    env = {"FASTFT_STORE": f"127.0.0.1:{store.port}", "FASTFT_JOB": "cli",
           "FASTFT_SECRET_FILE": secret}  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env={**os.environ, **env})  # fmt: skip
    assert r.returncode == 0, r.stderr


def test_bus_tail_prints_traffic(store, secret):
    addr = f"127.0.0.1:{store.port}"
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fastft.cli",
            "bus",
            "tail",
            "--store",
            addr,
            "--job",
            "cli",
            "--count",
            "2",
            "--timeout",
            "30",
            "--json",
            "--job-secret-file",
            secret,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        cfg = BusConfig(
            job="cli", rank=5, incarnation=9, subscribe=False, secret=JobSecret.load(secret)
        )
        with tcpstore_bus(store, cfg) as pub:
            from fastft.protocol import JobKeys

            key = JobKeys("cli").bus_members
            deadline = time.monotonic() + 30
            while not store.get(key):  # the tail has joined
                assert time.monotonic() < deadline and p.poll() is None
                time.sleep(0.02)
            pub.publish_raw(b"junk")
            pub.broadcast(Heartbeat(job="cli", epoch=2, rank=5, incarnation=9, step=33))
            pub.broadcast(Heartbeat(job="cli", epoch=2, rank=5, incarnation=9, step=34))
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    lines = [json.loads(x) for x in out.splitlines()]
    assert [x["step"] for x in lines] == [33, 34] and lines[0]["kind"] == "Heartbeat"
    assert "1 forged and 0 replayed" in err  # the junk: no tag of the secret


def test_plan_check(tmp_path):
    good = tmp_path / "plan.json"
    good.write_text('{"faults": [{"kind": "sigkill", "rank": 1, "at_step": 4}]}')
    r = fastft("plan", "check", str(good))
    assert r.returncode == 0 and "rank 1 life 0: sigkill at step 4" in r.stdout
    bad = tmp_path / "bad.json"
    bad.write_text('{"faults": [{"kind": "meteor", "rank": 1}]}')
    r = fastft("plan", "check", str(bad))
    assert r.returncode == 2 and "meteor" in r.stderr


def test_nccl_without_a_gpu_per_worker_fails_at_start_and_says_what_to_do():
    r = fastft(
        *("run", "--backend", "nccl", "--nproc", "2", "-m", "fastft.demo.train"),
        env={"CUDA_VISIBLE_DEVICES": ""},  # no GPU, also on a GPU machine
    )
    assert r.returncode == 2, r
    assert "backend nccl needs one GPU per worker: 2 workers on this node, 0 GPU" in r.stderr
    assert "use --backend gloo" in r.stderr


@pytest.mark.parametrize("answer", [b"", b"HTTP/1.1 200 OK\r\n\r\n" * 50])
def test_a_port_that_is_not_a_store_gives_one_line_and_exit_2(answer, secret):
    # a listener that accepts and never answers (or answers garbage): no wait forever,
    # no C++ backtrace (issue 25)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    conns: list[socket.socket] = []
    done = False

    def serve() -> None:
        while not done:
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            conns.append(c)
            if answer:
                c.sendall(answer)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        port = srv.getsockname()[1]
        r = fastft(
            "inject",
            "--job-secret-file",
            secret,
            "--store",
            f"127.0.0.1:{port}",
            "--job",
            "j",
            "--rank",
            "0",
            "--kind",
            "sigkill",
            timeout=60,
        )
    finally:
        done = True
        t.join(5)
        for c in conns:
            c.close()
        srv.close()
    assert r.returncode == 2, r
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "does not answer as a store" in lines[0], r.stderr


def test_bare_fastft_prints_the_help_and_subcommands_show_their_defaults():
    r = fastft()
    assert r.returncode == 2 and "usage: fastft" in r.stderr and "run" in r.stderr
    assert "required" not in r.stderr
    r = fastft("bus", "tail", "--help")
    assert r.returncode == 0 and "(default: 0)" in r.stdout
    r = fastft("run", "--help")
    assert "[default: 30.0; env FASTFT_HANG_TIMEOUT]" in " ".join(r.stdout.split())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_script_that_never_calls_init_gets_a_warning_at_exit(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("print('trained nothing')\n")
    r = fastft("run", "--nproc", "2", "--run-dir", str(tmp_path / "run"), str(script), timeout=90)
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        assert f"rank {rank} exited 0 without calling fastft.init()" in r.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_worker_lines_are_prefixed_whole_and_go_to_the_log_dir(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(
        "import os, sys\n"
        "r = os.environ['FASTFT_RANK']\n"
        "for i in range(200):\n"
        "    print('line', i, 'of rank', r, end='')\n"
        "    print(' end')\n"
        "print('oops', r, file=sys.stderr)\n"
    )
    logs = tmp_path / "logs"
    r = fastft(
        "run",
        "--nproc",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
        "--log-dir",
        str(logs),
        "--tee",
        "1",
        str(script),
        timeout=90,
    )
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        mine = [x for x in r.stdout.splitlines() if x.startswith(f"[rank {rank}.0]: ")]
        assert [x.split(": ", 1)[1] for x in mine] == [
            f"line {i} of rank {rank} end" for i in range(200)
        ]
        assert (logs / f"rank{rank}" / "life0.stderr").read_text() == f"oops {rank}\n"
        assert (logs / f"rank{rank}" / "life0.stdout").read_text().count("\n") == 200
    assert "oops" not in r.stderr  # --tee 1: stdout only on the console
    assert len(r.stdout.splitlines()) == 400


@pytest.mark.slow
def test_report_draws_the_timeline_and_writes_an_html_page(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    events = [
        {"event": "worker_start", "mono": 0.0, "src": f"rank {r}", "incarnation": 5 + r}
        for r in range(2)
    ]
    events += [{"event": "epoch", "mono": 0.1, "src": "rank 0", "epoch": 1}]
    for s in range(20):
        events += [
            {"event": "commit", "mono": 0.2 + 0.05 * s, "src": f"rank {r}", "step": s, "epoch": 1}
            for r in range(2)
        ]
    events += [
        {
            "event": "injected",
            "mono": 0.62,
            "src": "rank 1",
            "kind": "exception",
            "step": 8,
            "incarnation": 6,
        },
        {"event": "interrupt", "mono": 0.625, "src": "rank 0", "step": 8},
        {"event": "rollback", "mono": 0.63, "src": "rank 0", "step": 8, "epoch": 1},
        {"event": "heal", "mono": 0.64, "src": "rank 1", "role": "fetch", "heal_ms": 5.0},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    png, page = tmp_path / "t.png", tmp_path / "r.html"
    r = fastft("report", str(run), "--plot", str(png), "--html", str(page))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    text = page.read_text()
    assert "data:image/png;base64," in text and "exception" in text
    r = fastft("report", str(run), "--plot", str(tmp_path / "t.unknown"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr


def test_python_m_fastft_lists_run_first_and_run_help_is_in_sections():
    r = subprocess.run(
        [sys.executable, "-m", "fastft", "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    commands = r.stdout.split("positional arguments:")[1]
    assert commands.index("    run ") < commands.index("    inject "), r.stdout
    r = fastft("run", "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: fastft run [flags] SCRIPT"), r.stdout[:200]
    for section in ("workers:", "faults and hangs:", "durable tier (checkpoints):", "torchft:"):
        assert f"\n{section}\n" in r.stdout, section
