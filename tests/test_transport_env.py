"""The network the planner assumes and NCCL's memory, checked on the CPU: the transport
``scripts/multinode.env`` pins, ``gpu_check``'s reading of NCCL's log (sample lines as NCCL
2.30.7 prints them), its device memory report (injected numbers) and the checklist's count of
NCCL's sockets against ``ulimit -n``."""

from __future__ import annotations

import json
import os
import re
import subprocess
from types import SimpleNamespace

import pytest
from conftest import REPO, TINY

from protocol_models.cluster.checklist import nccl_data_sockets, open_files_row
from protocol_models.cluster.gpu_check import (
    GIB,
    MEMORY_PROBE_ENV,
    NCCL_LOG_FOLDER,
    PHASES,
    DeviceMemoryProbe,
    memory_lines,
    memory_rows,
    nccl_log_env,
    nccl_network,
    network_line,
)
from protocol_models.config.run_config import load_config

ENV_FILE = REPO / "scripts" / "multinode.env"


def _env_file_defaults() -> dict[str, str]:
    return dict(re.findall(r'^: "\$\{(\w+):=([^}]*)\}"', ENV_FILE.read_text(), re.MULTILINE))


def test_the_env_file_pins_the_socket_transport_with_one_data_socket():
    """``NCCL_NET=Socket`` (the socket transport's name in NCCL's ``net_socket.cc``) and one
    data socket per connection; every default is exported, and an exported value wins."""
    defaults = _env_file_defaults()
    assert defaults["NCCL_NET"] == "Socket"
    assert (defaults["NCCL_SOCKET_NTHREADS"], defaults["NCCL_NSOCKS_PERTHREAD"]) == ("1", "1")

    def exported(**env: str) -> dict[str, str]:
        shown = subprocess.run(["bash", "-c", f'source "{ENV_FILE}"; env'], capture_output=True,
                               env={"PATH": os.environ["PATH"], **env}, text=True, check=True)  # fmt: skip
        return dict(line.split("=", 1) for line in shown.stdout.splitlines() if "=" in line)

    assert defaults.items() <= exported().items()
    assert exported(NCCL_NET="AWS Libfabric")["NCCL_NET"] == "AWS Libfabric"


# NCCL 2.30.7's INFO lines (github.com/NVIDIA/nccl, tag v2.30.7-1): the prefix
# "<host>:<pid>:<tid> [<cuda device>] NCCL INFO " (src/debug.cc:330 and :354), then
# "NET/Socket : Using [0]ens5:10.128.0.7<0>" (src/transport/net_socket.cc:77),
# "Using network Socket" (src/init.cc:486),
# "NET/Socket: Using 1 threads and 1 sockets per thread" (src/transport/net_socket.cc:400),
# "Successfully loaded external network plugin libnccl-net.so" (src/plugin/net.cc:126); and
# NCCL 2.27.3's "NET/Plugin: Loaded net plugin AWS Libfabric (v10)" (src/plugin/net/net_v10.cc:17;
# "AWS Libfabric" is aws-ofi-nccl's plugin name, its src/compat_v6.c).
SOCKET_LOG = """\
node-a:4021:4021 [0] NCCL INFO NCCL_SOCKET_IFNAME set by environment to ^lo,docker
node-a:4021:4021 [0] NCCL INFO NET/Socket : Using [0]ens5:10.128.0.7<0>
node-a:4021:4021 [0] NCCL INFO Using network Socket
node-a:4021:4109 [0] NCCL INFO NET/Socket: Using 1 threads and 1 sockets per thread
node-a:4021:4021 [0] NCCL INFO Using network Socket
"""
PLUGIN_LOG = """\
node-a:4022:4022 [1] NCCL INFO Successfully loaded external network plugin libnccl-net.so
node-a:4022:4022 [1] NCCL INFO Using network AWS Libfabric
"""
OLD_PLUGIN_LOG = """\
node-a:4023:4023 [2] NCCL INFO NET/Plugin: Loaded net plugin AWS Libfabric (v10)
node-a:4023:4023 [2] NCCL INFO Using network AWS Libfabric
"""


def _logs(tmp_path, *texts: str):
    folder = tmp_path / NCCL_LOG_FOLDER
    folder.mkdir(parents=True)
    for i, text in enumerate(texts):
        (folder / f"node-a.{4021 + i}.log").write_text(text)
    return folder


def test_gpu_check_names_the_network_nccl_used(tmp_path):
    """All communicators on ``Socket``: one line with the sockets NCCL logged; the data socket
    line absent (``NCCL_SOCKET_NTHREADS=0``): the control socket carries the data."""
    folder = _logs(tmp_path, SOCKET_LOG, SOCKET_LOG.replace("4021", "4022"))
    seen = nccl_network(folder)
    assert (seen.processes, seen.networks, seen.sockets) == (2, {"Socket": 2}, {(1, 1)})
    assert network_line(seen, 2, folder) == (
        "net transport: Socket (NCCL's TCP transport) in all 2 process(es) of this node, "
        f"1 thread(s) x 1 socket(s) per thread (NCCL's log: {folder})"
    )
    bare = nccl_network(_logs(tmp_path / "bare", "\n".join(SOCKET_LOG.splitlines()[:3])))
    assert "no data sockets, the data on each connection's control socket" in network_line(
        bare, 2, folder
    )


def test_a_net_plugin_is_one_warning_line_on_several_nodes(tmp_path):
    """A process whose communicators took an external plugin (NCCL 2.30's and 2.27's log lines):
    one ``warning:`` line naming it and the fix; on one node only a note."""
    folder = _logs(tmp_path, SOCKET_LOG, PLUGIN_LOG, OLD_PLUGIN_LOG)
    seen = nccl_network(folder)
    assert seen.networks == {"Socket": 1, "AWS Libfabric": 2}
    assert seen.plugins == {"libnccl-net.so", "AWS Libfabric"}
    line = network_line(seen, 4, folder)
    assert "\n" not in line
    assert line.startswith(
        "warning: NCCL used network 'AWS Libfabric' in 2 of 3 process(es), not Socket; "
        "external plugin loaded: AWS Libfabric, libnccl-net.so: the planner and the start-up "
        "estimates assume NCCL's socket transport; set NCCL_NET=Socket on every node"
    )
    assert network_line(seen, 1, folder).startswith(
        "net transport: 'AWS Libfabric' in 2 of 3 process(es)"
    )
    empty = tmp_path / "empty"
    assert network_line(nccl_network(empty), 2, empty).startswith(
        'net transport: no "Using network" line in NCCL\'s log'
    )


def test_the_check_run_logs_nccl_to_its_dump_folder(tmp_path):
    """INFO for NCCL's start-up and network messages, one file per process (``%h.%p``) in the
    dump folder's ``nccl`` folder (created: NCCL opens the file, not the folder); a user's
    TRACE level is kept."""
    env = nccl_log_env(str(tmp_path), {})
    assert env == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
                   "NCCL_DEBUG_FILE": str(tmp_path / "nccl" / "%h.%p.log")}  # fmt: skip
    assert (tmp_path / "nccl").is_dir()
    assert nccl_log_env(str(tmp_path), {"NCCL_DEBUG": "trace"})["NCCL_DEBUG"] == "TRACE"


def _readings(*values_gib):
    """A stand-in for ``read_device_memory``: (free, total, reserved) per call, from (used,
    reserved) in GiB on a 22 GiB device."""
    total = 22 * GIB
    readings = iter([(total - int(u * GIB), total, int(r * GIB)) for u, r in values_gib])
    return lambda device: next(readings)


def test_device_memory_outside_torch_phase_by_phase(tmp_path):
    """Each rank's probe writes its phases (device-wide use from ``cudaMemGetInfo`` and torch's
    reserved bytes); the report takes the node's rank with the most memory outside torch's
    allocator: used - reserved at each phase, the growth from the phase before, and a warning
    when it exceeds the planner's CUDA context + NCCL buffers."""
    quiet = DeviceMemoryProbe(tmp_path, 0, 4, "cuda:0", _readings((0.5, 0), (3.0, 2.25), (9, 8)))
    busy = DeviceMemoryProbe(tmp_path, 1, 4, "cuda:1", _readings((0.5, 0), (3.5, 2.25), (10, 8.5)))
    trainer = SimpleNamespace(steps=0)
    trainer.train_step = lambda it: setattr(trainer, "steps", trainer.steps + 1) or "done"
    for probe in (quiet, busy):
        probe.mark(PHASES[0])
        probe.mark(PHASES[1])
        probe.after_first_step(trainer)
        assert trainer.train_step(None) == "done"  # marks "after step 1", then unwraps
        trainer.train_step(None)
    assert trainer.steps == 4
    rows = memory_rows(tmp_path)
    assert [r["rank"] for r in rows] == [0, 1]
    assert [p["phase"] for p in rows[1]["phases"]] == list(PHASES)
    assert json.loads((tmp_path / "device_memory" / "rank1.json").read_text()) == rows[1]
    lines = memory_lines(rows, lambda row: (row["rank"] // 2, 1 * GIB, 0.25 * GIB))
    assert lines == [
        "device memory outside torch's allocator (NCCL + CUDA context; rank 1, the most of "
        "this node's 2, cuda:1): before connect 0.50 GiB, torch reserved 0.00 GiB; after "
        "connect 1.25 GiB (+0.75), torch reserved 2.25 GiB; after step 1 1.50 GiB (+0.25), "
        "torch reserved 8.50 GiB; 10.00 of 22.00 GiB of the device in use",
        "warning: 1.50 GiB outside torch's allocator on rank 1 (stage 0) is more than the "
        "planner's 1.00 GiB CUDA context + 0.25 GiB NCCL buffers: its memory estimate is short "
        "by the difference",
    ]
    assert len(memory_lines(rows, lambda row: (0, 1 * GIB, 0.5 * GIB))) == 1
    assert memory_lines([]) == []


def test_the_probe_is_off_outside_a_gpu_check_on_cuda(tmp_path):
    assert DeviceMemoryProbe.from_env(str(tmp_path), {}) is None
    assert DeviceMemoryProbe.from_env(str(tmp_path), {MEMORY_PROBE_ENV: "1",
                                                      "PROTOCOL_MODELS_DEVICE": "cpu"}) is None  # fmt: skip


@pytest.fixture(scope="module")
def llama_2b():
    return load_config(str(REPO / "configs" / "llama3_2b_protocol.toml"), [],
                       check_environment=False)  # fmt: skip


def test_nccl_sockets_per_worker_against_ulimit(llama_2b):
    """The 2B layout's middle stage: 4 boundary connections, 14 of the norm exchange (a send
    and a receive per other stage), 2 each of the pipeline's and the world's rings = 22, x 2
    channels = 44 connections; each holds its data sockets and a control socket."""
    wide = {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"}
    row = open_files_row(llama_2b, 8, wide, 1024)
    assert row.verdict == "warn" and row.detail.startswith(
        "up to 748 NCCL sockets per worker (stage 1: 44 network connections, 2 channels each "
        "counted, x (4 x 4 data + 1 control)): over half of ulimit -n 1024"
    )
    narrow = open_files_row(llama_2b, 8, {"NCCL_SOCKET_NTHREADS": "1",
                                          "NCCL_NSOCKS_PERTHREAD": "1"}, 1024)  # fmt: skip
    assert narrow.verdict == "ok" and narrow.detail.startswith("up to 88 NCCL sockets per worker")
    assert open_files_row(llama_2b, 8, wide, 700).verdict == "FAIL"
    assert open_files_row(llama_2b, 8, wide, None).verdict == "ok"
    assert open_files_row(llama_2b, 1, wide, 100).verdict == "n/a"
    cpu = load_config(str(TINY), [], check_environment=False)
    assert open_files_row(cpu, 2, wide, 100).verdict == "n/a"


def test_unset_socket_counts_take_nccls_largest_own_choice():
    """NCCL's own choice by NIC vendor (AWS 2 x 8, Google 4 x 1, else 0 x 1: the control socket
    alone), and its caps of 16 threads and 64 sockets."""
    assert nccl_data_sockets({})[0] == 16
    assert nccl_data_sockets({"NCCL_NSOCKS_PERTHREAD": "1"})[0] == 4
    assert nccl_data_sockets({"NCCL_SOCKET_NTHREADS": "0", "NCCL_NSOCKS_PERTHREAD": "1"}) == (
        0, "0 x 1 data")  # fmt: skip
    assert nccl_data_sockets({"NCCL_SOCKET_NTHREADS": "32", "NCCL_NSOCKS_PERTHREAD": "8"}) == (
        64, "16 x 4 data")  # fmt: skip


def test_every_node_reports_its_network_and_memory_next_to_the_planner(tmp_path, llama_2b):
    """``gpu_check``'s lines for one node of the 2B layout (a CUDA config): the network line from
    its NCCL logs, the memory line of its rank (rank 3: stage 3 of 8, one rank per stage)
    against the planner's terms for that stage; a CPU config has neither."""
    from protocol_models.cluster.gpu_check import node_lines
    from protocol_models.cluster.plan import plan_stages

    _logs(tmp_path, SOCKET_LOG)
    plan = plan_stages(llama_2b)[3]
    planned = plan.memory["context"] + plan.nccl_bytes
    probe = DeviceMemoryProbe(tmp_path, 3, 8, "cuda:0",
                              _readings((0.5, 0), (4, 3), (3 + planned / GIB + 1, 3)))  # fmt: skip
    for phase in PHASES:
        probe.mark(phase)
    lines = node_lines(llama_2b, tmp_path, 8)
    assert lines[0].startswith("net transport: Socket (NCCL's TCP transport) in all 1 process")
    assert lines[1].startswith("device memory outside torch's allocator (NCCL + CUDA context; "
                               "rank 3, cuda:0): before connect 0.50 GiB")  # fmt: skip
    assert lines[2].startswith(f"warning: {planned / GIB + 1:.2f} GiB outside torch's allocator "
                               "on rank 3 (stage 3) is more than the planner's 1.00 GiB")  # fmt: skip
    assert node_lines(load_config(str(TINY), [], check_environment=False), tmp_path, 1) == []
