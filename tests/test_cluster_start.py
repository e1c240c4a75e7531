"""What would stop the first multi-node GPU run at start-up, caught on CPU: the driver floor and
the installer's CUDA builds, a wandb run without a key, a Hub corpus a node cannot reach, flex
attention without its compiler toolchain, the rendezvous store behind a VPN/NAT address, NCCL's
interface choice next to a VPN, and which network FSDP takes next to the links between
regions."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import threading
from pathlib import Path

import pytest
from conftest import REPO, TINY

from protocol_models.cluster.checklist import fsdp_network_row, infiniband_devices
from protocol_models.cluster.fsdp_probe import render as render_fsdp
from protocol_models.config.run_config import load_config
from protocol_models.tools import cpu_shim
from protocol_models.tools.cuda_driver import driver_clause, node_driver
from protocol_models.tools.interfaces import interface_warning

DRIVER_570 = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Thu Jan 16 09:51:13 UTC 2025\n"
    "GCC version:  gcc version 12.3.0\n"
)


def test_a_driver_below_the_build_s_floor_is_named_with_the_fix(tmp_path, monkeypatch):
    """A CUDA 13.0 torch on an R570 node: the config check's line names the floor, the node's
    driver and the installer command for the CUDA 12 build."""
    version_file = tmp_path / "version"
    version_file.write_text(DRIVER_570)
    assert node_driver(version_file) == "570.86.15"
    assert node_driver(tmp_path / "absent") is None

    def init():
        raise RuntimeError("The NVIDIA driver on your system is too old (found version 12080).")

    monkeypatch.setattr(cpu_shim.torch.version, "cuda", "13.0")
    monkeypatch.setattr(cpu_shim.torch.cuda, "init", init)
    monkeypatch.setattr("protocol_models.tools.cuda_driver.DRIVER_VERSION_FILE", version_file)
    monkeypatch.delenv(cpu_shim.DEVICE_ENV, raising=False)
    with pytest.raises(cpu_shim.ConfigError) as err:
        cpu_shim.check_device("cuda", "cpu")
    line = str(err.value)
    assert "\n" not in line and line.startswith("hardware.device = 'cuda'")
    assert "too old (found version 12080)" in line
    assert "built for CUDA 13.0, which needs NVIDIA driver >= 580.65.06" in line
    assert "this node's is 570.86.15" in line
    assert "PM_TORCH_CUDA=cu128 bash scripts/env.sh" in line
    # a CUDA 12 build on that driver is fine; an R470 driver can only be updated
    assert driver_clause("12.8", "570.86.15").endswith("this node's is 570.86.15")
    assert driver_clause("13.0", "470.256.02").endswith(": update the driver")


def _fake_python(bin_dir: Path, log: Path, torch_build: str) -> None:
    """``python3`` on PATH that records its arguments; its ``-m venv`` makes a ``.venv`` whose
    python records too, cannot import protocol_models until something was pip-installed, and
    reports ``torch_build`` as the installed torch's local version."""
    venv_python = f"""#!/usr/bin/env bash
echo "$*" >> {log}
case "$*" in
  "-c import protocol_models") [ -f "$(dirname "$0")/installed" ] ;;
  -c*) echo {torch_build} ;;
  "-m pip install"*) touch "$(dirname "$0")/installed" ;;
esac
"""
    python3 = f"""#!/usr/bin/env bash
echo "python3 $*" >> {log}
mkdir -p .venv/bin
cat > .venv/bin/python <<'EOF'
{venv_python}EOF
chmod +x .venv/bin/python
"""
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(python3)
    (bin_dir / "python3").chmod(0o755)


@pytest.mark.parametrize("existing", [False, True], ids=["new venv", "venv of another build"])
def test_the_installer_takes_torch_from_the_cuda_build_asked_for(tmp_path, existing):
    """``PM_TORCH_CUDA=cu128 bash scripts/env.sh``: the pinned torch version of that build from
    its index, before the package (a new .venv), or in place of another build (an existing one);
    a malformed build is refused in one line. pip is faked: nothing is downloaded."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("scripts/env.sh", "pyproject.toml"):
        (repo / name).write_text((REPO / name).read_text())
    log = tmp_path / "log"
    _fake_python(tmp_path / "bin", log, "cu130")
    env = {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "PM_TORCH_CUDA": "cu128",
    }
    if existing:  # a .venv with PyPI's CUDA 13.0 build
        subprocess.run(["bash", "-c", "source scripts/env.sh"], cwd=repo, env={**env, "PM_TORCH_CUDA": ""},
                       check=True, capture_output=True)  # fmt: skip
        log.unlink()
    result = subprocess.run(["bash", "-c", "source scripts/env.sh"], cwd=repo, env=env,
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stderr
    pins = [line for line in log.read_text().splitlines() if "pip install" in line]
    torch_pin = (
        "pip install --quiet --index-url https://download.pytorch.org/whl/cu128 torch==2.14.1+cu128"
    )
    if existing:
        assert pins == [f"-m {torch_pin}"]
    else:
        assert pins == ["-m pip install --quiet --upgrade pip", f"-m {torch_pin}",
                        "-m pip install --quiet -e .[test]"]  # fmt: skip
    bad = subprocess.run(["bash", "-c", "source scripts/env.sh"], cwd=repo,
                         env={**env, "PM_TORCH_CUDA": "12.8"}, capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "error: PM_TORCH_CUDA=12.8: expected cpu or cuNNN (e.g. cu128, the CUDA 12.8 build of torch 2.14.1)"
    ]


def _refusal(args: list[str], env: dict[str, str]) -> str:
    """The one ``error:`` line ``scripts/train.sh`` TINY refuses ``args`` with (no worker)."""
    result = subprocess.run(["bash", "scripts/train.sh", str(TINY), *args], cwd=REPO,
                            capture_output=True, text=True, timeout=120, env={**os.environ, **env})  # fmt: skip
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "Traceback" not in result.stdout
    return line


def test_online_wandb_without_a_key_is_refused_before_any_worker(tmp_path):
    """No WANDB_API_KEY, no netrc entry, WANDB_MODE unset (online): one line, no worker; offline
    mode or a key in the netrc file pass the check."""
    dump = tmp_path / "run"
    env = {"HOME": str(tmp_path), "WANDB_API_KEY": "", "NETRC": str(tmp_path / "netrc")}
    env = {**env, "WANDB_MODE": ""}
    args = ["--dump_folder", str(dump), "--metrics.enable_wandb", "--training.steps", "1"]
    line = _refusal(args, env)
    assert "metrics.enable_wandb = true and WANDB_MODE = 'online'" in line
    assert "no wandb API key" in line and "api.wandb.ai" in line and "WANDB_MODE=offline" in line
    assert not dump.exists()
    # the GPU check, which runs with wandb off, checks the key the real run will need
    check = subprocess.run(["bash", "scripts/gpu_check.sh", str(TINY), "--metrics.enable_wandb"],
                           cwd=REPO, capture_output=True, text=True, timeout=120,
                           env={**os.environ, **env})  # fmt: skip
    assert check.returncode == 2 and check.stderr.strip().splitlines() == [line]
    from protocol_models.config.preflight import check_wandb_key

    check_wandb_key({**env, "WANDB_MODE": "offline"})
    (tmp_path / "netrc").write_text(
        "machine api.wandb.ai\n  login user\n  password " + "0" * 40 + "\n"
    )
    check_wandb_key(env)


def test_a_hub_corpus_this_node_cannot_reach_is_refused_before_any_worker(tmp_path):
    """A streamed Hub corpus and a Hub that does not answer (a closed local port): one line
    naming the key and the fixes, not a warning followed by every worker failing."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    args = ["--dump_folder", str(tmp_path / "run"), "--dataloader.hf_dataset", "allenai/c4",
            "--dataloader.streaming", "true", "--validator.enable", "false"]  # fmt: skip
    line = _refusal(args, {"HF_ENDPOINT": f"http://127.0.0.1:{closed}", "HF_HUB_OFFLINE": "0"})
    assert "dataloader.hf_dataset = 'allenai/c4': the Hugging Face Hub is unreachable" in line
    assert "HF_ENDPOINT" in line and "dataloader.files" in line
    assert not (tmp_path / "run").exists()


def test_flex_attention_without_its_toolchain_is_refused_before_any_worker(tmp_path):
    """Flex attention is compiled and Triton builds its launchers with a C compiler against
    ``Python.h``: a missing compiler (``CC`` naming no program; no gcc or clang on ``PATH``) or
    missing headers is one line, not every worker failing in its first forward."""
    from protocol_models.config.preflight import check_flex_toolchain

    args = ["--dump_folder", str(tmp_path / "run"), "--model.attention", "flex"]
    line = _refusal(args, {"CC": "no-such-cc"})
    assert "model.attention = \"flex\" is compiled" in line
    assert "CC = 'no-such-cc' is not a program" in line and "install gcc" in line
    assert not (tmp_path / "run").exists()
    check = subprocess.run(["bash", "scripts/gpu_check.sh", str(TINY), *args], cwd=REPO,
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "CC": "no-such-cc"})  # fmt: skip
    assert check.returncode == 2 and check.stderr.strip().splitlines() == [line]
    assert "| toolchain | FAIL | model.attention = \"flex\" is compiled" in check.stdout
    with pytest.raises(ValueError, match="no CC, no gcc or clang on PATH"):
        check_flex_toolchain({"PATH": str(tmp_path)})
    with pytest.raises(ValueError, match=f"no Python.h in {tmp_path}; install them"):
        check_flex_toolchain(os.environ, include=str(tmp_path))
    check_flex_toolchain(os.environ)  # this machine has both


def test_node_zero_hosts_the_rendezvous_store_when_no_host_name_matches(monkeypatch):
    """Behind NAT or on a VPN address c10d's host-name match fails on every node, so without
    ``is_host`` none hosts the store; the launcher's rendezvous makes node 0 host it, and both
    nodes join with their own node ranks (the rendezvous of two real launchers, in threads)."""
    from torch.distributed.elastic.rendezvous import (
        RendezvousParameters,
        c10d_rendezvous_backend,
        rendezvous_handler_registry,
    )

    from protocol_models.cluster.launch import RENDEZVOUS_BACKEND, rendezvous_conf

    monkeypatch.setattr(c10d_rendezvous_backend, "_matches_machine_hostname", lambda host: False)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks, errors, handlers = {}, [], []  # kept alive: node 0's hosts the store

    def join(node_rank: int) -> None:
        conf = dict(
            kv.split("=") for kv in rendezvous_conf("read_timeout=20", node_rank).split(",")
        )
        try:
            handler = rendezvous_handler_registry.create_handler(RendezvousParameters(
                RENDEZVOUS_BACKEND, f"127.0.0.1:{port}", "vpn", 2, 2, "127.0.0.1", **conf))  # fmt: skip
            handlers.append(handler)
            ranks[node_rank] = handler.next_rendezvous().rank
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e))

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and ranks == {0: 0, 1: 1}, errors
    assert rendezvous_conf("is_host=0", 0) == "is_host=0,node_rank=0,read_timeout=900"
    assert rendezvous_conf("read_timeout=20", None) == "read_timeout=20"  # the user's choice stands


VPN_NODE = {
    "lo": ipaddress.IPv4Interface("127.0.0.1/8"),
    "eth0": ipaddress.IPv4Interface("10.128.0.7/20"),
    "docker0": ipaddress.IPv4Interface("172.17.0.1/16"),
    "wg0": ipaddress.IPv4Interface("10.99.0.3/24"),
}


def test_a_user_error_ends_the_launch_with_its_line_after_the_store_host_left(tmp_path):
    """Both nodes meet the same user error; the node hosting the rendezvous store may close the
    rendezvous and exit first. The other launcher's attempt to close it then cannot reach the
    store, and still ends with the user error's line (not "rendezvous failed")."""
    from torch.distributed.elastic.rendezvous import (
        RendezvousClosedError,
        RendezvousConnectionError,
    )

    from protocol_models.cluster.launch import ProtocolRendezvous

    class StoreGone:
        def set_closed(self):
            raise RendezvousConnectionError("The connection to the C10d store has failed.")

    (tmp_path / "user_error").write_text("error: pipeline stages disagree on the subspace\n")
    handler = ProtocolRendezvous(StoreGone(), None, None, str(tmp_path / "user_error"))
    with pytest.raises(RendezvousClosedError, match="^error: pipeline stages disagree"):
        handler.next_rendezvous()


def test_nccl_interface_choice_next_to_a_vpn_is_warned_about():
    """A node with the region's private eth0 and a WireGuard wg0: the SLURM default
    ``^lo,docker`` (or no setting) gets one warning naming both and the setting; a named
    interface, or a node with one path, gets none."""
    line = interface_warning({"NCCL_SOCKET_IFNAME": "^lo,docker"}, VPN_NODE)
    assert line == (
        "warning: NCCL_SOCKET_IFNAME=^lo,docker lets NCCL pick eth0 (10.128.0.7), a private "
        "address other regions cannot reach, instead of wg0 (10.99.0.3: it looks like a VPN); "
        "set NCCL_SOCKET_IFNAME=wg0 GLOO_SOCKET_IFNAME=wg0"
    )
    # the rendezvous address tells which interface the nodes share, whatever its name
    nat = {n: a for n, a in VPN_NODE.items() if n != "wg0"} | {"ens5": VPN_NODE["wg0"]}
    line = interface_warning({"MASTER_ADDR": "10.99.0.1"}, nat)
    assert "(unset) lets NCCL pick eth0" in line and "instead of ens5" in line
    assert "subnet holds MASTER_ADDR 10.99.0.1" in line
    assert interface_warning({"NCCL_SOCKET_IFNAME": "wg0"}, VPN_NODE) is None
    assert interface_warning({}, {"lo": VPN_NODE["lo"], "eth0": VPN_NODE["eth0"]}) is None


def test_fsdp_network_next_to_the_links_between_regions_is_named(tmp_path):
    """The 8B layout's FSDP inside a region on two nodes: ``NCCL_IB_DISABLE=1`` next to
    InfiniBand devices (found in the kernel's device folder) is a warning that FSDP runs over
    TCP too; InfiniBand without it, a warning that the pipeline's groups would try it between
    regions; no InfiniBand, ok; one node or no sharding, not applicable."""
    config = load_config(str(TINY), ["--parallelism.data_parallel_shard_degree", "2"],
                         check_environment=False)  # fmt: skip
    (tmp_path / "mlx5_0").mkdir()
    devices = infiniband_devices(str(tmp_path))
    assert devices == ["mlx5_0"] and infiniband_devices(str(tmp_path / "none")) == []
    off = fsdp_network_row(config, 2, {"NCCL_IB_DISABLE": "1"}, devices)
    assert (off.verdict, off.detail) == ("warn", (
        "NCCL_IB_DISABLE=1 next to InfiniBand devices (mlx5_0): FSDP inside the region runs "
        "over TCP too (gpu_check's FSDP lines say what it costs); unset it only if InfiniBand "
        "or RoCE also routes between the regions"))  # fmt: skip
    on = fsdp_network_row(config, 2, {}, devices)
    assert on.verdict == "warn" and "set NCCL_IB_DISABLE=1 unless" in on.detail
    assert fsdp_network_row(config, 2, {"NCCL_IB_DISABLE": "1"}, []).verdict == "ok"
    assert fsdp_network_row(config, 1, {}, devices).verdict == "n/a"
    unsharded = load_config(str(TINY), [], check_environment=False)
    assert fsdp_network_row(unsharded, 2, {}, devices).verdict == "n/a"


def test_fsdp_probe_lines_name_the_network_and_the_share_of_the_step():
    """``gpu_check``'s FSDP line: all-gathers per step x their time + the reduce-scatter, as a
    share of the measured step, and the network NCCL was told to use."""
    row = {"stage": 1, "ranks": 16, "backend": "nccl", "nccl_ib_disable": True,
           "all_gathers_per_step": 1, "all_gather_bytes": 4_000_000_000, "all_gather_s": 0.5,
           "reduce_scatter_bytes": 8_000_000_000, "reduce_scatter_s": 1.0}  # fmt: skip
    assert render_fsdp([row], 3.0) == [
        "FSDP stage 1 (16 ranks, NCCL over TCP: NCCL_IB_DISABLE=1): 1 x all-gather 4.00 GB in "
        "500.0 ms + reduce-scatter 8.00 GB in 1000.0 ms = 1.5 s per step when not overlapped "
        "(50% of the measured 3 s step)"
    ]
    always = {**row, "backend": "gloo", "all_gathers_per_step": 8, "all_gather_bytes": 2_500_000}
    assert render_fsdp([always], 10.0)[0].startswith(
        "FSDP stage 1 (16 ranks, gloo): 8 x all-gather 2.50 MB in 500.0 ms + reduce-scatter "
        "8.00 GB in 1000.0 ms = 5 s per step"
    )


def test_only_the_logging_node_needs_a_wandb_key():
    """wandb runs on one rank, the first of the last pipeline stage: on a 2-node, 2-stage
    launch only node 1 (the launcher's check) and its rank 1 (the worker's) need the key."""
    from protocol_models.config.preflight import holds_metrics_rank

    config = load_config(str(TINY), [], check_environment=False)  # 2 stages, 2 ranks
    assert [holds_metrics_rank(config, {"NNODES": "2", "NODE_RANK": n}) for n in "01"] == [
        False, True,
    ]  # fmt: skip
    assert holds_metrics_rank(config, {})  # one node holds every rank
    assert [holds_metrics_rank(config, {"RANK": r, "LOCAL_RANK": "0"}) for r in "01"] == [
        False, True,
    ]  # fmt: skip


def test_a_restarted_run_logs_to_one_wandb_run(tmp_path):
    """Offline wandb: a run launched, then resumed twice from its checkpoint, keeps one run id
    (``<dump>/wandb/run_id``): three offline run folders, one per launch, all of that run."""
    dump = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "WANDB_RUN_ID"}
    env.update(WANDB_MODE="offline", OMP_NUM_THREADS="1")
    for steps in (1, 2, 3):
        result = subprocess.run(
            ["bash", "scripts/train.sh", str(TINY), "--dump_folder", str(dump),
             "--metrics.enable_wandb", "--checkpoint.enable", "--checkpoint.interval", "1",
             "--training.steps", str(steps)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_id = (dump / "wandb" / "run_id").read_text().strip()
    runs = sorted((dump / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 3 and all(r.name.endswith(f"-{run_id}") for r in runs), runs
    assert all((r / f"run-{run_id}.wandb").is_file() for r in runs)


def test_public_addresses_are_found_where_the_sockets_would_use_them(monkeypatch):
    """The start-up refusal of public addresses (``public_address_problem``, one node's view):
    a public ``MASTER_ADDR`` (IPv4 or IPv6) is refused unless ``PM_ALLOW_PUBLIC_NETWORK=1``;
    ``NCCL_SOCKET_IFNAME`` picks interfaces by prefix (``=``: exactly), ``GLOO_SOCKET_IFNAME``
    exactly, and a key that picks none leaves the route toward ``MASTER_ADDR`` to decide."""
    from protocol_models.tools import interfaces

    fake = {"lo": ipaddress.IPv4Interface("127.0.0.1/8"),
            "ens5": ipaddress.IPv4Interface("8.8.4.4/24")}  # fmt: skip (a public NIC)
    monkeypatch.setattr(interfaces, "ipv4_interfaces", lambda: fake)
    two = {"NNODES": "2", "MASTER_ADDR": "127.0.0.1"}
    check = interfaces.public_address_problem
    assert "MASTER_ADDR = 1.1.1.1 is a public address" in check({**two, "MASTER_ADDR": "1.1.1.1"})
    assert "(2606:4700::1111)" in check({**two, "MASTER_ADDR": "2606:4700::1111"})
    assert check({**two, "MASTER_ADDR": "1.1.1.1", "PM_ALLOW_PUBLIC_NETWORK": "1"}) is None
    assert check({**two, "MASTER_ADDR": "1.1.1.1", "NNODES": "1"}) is None  # one node
    line = check({**two, "NCCL_SOCKET_IFNAME": "en"})
    assert "NCCL_SOCKET_IFNAME = en (ens5: 8.8.4.4) is a public address" in line
    for quiet in ({"NCCL_SOCKET_IFNAME": "=en"}, {"GLOO_SOCKET_IFNAME": "ens"},
                  {"NCCL_SOCKET_IFNAME": "^docker"}, {"GLOO_SOCKET_IFNAME": "lo"}):  # fmt: skip
        assert check({**two, **quiet}) is None, quiet  # the route to 127.0.0.1 is loopback
    assert "GLOO_SOCKET_IFNAME = ens5" in check({**two, "GLOO_SOCKET_IFNAME": "ens5"})
