"""Image URLs a client names: fetched by vLLM's ``MediaConnector``, only from public addresses.

vLLM's own limits apply as ``vllm serve`` sets them: ``--allowed-local-media-path``
(no local files without it), ``--allowed-media-domains``, ``VLLM_IMAGE_FETCH_TIMEOUT``
(5 s) and ``VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB``, whose default here is 20 MB instead of
vLLM's 256 (a gateway fetches for anyone who can reach it). What vLLM does not
have, the filter adds: every connection a media fetch opens, redirects included,
goes only to a globally routable address. Loopback, private, link-local,
carrier-grade NAT, multicast and reserved addresses are refused (a 400 naming the
address, nothing sent to a producer) unless an operator lists their network in
``--allowed-media-networks``. The check sits where the connection is made (after
DNS, on every address tried), so a name that resolves to a private address, a
redirect to one and DNS rebinding are all caught. Media fetches ignore proxy
variables (an egress proxy would hide the address that matters). A file URL outside
``--allowed-local-media-path`` is a 400 here (vLLM answers it with a 500).
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any

from . import vllm_seams

DEFAULT_MAX_MEDIA_MB = "20"
os.environ.setdefault("VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB", DEFAULT_MAX_MEDIA_MB)

_allowed: list[Any] = []  # ipaddress networks an operator allows besides the global ones
_installed = False


def allowed(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global or any(ip in network for network in _allowed)


def install(networks: tuple[str, ...] | list[str] = ()) -> None:
    """Guard vLLM's media connection in this process; ``networks`` (CIDRs) are allowed besides."""
    global _installed
    for network in networks:
        parsed = ipaddress.ip_network(network, strict=False)
        if parsed not in _allowed:
            _allowed.append(parsed)
    if _installed:
        return
    import aiohttp
    from vllm.connections import global_http_connection
    from vllm.exceptions import VLLMValidationError

    class ForbiddenAddress(VLLMValidationError):
        pass

    class GuardedConnector(aiohttp.TCPConnector):
        async def _resolve_host(self, host: str, port: int, traces: Any = None) -> list[Any]:
            hosts = await super()._resolve_host(host, port, traces=traces)
            refused = [h["host"] for h in hosts if not allowed(h["host"])]
            if refused:
                raise ForbiddenAddress(
                    f"Media URL host {host!r} resolves to {refused[0]}, an address this gateway does not fetch "
                    "from (loopback, private, link-local or reserved; see --allowed-media-networks)",
                    parameter="image_url",
                    value=host,
                )
            return hosts

    load_file_url = vllm_seams.media_file_loader()

    def _load_file_url(self: Any, url_spec: Any, media_io: Any) -> Any:
        """vLLM refuses a file URL outside --allowed-local-media-path with a RuntimeError (a 500): the
        client named a forbidden URL, a 400."""
        try:
            return load_file_url(self, url_spec, media_io)
        except RuntimeError as exc:
            raise VLLMValidationError(str(exc), parameter="image_url") from None

    vllm_seams.set_media_file_loader(_load_file_url)
    connection = global_http_connection

    async def get_async_client() -> aiohttp.ClientSession:
        client = vllm_seams.http_client(connection)
        if client is None or client.closed:
            client = aiohttp.ClientSession(connector=GuardedConnector(), trust_env=False)
            vllm_seams.set_http_client(connection, client)
        return client

    def get_sync_client() -> Any:
        raise VLLMValidationError("media URLs are fetched asynchronously only", parameter="image_url")

    connection.get_async_client = get_async_client  # type: ignore[method-assign]
    connection.get_sync_client = get_sync_client  # type: ignore[method-assign]
    _installed = True
