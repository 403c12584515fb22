"""NUMA placement of a host's CPU ranks (sharding/numa.py): plans over fake sysfs trees, the CPU-list parser, a real
bind of a child process to this host's node 0, two real ranks spread by `distribute` through init_dist, and the
`--numa` flag."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sharding import numa
from sharding.numa import Node, Placement, format_cpulist, parse_cpulist, plan, read_topology

ROOT = Path(__file__).resolve().parents[2]


def sysfs(tmp_path: Path, nodes: dict[int, str], memory: str | None = None,
          siblings: dict[int, str] | None = None) -> Path:
    """A fake /sys/devices/system: node<N>/cpulist per node, has_memory when given, and cpu<N>/topology/
    thread_siblings_list for the CPUs in `siblings`. Returns the node folder."""
    root = tmp_path / "system" / "node"
    for node_id, cpulist in nodes.items():
        (root / f"node{node_id}").mkdir(parents=True)
        (root / f"node{node_id}" / "cpulist").write_text(cpulist + "\n")
    if memory is not None:
        (root / "has_memory").write_text(memory + "\n")
    (root / "online").write_text(format_cpulist(nodes) + "\n")  # a file that is not a node folder
    for cpu, sib in (siblings or {}).items():
        topo = tmp_path / "system" / "cpu" / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "thread_siblings_list").write_text(sib + "\n")
    return root


def where(p: numa.Plan) -> list[tuple[tuple[int, ...], str]]:
    return [(r.nodes, format_cpulist(r.cpus)) for r in p.ranks]


# --- the CPU-list format ---

@pytest.mark.parametrize("text,cpus", [
    ("0-3,8-11\n", [0, 1, 2, 3, 8, 9, 10, 11]), ("5", [5]), ("", []), ("\n", []), ("0,2-2,1", [0, 1, 2]),
    ("3,1,1-2", [1, 2, 3]), ("64-65,127", [64, 65, 127]),
])
def test_parse_cpulist(text, cpus):
    assert parse_cpulist(text) == cpus
    assert parse_cpulist(format_cpulist(cpus)) == cpus


@pytest.mark.parametrize("bad", ["3-1", "a", "1-", "-1", "0-3;5", "1,,x"])
def test_parse_cpulist_refuses_garbage(bad):
    with pytest.raises(ValueError, match="not a CPU list"):
        parse_cpulist(bad)


def test_format_cpulist_makes_ranges():
    assert format_cpulist([11, 0, 1, 2, 3, 8, 9, 10, 5]) == "0-3,5,8-11"
    assert format_cpulist([]) == ""


# --- reading sysfs ---

def test_read_topology_orders_nodes_by_number_and_reads_memory_and_cores(tmp_path):
    root = sysfs(tmp_path, {0: "0-1,4-5", 2: "", 10: "2-3,6-7"}, memory="0,2",
                 siblings={0: "0,4", 4: "0,4", 1: "1,5", 5: "1,5"})
    nodes = read_topology(root)
    assert [n.id for n in nodes] == [0, 2, 10]  # node10 after node2
    assert nodes[0] == Node(0, (0, 1, 4, 5), True, ((0, 4), (1, 5)))
    assert nodes[1] == Node(2, (), True, ())  # memory, no CPUs (CXL / HBM)
    assert nodes[2].cpus == (2, 3, 6, 7) and not nodes[2].memory  # CPUs, no memory
    assert nodes[2].cores == ((2,), (3,), (6,), (7,))  # no siblings file: a core per CPU
    assert read_topology(tmp_path / "nowhere") == []


def test_read_topology_of_this_host_covers_the_cpus_it_may_use():
    nodes = read_topology()
    if not nodes:
        pytest.skip("no /sys/devices/system/node here")
    assert set(os.sched_getaffinity(0)) <= {c for n in nodes for c in n.cpus}
    assert any(n.memory for n in nodes)


# --- plans ---

def test_one_node_auto_binds_nothing_and_says_why(tmp_path):
    nodes = read_topology(sysfs(tmp_path, {0: "0-7"}))
    for ranks in (1, 2, 4):
        p = plan(nodes, ranks, "auto")
        assert p.ranks == () and "one NUMA node" in p.reason
    # distribute still gives each rank a share of it
    assert where(plan(nodes, 2, "distribute")) == [((0,), "0-3"), ((0,), "4-7")]
    assert where(plan(nodes, 1, "distribute")) == [((0,), "0-7")]


def test_two_nodes_one_rank_each(tmp_path):
    nodes = read_topology(sysfs(tmp_path, {0: "0-3", 1: "4-7"}, memory="0-1"))
    p = plan(nodes, 2, "auto")
    assert p.ranks == (Placement(0, (0,), (0, 1, 2, 3), (0,)), Placement(1, (1,), (4, 5, 6, 7), (1,)))
    assert plan(nodes, 2, "distribute").ranks == p.ranks


def test_two_nodes_four_ranks_split_each_node(tmp_path):
    nodes = read_topology(sysfs(tmp_path, {0: "0-3", 1: "4-7"}))
    assert where(plan(nodes, 4, "auto")) == [((0,), "0-1"), ((0,), "2-3"), ((1,), "4-5"), ((1,), "6-7")]


def test_single_rank_on_two_nodes_is_left_alone_by_auto(tmp_path):
    """The in-process LLM (one rank) on a two-socket host: auto does not pin the caller to a socket."""
    nodes = read_topology(sysfs(tmp_path, {0: "0-3", 1: "4-7"}))
    assert plan(nodes, 1, "auto").ranks == ()
    assert where(plan(nodes, 1, "distribute")) == [((0, 1), "0-7")]


def test_ranks_that_do_not_divide_over_the_nodes(tmp_path):
    nodes = read_topology(sysfs(tmp_path, {0: "0-3", 1: "4-7"}))
    p = plan(nodes, 3, "auto")
    assert p.ranks == () and "distribute" in p.reason
    # distribute: contiguous blocks of ranks (ranks 0 and 1 share node 0), as even as possible
    assert where(plan(nodes, 3, "distribute")) == [((0,), "0-1"), ((0,), "2-3"), ((1,), "4-7")]


def test_sub_numa_clusters_are_more_nodes(tmp_path):
    nodes = read_topology(sysfs(tmp_path, {0: "0-3", 1: "4-7", 2: "8-11", 3: "12-15"}))
    assert where(plan(nodes, 4, "auto")) == [((0,), "0-3"), ((1,), "4-7"), ((2,), "8-11"), ((3,), "12-15")]
    assert plan(nodes, 2, "auto").ranks == ()  # 2 ranks over 4 clusters: auto leaves them alone
    # fewer ranks than nodes under distribute: contiguous groups of nodes (a socket's clusters together)
    p = plan(nodes, 2, "distribute")
    assert where(p) == [((0, 1), "0-7"), ((2, 3), "8-15")]
    assert [r.memory_nodes for r in p.ranks] == [(0, 1), (2, 3)]
    assert where(plan(nodes, 3, "distribute")) == [((0,), "0-3"), ((1,), "4-7"), ((2, 3), "8-15")]


def test_non_contiguous_cpulists_and_hyperthreads(tmp_path):
    """Intel's numbering: node 0 holds cores 0-3 and their siblings 8-11. Ranks sharing the node split cores, not
    the list: each rank gets a core with both its hyperthreads."""
    siblings = {c: f"{c % 8},{c % 8 + 8}" for c in range(16)}
    nodes = read_topology(sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"}, siblings=siblings))
    assert where(plan(nodes, 2, "auto")) == [((0,), "0-3,8-11"), ((1,), "4-7,12-15")]
    assert where(plan(nodes, 4, "auto")) == [((0,), "0-1,8-9"), ((0,), "2-3,10-11"), ((1,), "4-5,12-13"),
                                             ((1,), "6-7,14-15")]
    # more ranks than cores on a node: hyperthreads each
    assert where(plan(nodes, 16, "auto"))[:8] == [((0,), str(c)) for c in (0, 1, 2, 3, 8, 9, 10, 11)]


def test_cpu_less_and_memory_less_nodes(tmp_path):
    # node 1: CXL memory, no CPUs (gets no rank); node 2: CPUs without memory (no memory policy)
    nodes = read_topology(sysfs(tmp_path, {0: "0-3", 1: "", 2: "4-7"}, memory="0-1"))
    p = plan(nodes, 2, "auto")
    assert p.ranks == (Placement(0, (0,), (0, 1, 2, 3), (0,)), Placement(1, (2,), (4, 5, 6, 7), ()))
    assert plan(nodes, 3, "auto").ranks == ()  # two usable nodes, not three


def test_the_allowed_cpus_restrict_every_plan(tmp_path):
    nodes = read_topology(sysfs(tmp_path, {0: "0-3", 1: "4-7"}))
    # a cpuset (docker --cpuset-cpus, taskset) inside node 0: one usable node, nothing for auto to do
    p = plan(nodes, 2, "auto", allowed_cpus={0, 1, 2, 3})
    assert p.ranks == () and "one NUMA node of 2" in p.reason
    assert where(plan(nodes, 2, "distribute", {0, 1, 2, 3})) == [((0,), "0-1"), ((0,), "2-3")]
    # straddling both: each rank gets the allowed part of its node only
    assert where(plan(nodes, 2, "auto", allowed_cpus={1, 2, 5, 6})) == [((0,), "1-2"), ((1,), "5-6")]
    assert plan(nodes, 2, "distribute", allowed_cpus={99}).ranks == ()


def test_more_ranks_than_cpus_take_turns(tmp_path):
    nodes = read_topology(sysfs(tmp_path, {0: "0-1"}))
    assert where(plan(nodes, 3, "distribute")) == [((0,), "0"), ((0,), "1"), ((0,), "0")]


def test_off_and_bad_modes(tmp_path):
    nodes = read_topology(sysfs(tmp_path, {0: "0-3", 1: "4-7"}))
    assert plan(nodes, 2, "off").ranks == ()
    with pytest.raises(ValueError, match="auto, off, distribute"):
        plan(nodes, 2, "sockets")


@pytest.mark.parametrize("ranks", range(1, 10))
def test_distribute_shares_are_disjoint_and_cover_the_allowed_cpus(tmp_path, ranks):
    """Whatever the counts: every rank's CPUs are allowed and on its nodes; while every rank can have CPUs of its
    own, no two ranks share one and together they use every allowed CPU."""
    siblings = {c: f"{c - c % 2}-{c - c % 2 + 1}" for c in range(24)}
    nodes = read_topology(sysfs(tmp_path, {0: "0-7", 1: "8-13", 2: "", 3: "14-23"}, memory="0-2",
                                siblings=siblings))
    allowed = set(range(24)) - {3, 9, 15}
    p = plan(nodes, ranks, "distribute", allowed)
    assert [r.local_rank for r in p.ranks] == list(range(ranks))
    by_id = {n.id: n for n in nodes}
    for r in p.ranks:
        assert r.cpus and set(r.cpus) <= allowed
        assert set(r.cpus) <= {c for n in r.nodes for c in by_id[n].cpus}
        assert 2 not in r.nodes and 3 not in r.memory_nodes
    cpus = [c for r in p.ranks for c in r.cpus]
    assert len(cpus) == len(set(cpus)) and set(cpus) == allowed


def test_place_runs_unbound_rather_than_failing(tmp_path, caplog):
    """An unreadable topology or a local rank outside the plan: a warning and no binding (nothing is bound here,
    so this process keeps its affinity)."""
    before = os.sched_getaffinity(0)
    with caplog.at_level("WARNING", logger="sharding.numa"):
        assert numa.place(0, 2, "distribute", root=sysfs(tmp_path / "a", {0: "0-x"})) == \
            (None, "cannot read the NUMA topology: not a CPU list: '0-x\\n'")
        placement, why = numa.place(5, 2, "distribute", root=sysfs(tmp_path / "b", {0: "0-3", 1: "4-7"}))
        assert placement is None and "outside the 2 local ranks" in why
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING"]
    assert numa.place(0, 2, "off", root=tmp_path / "nowhere") == (None, "NUMA binding is off")
    assert os.sched_getaffinity(0) == before


# --- binding for real (a child process, so this one keeps its affinity and memory policy) ---

CHILD = """
import ctypes, json, logging, os, sys, threading
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from sharding import numa
placement, note = numa.place(0, 1, "distribute")
seen = {}
t = threading.Thread(target=lambda: seen.update(cpus=sorted(os.sched_getaffinity(0))))
t.start(); t.join()
mode, mask = ctypes.c_int(-1), (ctypes.c_ulong * 16)()
libc = ctypes.CDLL(None, use_errno=True)
got = libc.syscall(ctypes.c_long(239), ctypes.byref(mode), mask, ctypes.c_ulong(16 * 64 + 1), None, ctypes.c_ulong(0))
print(json.dumps({"nodes": placement and placement.nodes, "cpus": sorted(os.sched_getaffinity(0)), "note": note,
                  "thread_cpus": seen["cpus"], "policy": [got, mode.value, mask[0]]}))
"""


def _no_seccomp() -> bool:
    """This process runs without a seccomp filter (nothing can refuse set_mempolicy then; it needs no privilege)."""
    with open("/proc/self/status") as f:
        return any(line.split() == ["Seccomp:", "0"] for line in f)


def test_bind_this_host_node_0_in_a_child():
    if not sys.platform.startswith("linux") or os.uname().machine != "x86_64":
        pytest.skip("the child reads the policy back with x86-64's get_mempolicy")
    allowed = os.sched_getaffinity(0)
    usable = [n for n in read_topology() if set(n.cpus) & allowed]
    if not usable:
        pytest.skip("no NUMA node with CPUs this process may use")
    first = usable[0]
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=False,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    # one rank under distribute gets every usable node (a contiguous group): node 0 alone on a one-node host
    assert out["nodes"] == [n.id for n in usable]
    assert out["cpus"] == sorted(c for n in usable for c in n.cpus if c in allowed)
    assert out["thread_cpus"] == out["cpus"]  # a thread started after the bind inherits it
    if out["note"].startswith("preferred node"):  # set_mempolicy succeeded: the kernel reports it back
        assert out["policy"][0] == 0 and out["policy"][1] in (numa.MPOL_PREFERRED, numa.MPOL_PREFERRED_MANY)
        assert out["policy"][2] & (1 << first.id)
        assert "WARNING" not in r.stderr
    else:  # refused (seccomp): a warning and the default policy, never a crash
        assert not _no_seccomp(), f"set_mempolicy failed without a seccomp filter: {out['note']}"
        assert "set_mempolicy" in out["note"] and "WARNING set_mempolicy" in r.stderr, (out, r.stderr)
    assert "bound to NUMA node" in r.stderr


# --- two real ranks through init_dist ---

def _rank(rank: int, port: int, queue) -> None:
    try:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TPSERVE_STORE_PORT=str(port),
                          TPSERVE_STORE_SECRET="hand-made-ranks-" + str(port), TPSERVE_COLLECTIVE_TIMEOUT="60",
                          TPSERVE_SHM_ALLREDUCE="0", TPSERVE_NUMA="distribute")
        os.environ.pop("TPSERVE_THREADS", None)
        import torch

        from sharding.dist import init_dist

        d = init_dist()
        queue.put((rank, sorted(os.sched_getaffinity(0)), torch.get_num_threads(), d.placements))
        d.cpu_group.all_reduce(torch.ones(1))  # both have reported before either leaves
    except BaseException as e:  # noqa: BLE001 - reported to the test
        queue.put((rank, repr(e), None, None))


def test_distribute_spreads_two_ranks_through_init_dist():
    allowed = sorted(os.sched_getaffinity(0))
    nodes = [n for n in read_topology() if set(n.cpus) & set(allowed)]
    if len(nodes) != 1 or len(allowed) < 2:
        pytest.skip("written for a one-node host with at least 2 CPUs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in range(2):
            rank, cpus, threads, placements = queue.get(timeout=120)
            got[rank] = (cpus, threads, placements)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    half = len(allowed) // 2
    assert got[0][:2] == (allowed[:half], half), got
    assert got[1][:2] == (allowed[half:], len(allowed) - half), got
    # rank 0 knows where both run; rank 1 only itself
    assert sorted(got[0][2]) == [0, 1] and sorted(got[1][2]) == [1]
    for rank in (0, 1):
        record = got[0][2][rank]
        assert record["numa_nodes"] == str(nodes[0].id) and record["cpus"] == format_cpulist(got[rank][0])
        assert record["threads"] == str(got[rank][1]) and record["numa"].startswith("memory: ")


def test_a_bound_rank_gets_a_thread_per_cpu():
    from sharding.dist import threads_per_rank

    assert threads_per_rank(2, Placement(1, (1,), (4, 5, 6, 7, 12, 13), (1,))) == 6  # not 6 // 2
    assert threads_per_rank(1) == len(os.sched_getaffinity(0))


def test_one_rank_in_process_is_not_bound_by_auto(monkeypatch):
    """The in-process LLM's case: init_dist with one rank leaves the caller's affinity alone under auto."""
    import torch

    from sharding.dist import init_dist

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TPSERVE_NUMA"):
        monkeypatch.delenv(var, raising=False)
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        d = init_dist()
    finally:
        torch.set_num_threads(threads)
    assert os.sched_getaffinity(0) == before
    assert d.placements[0]["numa_nodes"] == "" and d.placements[0]["numa"].startswith("not bound: ")
    assert d.placements[0]["cpus"] == format_cpulist(before)


# --- the flag and what rank 0 shows ---

def test_numa_flag_parses_and_refuses_a_bad_value(capsys):
    from server.cli.main import build_parser

    ap = build_parser()
    assert ap.parse_args(["serve", "m"]).numa is None
    assert ap.parse_args(["serve", "m", "--numa", "distribute"]).numa == "distribute"
    with pytest.raises(SystemExit) as e:
        ap.parse_args(["serve", "m", "--numa", "sockets"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--numa: invalid choice: 'sockets'" in err and "'auto', 'off', 'distribute'" in err


def test_launcher_hands_the_mode_to_the_ranks_and_checks_the_variable(monkeypatch):
    from server.cli.launcher import rank_settings

    assert rank_settings("off") == {"TPSERVE_NUMA": "off"}
    monkeypatch.setenv("TPSERVE_NUMA", "distribute")
    assert rank_settings(None) == {}  # the ranks inherit the variable
    monkeypatch.setenv("TPSERVE_NUMA", "sockets")
    with pytest.raises(ValueError, match="TPSERVE_NUMA must be auto, off or distribute"):
        rank_settings(None)


def test_start_line_and_metrics_show_where_ranks_run():
    from prometheus_client import generate_latest

    from server.api.metrics import Metrics
    from server.cli.main import describe_placements

    def record(host, nodes, cpus):
        return {"host": host, "local_rank": "0", "numa_nodes": nodes, "cpus": cpus, "threads": "4",
                "numa": "memory: preferred node 1" if nodes else "not bound: NUMA binding is off"}

    assert describe_placements({0: record("a", "", "0-7")}) is None
    assert describe_placements({0: record("a", "0", "0-3"), 1: record("a", "1", "4-7")}) == \
        "NUMA placement: rank 0 node 0, CPUs 0-3, 4 threads; rank 1 node 1, CPUs 4-7, 4 threads"
    assert "rank 1 on b unbound, CPUs 0-7" in describe_placements({0: record("a", "0", "0-3"),
                                                                   1: record("b", "", "0-7")})
    m = Metrics()
    m.show_placements({0: record("a", "0", "0-3"), 1: record("a", "1", "4-7")})
    body = generate_latest(m.registry).decode()
    assert 'tpserve_rank_placement_info{cpus="4-7",host="a",local_rank="0",numa="memory: preferred node 1",' \
           'numa_nodes="1",rank="1",threads="4"} 1.0' in body
