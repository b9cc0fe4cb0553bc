"""The ext_proc port's listener as ``serve``'s flags give it: where it listens (``--host``'s
addresses, a network standing for this machine's own address in it, as the compose stack binds
it), its bounds (``http2.Limits``) and TLS. Light to import: the command line reads it first."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _limits():
    from .http2 import Limits

    return Limits()


@dataclass(frozen=True)
class Listener:
    """The ext_proc port's bounds and TLS: ``limits`` (``http2.Limits``; grpc.aio gets the ones it has),
    and with ``tls_cert`` / ``tls_key`` TLS, with ``tls_client_ca`` client certificates required (mTLS)."""

    limits: Any = field(default_factory=_limits)  # an http2.Limits
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # ``--uds``: a Unix socket listening beside the TCP port (``bind_unix``), bound before the workers
    # fork so that every worker accepts on it; ``tcp`` False (``--no-tcp``): no TCP port.
    unix: socket.socket | None = None
    tcp: bool = True

    def grpc_options(self) -> list[tuple[str, int]]:
        limits = self.limits
        return [
            ("grpc.max_receive_message_length", limits.max_message),
            ("grpc.max_send_message_length", limits.max_message),
            ("grpc.max_concurrent_streams", limits.max_concurrent_streams),
            ("grpc.max_metadata_size", limits.max_header_list),
            ("grpc.max_connection_idle_ms", int(limits.idle_timeout * 1000)),
            ("grpc.keepalive_time_ms", int(limits.keepalive_time * 1000)),
            ("grpc.keepalive_timeout_ms", int(limits.keepalive_timeout * 1000)),
        ]

    def grpc_credentials(self):
        """grpc.aio's server credentials for the TLS files, or None."""
        if not self.tls_cert:
            return None
        import grpc

        ca = Path(self.tls_client_ca).read_bytes() if self.tls_client_ca else None
        pair = (Path(self.tls_key).read_bytes(), Path(self.tls_cert).read_bytes())
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


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
        found = [
            a.address.split("%")[0]
            for addresses in psutil.net_if_addrs().values()
            for a in addresses
            if a.family in (socket.AF_INET, socket.AF_INET6)
            and ipaddress.ip_address(a.address.split("%")[0]) in network
        ]
        if not found:
            raise OSError(f"--host {item}: this machine has no address in {network}")
        hosts += found
    return hosts


def hostport(host: str, port: int | str) -> str:
    """``HOST:PORT``, an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def address(spec: str) -> str:
    """``HOST:PORT`` with HOST as ``--host`` takes it (a network: this machine's first address in it)."""
    host, _, port = spec.rpartition(":")
    return hostport(listen_hosts(host)[0], port)


UNIX_PATH_MAX = 107  # sun_path's bytes on Linux, less the closing NUL


def bind_unix(path: str) -> socket.socket:
    """``--uds``: a listening Unix socket at ``path`` that only this user can connect to (mode 0600),
    in place of a stale one a stopped filter left; anything else at ``path`` is refused (OSError)."""
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise OSError(f"--uds {path}: longer than a Unix socket's {UNIX_PATH_MAX} bytes")
    if os.path.lexists(path):
        import stat

        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(f"--uds {path}: something other than a socket is there")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)  # nobody listens: a stopped filter's
        else:
            raise OSError(f"--uds {path}: another process listens there")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mask = os.umask(0o177)  # created 0600: no moment when another user could connect
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(mask)
    sock.listen(1024)
    sock.setblocking(False)
    _bound[sock] = (path, os.stat(path).st_ino)
    return sock


# a socket bind_unix made -> its path and the inode of its file there (the server closes the socket)
_bound: dict[socket.socket, tuple[str, int]] = {}


def unbind_unix(sock: socket.socket) -> None:
    """The socket's file removed as the server stops, if it is still this socket's (not a newer filter's)."""
    path, made = _bound.pop(sock, ("", -1))
    try:
        if path and os.stat(path).st_ino == made:
            os.unlink(path)
    except OSError:
        pass
    sock.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ext_proc port's bounds and TLS (docs/operations.md, "The ext_proc port")."""
    parser.add_argument(
        "--uds",
        default=os.environ.get("DERENDER_UDS") or None,
        metavar="PATH",
        help="also serve ext_proc on a Unix socket at PATH (mode 0600: only this user can connect, where "
        "loopback TCP admits any local process), for an Envoy on the same host (default $DERENDER_UDS; "
        "derender up uses one)",
    )
    parser.add_argument(
        "--no-tcp",
        action="store_true",
        help="with --uds: the Unix socket alone, no TCP port (derender up's filters: only its user reaches them)",
    )
    parser.add_argument(
        "--max-concurrent-streams",
        type=int,
        default=100,
        help="ext_proc streams per HTTP/2 connection (SETTINGS_MAX_CONCURRENT_STREAMS; past it "
        "REFUSED_STREAM; Envoy's ext_proc clusters in envoy/ open at most 64; default 100)",
    )
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        default=None,
        help="largest ext_proc message taken (RESOURCE_EXHAUSTED past it, before any of it is kept; "
        "default: Envoy's body buffer, the larger of 16 MiB and --max-producer-body-bytes, plus 1 MiB)",
    )
    parser.add_argument(
        "--ext-proc-idle-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="an ext_proc connection with no stream this long is closed with GOAWAY (default 300)",
    )
    parser.add_argument(
        "--max-ext-proc-connections",
        type=int,
        default=2048,
        help="ext_proc connections a worker holds at once; past it a new one is closed (default 2048)",
    )
    parser.add_argument(
        "--tls-cert",
        default=os.environ.get("DERENDER_TLS_CERT") or None,
        metavar="FILE",
        help="serve the ext_proc port over TLS with this certificate (PEM; with --tls-key; default $DERENDER_TLS_CERT)",
    )
    parser.add_argument(
        "--tls-key",
        default=os.environ.get("DERENDER_TLS_KEY") or None,
        metavar="FILE",
        help="the certificate's private key (PEM; default $DERENDER_TLS_KEY)",
    )
    parser.add_argument(
        "--tls-client-ca",
        default=os.environ.get("DERENDER_TLS_CLIENT_CA") or None,
        metavar="FILE",
        help="require a client certificate signed by this CA (mTLS; PEM; default $DERENDER_TLS_CLIENT_CA)",
    )


def listener(args: argparse.Namespace, unix: socket.socket | None = None):
    """The ext_proc port's bounds and TLS, from ``serve``'s flags; ``unix``: the socket ``bind_unix``
    bound for ``--uds``."""
    from .http2 import Limits

    defaults = Limits()
    body = max(16 << 20, getattr(args, "max_producer_body_bytes", 16 << 20))
    message = args.max_message_bytes or body + (1 << 20)  # Envoy's body buffer, plus the message's framing
    buffered = max(defaults.max_buffered, message + 5)
    limits = Limits(
        max_concurrent_streams=args.max_concurrent_streams,
        max_message=message,
        max_buffered=buffered,
        max_buffered_total=max(defaults.max_buffered_total, buffered),
        idle_timeout=args.ext_proc_idle_timeout,
        max_connections=args.max_ext_proc_connections,
    )
    # --no-tcp comes only with --uds (check_arguments)
    return Listener(limits, args.tls_cert, args.tls_key, args.tls_client_ca, unix, not args.no_tcp)


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``serve``'s listener flags, checked before anything loads."""
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        parser.error("--tls-client-ca needs --tls-cert and --tls-key")
    for flag in ("tls_cert", "tls_key", "tls_client_ca"):
        path = getattr(args, flag)
        if path and not os.path.isfile(path):
            parser.error(f"--{flag.replace('_', '-')}: no such file: {path}")
    if args.uds and getattr(args, "transport", "http2") != "http2":
        parser.error("--uds needs the filter's own transport (--transport http2)")
    if args.no_tcp and not args.uds:
        parser.error("--no-tcp needs --uds: the filter would listen nowhere")
    if args.max_concurrent_streams < 1 or args.max_ext_proc_connections < 1:
        parser.error("--max-concurrent-streams and --max-ext-proc-connections must be at least 1")
