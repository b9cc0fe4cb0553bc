"""Where the ext_proc port listens: ``--host``'s addresses, a network standing for this machine's own
address in it (a container's address on one of its networks, as the compose stack binds it)."""

from __future__ import annotations

import ipaddress
import socket


def listen_hosts(spec: str) -> list[str]:
    """``--host``: addresses, comma-separated; a network (``172.30.90.0/24``) stands for this
    machine's own addresses in it (a container's on one of its networks, whatever its address)."""
    hosts: list[str] = []
    for item in (part.strip() for part in spec.split(",")):
        if "/" not in item:
            hosts.append(item)
            continue
        import psutil  # vLLM's dependency too

        network = ipaddress.ip_network(item, strict=False)
        found = [a.address.split("%")[0] for addresses in psutil.net_if_addrs().values() for a in addresses
                 if a.family in (socket.AF_INET, socket.AF_INET6)
                 and ipaddress.ip_address(a.address.split("%")[0]) in network]
        if not found:
            raise OSError(f"--host {item}: this machine has no address in {network}")
        hosts += found
    return hosts


def address(spec: str) -> str:
    """``HOST:PORT`` with HOST as ``--host`` takes it (a network: this machine's first address in it)."""
    host, _, port = spec.rpartition(":")
    first = listen_hosts(host)[0]
    return f"[{first}]:{port}" if ":" in first else f"{first}:{port}"
