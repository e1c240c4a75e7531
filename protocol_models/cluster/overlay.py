"""One private network for a run's nodes: a WireGuard overlay, and the check that the job does
not run on public addresses.

The job's sockets are unauthenticated and unencrypted: torchrun's c10d store (``MASTER_PORT``),
the workers' store, gloo's and NCCL's connections, and the plugin's object collectives, which
unpickle what they receive. Anyone who reaches one of their ports can join or feed the job. So
the nodes first join one encrypted overlay (WireGuard: every packet between two nodes is
authenticated by the peers' keys and encrypted), and the job uses only overlay addresses. On
the public side each node then needs one UDP port open (``PORT``); everything else runs inside.

    python -m protocol_models.overlay nodes.txt --out overlay/

``nodes.txt`` names each node's public address (``host`` or ``host:port``), one per line in
node order (``#`` comments allowed). This writes ``overlay/node-<i>/wgpm.conf`` (wg-quick's
format: the node's private key, its overlay address ``10.77.0.<i + 1>/24`` by default, every
other node as a peer) and prints, per node, the command that brings the overlay up and the
launch variables that keep the job on it. Keys come from ``wg genkey`` (``wireguard-tools``);
``wg-quick`` falls back to the user-space ``wireguard-go`` where the kernel has no WireGuard
module (Debian/Ubuntu: ``apt install wireguard-tools wireguard-go``).

The start-up check that keeps a job of several nodes off public addresses is
``tools.interfaces.public_address_problem``.
"""

from __future__ import annotations

import argparse
import ipaddress
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from protocol_models.tools.errors import UserError

PORT = 51820
"""WireGuard's UDP port on every node's public address (its default)."""
INTERFACE = "wgpm"
"""The overlay's interface name on every node (the name of wg-quick's config file; ``wg*``, so
the interface check (``tools.interfaces``) knows it for a VPN)."""
SUBNET = "10.77.0.0/24"


@dataclass(frozen=True)
class Node:
    """One node of the overlay: its public endpoint and its address inside the overlay."""

    endpoint: str
    """``host:port`` other nodes send their WireGuard packets to."""
    address: ipaddress.IPv4Interface


def read_nodes(text: str, subnet: str = SUBNET) -> list[Node]:
    """The nodes of a ``nodes.txt`` (module docstring), node ``i`` at the subnet's ``i + 1``."""
    network = ipaddress.IPv4Network(subnet)
    hosts = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    hosts = [h for h in hosts if h]
    if len(hosts) < 2:
        raise UserError(f"the nodes file names {len(hosts)} node(s): an overlay joins 2 or more")
    if len(hosts) > network.num_addresses - 2:
        raise UserError(f"--subnet {subnet}: too small for {len(hosts)} nodes")
    nodes = []
    for i, host in enumerate(hosts):
        address = ipaddress.IPv4Interface(f"{network.network_address + i + 1}/{network.prefixlen}")
        nodes.append(Node(endpoint(host), address))
    return nodes


def endpoint(host: str) -> str:
    """``host``, ``host:port``, an IPv6 address or ``[v6]:port`` as WireGuard's ``host:port``
    (``PORT`` where none is given); a port must be 1-65535."""
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        port = rest.removeprefix(":") if rest.startswith(":") else ("" if not rest else None)
        name = f"[{name}]"
    elif host.count(":") > 1:  # a bare IPv6 address
        name, port = f"[{host}]", ""
    else:
        name, _, port = host.partition(":")
    if port is None or (port and not (port.isdigit() and 1 <= int(port) <= 65535)) or not name:
        raise UserError(f"nodes file: {host!r} is not host, host:port, an IPv6 address or "
                        "[IPv6]:port (port 1-65535)")  # fmt: skip
    return f"{name}:{port or PORT}"


def _wg(*args: str, stdin: str | None = None) -> str:
    if shutil.which("wg") is None:
        raise UserError("wg not found: install wireguard-tools (Debian/Ubuntu: apt install "
                        "wireguard-tools wireguard-go)")  # fmt: skip
    done = subprocess.run(["wg", *args], input=stdin, capture_output=True, text=True)
    if done.returncode:
        raise UserError(f"wg {args[0]} failed: {done.stderr.strip() or done.returncode}")
    return done.stdout.strip()


def node_configs(nodes: list[Node]) -> list[str]:
    """wg-quick's config of every node: its own key and overlay address, every other node a
    peer reached at its endpoint and routed by its overlay address (``/32``)."""
    keys = [_wg("genkey") for _ in nodes]
    public = [_wg("pubkey", stdin=key + "\n") for key in keys]
    configs = []
    for i, node in enumerate(nodes):
        port = node.endpoint.rsplit(":", 1)[1]
        lines = ["[Interface]", f"PrivateKey = {keys[i]}", f"Address = {node.address}",
                 f"ListenPort = {port}"]  # fmt: skip
        for j, peer in enumerate(nodes):
            if j != i:
                lines += ["", "[Peer]", f"PublicKey = {public[j]}",
                          f"Endpoint = {peer.endpoint}", f"AllowedIPs = {peer.address.ip}/32",
                          "PersistentKeepalive = 25"]  # fmt: skip
        configs.append("\n".join(lines) + "\n")
    return configs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m protocol_models.overlay",
        description="Write a WireGuard overlay's wg-quick configs for a run's nodes.",
    )
    parser.add_argument("nodes", help="file: each node's public host[:port], one per line, in "
                        "node order")  # fmt: skip
    parser.add_argument("--out", default="overlay", help="folder for node-<i>/wgpm.conf")
    parser.add_argument("--subnet", default=SUBNET, help=f"overlay addresses (default {SUBNET})")
    args = parser.parse_args(argv)
    try:
        nodes = read_nodes(Path(args.nodes).read_text(), args.subnet)
        configs = node_configs(nodes)
    except (OSError, ValueError, UserError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    for i, text in enumerate(configs):
        path = out / f"node-{i}" / f"{INTERFACE}.conf"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.chmod(0o600)  # also where an earlier run left the file
        path.write_text(text)
    print(f"wrote {len(configs)} configs under {out}/ (each holds its node's private key: copy "
          "node-<i>/ to node i only)")  # fmt: skip
    ports = sorted({node.endpoint.rsplit(":", 1)[1] for node in nodes}, key=int)
    print(f"on the public side, open UDP {', '.join(ports)} (each node its own port in "
          "nodes.txt); nothing else\n")  # fmt: skip
    for i, node in enumerate(nodes):
        config = out / f"node-{i}" / f"{INTERFACE}.conf"
        print(f"node {i} ({node.endpoint}): sudo wg-quick up {config}")
    print(f"\nthen launch with MASTER_ADDR={nodes[0].address.ip} GLOO_SOCKET_IFNAME={INTERFACE} "
          f"NCCL_SOCKET_IFNAME={INTERFACE} on every node")  # fmt: skip
    return 0
