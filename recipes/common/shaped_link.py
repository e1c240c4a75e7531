"""Training over the real shaped link of ``recipes.common.tun_relay``, shared by ``real_link``
and ``l4_regime``: one torchrun node per namespace, and the TCP settings the config check
recommends for the link, applied in every namespace."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

from recipes.common import REPO, tun_relay
from recipes.common.tun_relay import ADDRESSES, DEVICES, Relay, Shape, in_namespace

MASTER_PORT = 29533


def apply_tcp_fixes(shape: Shape, nodes: int, skip: tuple[str, ...] = ()) -> dict:
    """Give every namespace the TCP settings the config check recommends for ``shape`` (but
    those in ``skip``); returns what was set, per namespace (a setting the kernel refuses is
    noted as refused). A congestion control a namespace may only choose from the host's
    allowed list is added to that list first (recorded as ``host``)."""
    applied: dict[str, dict] = {}
    for node in range(nodes):
        ns = tun_relay.NAMESPACES[node]
        ask = (
            "import json; from protocol_models.wire.transport import tcp_fixes; "
            f"print(json.dumps(tcp_fixes({shape.mbps}, {shape.delay_ms})))"
        )
        out = subprocess.run(in_namespace(node, [sys.executable, "-c", ask]), cwd=REPO,
                             capture_output=True, text=True, check=True)  # fmt: skip
        applied[ns] = {}
        for name, value in json.loads(out.stdout).items():
            if name in skip:
                continue
            if name == "net.ipv4.tcp_congestion_control":
                applied["host"] = allow_congestion_control(value)
            done = subprocess.run(in_namespace(node, ["sysctl", "-q", "-w", f"{name}={value}"]),
                                  capture_output=True)  # fmt: skip
            applied[ns][name] = value if done.returncode == 0 else f"refused ({value})"
    return applied


def allow_congestion_control(name: str) -> dict:
    """Add ``name`` to the host's ``net.ipv4.tcp_allowed_congestion_control`` (a namespace can
    only pick from it); returns the setting as it now is."""
    key = "net.ipv4.tcp_allowed_congestion_control"
    allowed = host_sysctl(key).split()
    if name not in allowed:
        subprocess.run(["sysctl", "-q", "-w", f"{key}={' '.join([*allowed, name])}"], check=False)
    return {key: host_sysctl(key)}


def host_sysctl(key: str) -> str:
    """This host's (the initial namespace's) value of sysctl ``key``."""
    return subprocess.run(["sysctl", "-n", key], capture_output=True, text=True).stdout.strip()


def node_command(node: int, nodes: int, folder: Path, overrides: list[str],
                 toml: Path) -> list[str]:  # fmt: skip
    """torchrun for node ``node`` of ``nodes`` in its namespace; node 0 hosts the store."""
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nodes),
        "--node_rank",
        str(node),
        "--nproc_per_node",
        "1",
        "--master_addr",
        ADDRESSES[0],
        "--master_port",
        str(MASTER_PORT),
        "-m",
        "protocol_models.train",
        "--toml",
        str(toml),
        "--dump_folder",
        str(folder),
        *overrides,
    ]
    env = ["env", f"GLOO_SOCKET_IFNAME={DEVICES[node]}", "PROTOCOL_MODELS_DEVICE=cpu"]
    env.append("OMP_NUM_THREADS=1")  # what torchrun sets for the simulated runs' local processes
    return in_namespace(node, [*env, *torchrun])


@contextlib.contextmanager
def node_process(node: int, nodes: int, folder: Path, overrides: list[str], toml: Path):
    """Node ``node``'s torchrun, logging to ``run_node<node>.log``; terminated (with its
    workers) if the ``with`` body ends before it does."""
    with open(folder / f"run_node{node}.log", "w") as log:
        cmd = node_command(node, nodes, folder, overrides, toml)
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()


def real_run(folder: Path, overrides: list[str], nodes: int, relay: Relay,
             toml: Path) -> tuple[list[dict], dict[str, int]]:  # fmt: skip
    """One training run over the relay: ``nodes`` torchrun nodes, one per namespace (the link
    must be up); its ``metrics.jsonl`` records and the packets each link dropped during it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").unlink(missing_ok=True)
    before = relay.dropped()
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(node_process(n, nodes, folder, overrides, toml))
                 for n in range(nodes)]  # fmt: skip
        codes = [proc.wait() for proc in procs]
    if any(codes):
        raise RuntimeError(f"real-link run failed {codes}; see {folder}/run_node*.log")
    from protocol_models.training.metrics import read_jsonl

    dropped = {k: v - before[k] for k, v in relay.dropped().items()}
    return read_jsonl(folder / "metrics.jsonl"), dropped


def current_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True)
    return out.stdout.decode().strip()
