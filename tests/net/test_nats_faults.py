"""Real network faults on the NATS control plane (issue 50): three nodes and three NATS
servers, each in a network namespace of its own (:class:`~_netlab.NetLab`), held to
S1-S5 as the fault tests hold theirs. A server cut off, or a node's link flapping for
300 ms, must not cost the job an uncut node."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "fault"))
from _netlab import NetLab, can_run  # noqa: E402
from _runs import check_s1_s3, finals  # noqa: E402
from test_network_faults import finish, wait_step  # noqa: E402

from fastft.bus.natscluster import server_binary, write_config  # noqa: E402
from fastft.runtime import read_events  # noqa: E402

pytestmark = [
    pytest.mark.net,
    pytest.mark.skipif(can_run() is not None, reason=str(can_run())),
]

NODES = 3
SERVERS = (3, 4, 5)
"""The namespaces of the NATS servers (0-2 are the nodes)."""
CLIENT_PORT, ROUTE_PORT = 4222, 6222


def start_servers(lab: NetLab, tmp: Path) -> str:
    """The three servers, routed to each other, each in its namespace; their ``--control``."""
    for i in SERVERS:
        routes = [f"{lab.addr(j)}:{ROUTE_PORT}" for j in SERVERS if j != i]
        conf = write_config(tmp / f"nats{i}", f"n{i}", lab.addr(i), CLIENT_PORT, ROUTE_PORT, routes)
        log = open(tmp / f"nats{i}.log", "w")  # noqa: SIM115 - closed with the lab
        lab.popen(i, [server_binary(), "-c", str(conf)], stdout=log, stderr=log)
    urls = [f"nats://{lab.addr(i)}:{CLIENT_PORT}" for i in SERVERS]
    ready = lab.popen(
        0,
        [sys.executable, "-c",
         "import sys; from fastft.bus.natscluster import wait_jetstream; "
         "wait_jetstream(sys.argv[1:], timeout_s=60)", *urls],
    )  # fmt: skip
    assert ready.wait(timeout=90) == 0, "the NATS servers' JetStream never answered"
    return ",".join(urls)


def start(lab: NetLab, tmp: Path, control: str, steps: int, *flags: str) -> tuple[Path, list]:
    return lab.start_job(tmp, steps, "--control", control, *flags, job="natsnet", nodes=NODES)


def logs(tmp: Path) -> str:
    names = [f"node{i}" for i in range(NODES)] + [f"nats{i}" for i in SERVERS]
    return "\n".join(f"--- {n}\n" + (tmp / f"{n}.log").read_text()[-2500:] for n in names)


def lost_nodes(run: Path) -> list[int]:
    return [e.get("node") for e in read_events(run) if e["event"] == "node_lost"]


@pytest.mark.timeout(300)
def test_a_nats_server_cut_off_costs_the_job_no_node(tmp_path):
    """One server of three cut off for 5 s, then back: its clients leave it within ~0.5 s
    (a call unanswered, then a ping: ``natsio.Conn.suspect``; nats-py alone waited 2
    minutes per ping), a new JetStream leader is elected if it led, and no node is lost
    on the default lease (300 ms: its beats go through the other servers too); the job
    ends equal everywhere."""
    with NetLab(NODES + len(SERVERS)) as lab:
        control = start_servers(lab, tmp_path)
        run, procs = start(lab, tmp_path, control, 160)
        wait_step(run, 20)
        lab.cut(SERVERS[1])
        time.sleep(5.0)
        lab.mend(SERVERS[1])
        codes = finish(procs, tmp_path)
        assert codes == [0, 0, 0], logs(tmp_path)
    assert lost_nodes(run) == [], logs(tmp_path)
    check_s1_s3(run, steps=160)
    assert len({v["digest"] for v in finals(run).values()}) == 1


@pytest.mark.timeout(300)
def test_a_nodes_200_ms_flap_on_nats_loses_nothing_at_the_defaults(tmp_path):
    """Node 1's packets dropped for 200 ms (its clients' and every server's route to it),
    shorter than the default lease on NATS (300 ms: the leases are core-NATS beats,
    ``fastft.launch.nodes.beats``): nothing is lost. On the bucket's counters the lease had to be
    3 s, and a 300 ms lease there cost the job healthy nodes."""
    with NetLab(NODES + len(SERVERS)) as lab:
        control = start_servers(lab, tmp_path)
        run, procs = start(lab, tmp_path, control, 120)
        wait_step(run, 20)
        lab.drop(1)
        time.sleep(0.2)
        lab.drop(1, on=False)
        codes = finish(procs, tmp_path)
        assert codes == [0, 0, 0], logs(tmp_path)
    assert lost_nodes(run) == [], logs(tmp_path)
    check_s1_s3(run, steps=120)
    assert len({v["digest"] for v in finals(run).values()}) == 1


def leader(lab: NetLab, control: str) -> int:
    """The namespace of the server leading the control plane's bucket (asked from node 0)."""
    ask = lab.popen(
        0,
        [sys.executable, "-c",
         "import asyncio, sys, nats\n"
         "async def main():\n"
         "    nc = await nats.connect(sys.argv[1].split(','), connect_timeout=2)\n"
         "    info = await nc.jetstream(timeout=5).stream_info('KV_fastft')\n"
         "    print(info.cluster.leader)\n"
         "    await nc.close()\n"
         "asyncio.run(main())", control],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    out, _ = ask.communicate(timeout=30)
    name = out.decode().strip()
    assert name.startswith("n"), f"no leader of the bucket: {name!r}"
    return int(name[1:])


@pytest.mark.timeout(300)
def test_a_node_cut_with_the_buckets_leader_is_declared_while_it_lasts(tmp_path):
    """Node 1 cut off together with the server leading the key-value stream (a node that
    hosts a server; the worst one to lose): its lease beats stop, and a watcher declares it
    while the cut lasts (0.3-0.5 s here; issue 60, case 5: 3.1-8.8 s when the leases were the bucket's and waited
    for its new leader). The survivors go on once the bucket has a new leader; node 1
    comes back fenced, its workers start again as new lives, and the job ends equal."""
    with NetLab(NODES + len(SERVERS)) as lab:
        control = start_servers(lab, tmp_path)
        # (an 800 ms lease: at the default 300 ms a healthy node's agent, starved of CPU on
        # this 2-core machine that hosts 3 nodes and 3 servers, was declared too, 2 runs
        # in 9, and the job lost every holder; at 500 ms still 1 run in 5 (session 34);
        # the default's figure is bench/node_loss.py's)
        run, procs = start(lab, tmp_path, control, 200, "--node-lease-misses", "8")
        wait_step(run, 20)
        server = leader(lab, control)
        t_cut = time.monotonic()
        lab.cut(1)
        lab.cut(server)
        time.sleep(8.0)
        lab.mend(server)
        lab.mend(1)
        codes = finish(procs, tmp_path)
        assert codes == [0, 0, 0], logs(tmp_path)
    ev = read_events(run)
    lost = [e for e in ev if e["event"] == "node_lost"]
    # (each watcher may declare it, within ms of the other: the same verdict, one death)
    assert {e["node"] for e in lost} == {1}, logs(tmp_path)
    assert lost[-1]["mono"] - lost[0]["mono"] < 1.0, lost
    # while the cut lasts, not after it (the figure, p50 359 ms: bench/node_loss.py; a
    # timed bound here failed once under the tier's load)
    declared = lost[0]["mono"] - t_cut
    print(f"node 1 declared lost {declared * 1e3:.0f} ms after the cut")
    assert declared < 3.0, (declared, logs(tmp_path))
    assert [e for e in ev if e["event"] in ("node_fenced", "fence_spared")], logs(tmp_path)
    check_s1_s3(run, steps=200)
    assert len({v["digest"] for v in finals(run).values()}) == 1
