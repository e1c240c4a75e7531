"""Which network interface the cross-region traffic would leave by, and a warning when it is the
wrong one.

A node rented in a region often has two interfaces: the region's private network (``eth0``,
``10.x``/``172.16-31.x``/``192.168.x``, unreachable from other regions) and a VPN that joins
the regions (WireGuard's ``wg0``, ``tailscale0``, ZeroTier's ``zt*``, OpenVPN's ``tun0``). NCCL
and gloo bind the interfaces ``NCCL_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME`` name; with the
SLURM scripts' default ``^lo,docker`` (every interface but those) NCCL may announce the private
address, and peers in other regions then never connect: the first collective hangs until the
timeout. ``interface_warning`` says so in one line, with the setting that picks the VPN.

``public_address_problem`` refuses a job of several nodes on public addresses: its sockets
carry no authentication and no encryption (``cluster.overlay`` joins the nodes in a WireGuard
overlay instead).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Mapping

VPN_PREFIXES = ("wg", "tailscale", "zt", "tun", "nebula")
"""Interface name prefixes of the usual VPNs (WireGuard, Tailscale, ZeroTier, OpenVPN, Nebula)."""
IGNORED_PREFIXES = ("lo", "docker", "veth", "br-", "virbr")
"""Loopback and container bridges: never a path to another node."""
SIOCGIFADDR, SIOCGIFNETMASK = 0x8915, 0x891B


def ipv4_interfaces() -> dict[str, ipaddress.IPv4Interface]:
    """This machine's interfaces with an IPv4 address: name -> address/prefix."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                address = fcntl.ioctl(s.fileno(), SIOCGIFADDR, request)[20:24]
                netmask = fcntl.ioctl(s.fileno(), SIOCGIFNETMASK, request)[20:24]
            except OSError:  # no IPv4 address
                continue
            found[name] = ipaddress.IPv4Interface(
                f"{socket.inet_ntoa(address)}/{socket.inet_ntoa(netmask)}"
            )
    return found


def interface_warning(
    env: Mapping[str, str] = os.environ,
    interfaces: Mapping[str, ipaddress.IPv4Interface] | None = None,
) -> str | None:
    """One ``warning:`` line when NCCL's interface choice is left open (``NCCL_SOCKET_IFNAME``
    unset or an exclusion list ``^...``) while this node has a VPN-like interface -- one named
    like a VPN, or the one whose subnet holds ``MASTER_ADDR`` -- next to a private-address
    interface other regions cannot reach; None otherwise (a single path, or the choice made)."""
    chosen = env.get("NCCL_SOCKET_IFNAME", "")
    if chosen and not chosen.startswith("^"):
        return None
    interfaces = ipv4_interfaces() if interfaces is None else interfaces
    usable = {n: a for n, a in interfaces.items() if not n.startswith(IGNORED_PREFIXES)}
    vpn = [n for n in usable if n.startswith(VPN_PREFIXES)]
    try:
        master = ipaddress.IPv4Address(env.get("MASTER_ADDR", ""))
    except ValueError:  # unset or a host name
        master = None
    shared = [n for n, a in usable.items() if master is not None and master in a.network]
    path = (shared or vpn or [None])[0]
    private = [n for n, a in usable.items() if n != path and a.ip.is_private]
    if path is None or not private:
        return None
    why = f"its subnet holds MASTER_ADDR {master}" if shared else "it looks like a VPN"
    others = ", ".join(f"{n} ({usable[n].ip})" for n in private)
    return (
        f"warning: NCCL_SOCKET_IFNAME={chosen or '(unset)'} lets NCCL pick {others}, a private "
        f"address other regions cannot reach, instead of {path} ({usable[path].ip}: {why}); "
        f"set NCCL_SOCKET_IFNAME={path} GLOO_SOCKET_IFNAME={path}"
    )


ALLOW_PUBLIC = "PM_ALLOW_PUBLIC_NETWORK"
"""Set to 1 to run a job of several nodes on public addresses anyway."""


def route_source(destination: str) -> str | None:
    """The local address the kernel would send from toward ``destination`` (IPv4 or IPv6; no
    packet sent)."""
    family = socket.AF_INET6 if ":" in destination else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((destination, 9))
        except OSError:
            return None
        return s.getsockname()[0].split("%", 1)[0]


def _resolve(host: str) -> list[str]:
    """Every address ``host`` resolves to (IPv4 and IPv6; none: it does not resolve)."""
    try:
        return sorted({info[4][0].split("%", 1)[0] for info in socket.getaddrinfo(host, None)})
    except socket.gaierror:
        return []


def _chosen_interfaces(key: str, value: str, interfaces: Mapping[str, ipaddress.IPv4Interface]):
    """The interfaces ``key = value`` picks among this node's: ``GLOO_SOCKET_IFNAME`` names
    them exactly (comma-separated), ``NCCL_SOCKET_IFNAME`` by prefix unless it starts with
    ``=`` (exact); a ``^`` list excludes and picks nothing here."""
    if not value or value.startswith("^"):
        return []
    exact = key == "GLOO_SOCKET_IFNAME" or value.startswith("=")
    names = [n for n in value.lstrip("=").split(",") if n]
    return [i for i in interfaces if any(i == n if exact else i.startswith(n) for n in names)]


def public_address_problem(env: Mapping[str, str] = os.environ) -> str | None:
    """One line when a job of several nodes would run on a public address, else None: the
    job's sockets are unauthenticated and unencrypted, so ``MASTER_ADDR``, ``LOCAL_ADDR`` and
    the addresses this node's sockets use (the interfaces ``GLOO_SOCKET_IFNAME`` and
    ``NCCL_SOCKET_IFNAME`` pick, and, for a key that picks none, the kernel's route toward
    ``MASTER_ADDR``) must not be public (IPv4 or IPv6) unless ``PM_ALLOW_PUBLIC_NETWORK=1``
    says the risk is accepted."""
    if int(env.get("NNODES", "1") or 1) < 2 or env.get(ALLOW_PUBLIC) == "1":
        return None
    master = env.get("MASTER_ADDR", "")
    master_ips = _resolve(master) if master else []
    found = [(f"MASTER_ADDR = {master}", ip, "hosts the rendezvous store") for ip in master_ips]
    if env.get("LOCAL_ADDR"):
        found += [(f"LOCAL_ADDR = {env['LOCAL_ADDR']}", ip, "announces the workers' store")
                  for ip in _resolve(env["LOCAL_ADDR"])]  # fmt: skip
    interfaces = ipv4_interfaces()
    routed = False
    for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        chosen = _chosen_interfaces(key, env.get(key, ""), interfaces)
        found += [(f"{key} = {env[key]} ({name}: {interfaces[name].ip})", str(interfaces[name].ip),
                   "carries the pipeline traffic") for name in chosen]  # fmt: skip
        routed = routed or not chosen
    if routed:
        for ip in master_ips:
            source = route_source(ip)
            if source:
                found.append((f"this node's route to MASTER_ADDR (from {source})", source,
                              "carries the pipeline traffic"))  # fmt: skip
    for what, address, role in found:
        if ipaddress.ip_address(address).is_global:
            return (f"{what} is a public address ({address}) and {role}: the job's sockets "
                    "(the c10d store, gloo, NCCL, pickled objects) are unauthenticated and "
                    "unencrypted, so anyone who reaches them can join or feed the job; join the "
                    "nodes in a private overlay first (python -m protocol_models.overlay; "
                    "docs/multinode.md#0-one-private-network) and use its addresses, or set "
                    f"{ALLOW_PUBLIC}=1 to run on public addresses anyway")  # fmt: skip
    return None
