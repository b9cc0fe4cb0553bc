"""Disaggregated prefill as the simulator models it (``--kv-role prefill|decode|both``).

A prefill producer answers a request with ``kv_transfer_params: {"do_remote_decode": true}`` by naming
where the prompt's KV blocks wait, the fields vLLM's NIXL connector returns (``remote_engine_id``,
``remote_request_id``, ``remote_block_ids``, ``remote_host``, ``remote_port``, ``tp_size``, with
``do_remote_prefill: true``), and holds them (here: the prompt) until a decode producer takes them, or
for ``HOLD_S`` seconds. A decode producer given those params asks the named simulator for the blocks
(``GET /sim/kv/{request id}``, which hands them over once): if it holds them for this very prompt, the
decode skips its modelled prefill; otherwise it prefills itself, as vLLM's connector falls back, and
``/sim/stats`` counts which.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections import OrderedDict

import aiohttp
from aiohttp import web

ROLES = ("both", "prefill", "decode")
HOLD_S = 60.0  # a prefill's blocks wait this long for their decode (vLLM's abort timeout is of this order)
MAX_HELD = 4096


def advertised(host: str) -> str:
    """The host a prefill's params name for its blocks: vLLM's NIXL side channel host
    (``VLLM_NIXL_SIDE_CHANNEL_HOST``) if set, else the address bound, else (bound to every address, as
    in a container) this machine's name, which its peers resolve."""
    named = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST")
    if named:
        return named
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


class KvHandoff:
    def __init__(self, role: str = "both", host: str = "127.0.0.1", port: int = 0, block_size: int = 16) -> None:
        if role not in ROLES:
            raise ValueError(f"--kv-role is one of {', '.join(ROLES)}")
        self.role, self.host, self.port, self.block_size = role, advertised(host), port, block_size
        self.held: OrderedDict[str, tuple[float, list[int]]] = OrderedDict()  # request id -> (when, prompt)
        self.answered = 0  # prefill answers that named their blocks
        self.remote_prefills = 0  # decodes whose KV came from a prefill producer
        self.local_prefills = 0  # decodes asked to pull that prefilled themselves
        self._session: aiohttp.ClientSession | None = None

    @property
    def engine_id(self) -> str:
        return f"derender-sim-{self.port}"

    def answer(self, body: dict, request_id: str) -> dict | None:
        """A prefill producer's ``kv_transfer_params`` for ``body``, or None."""
        asked = body.get("kv_transfer_params")
        if self.role == "decode" or not isinstance(asked, dict) or not asked.get("do_remote_decode"):
            return None
        prompt = list(body.get("token_ids") or ())
        now = time.monotonic()
        self.held[request_id] = (now, prompt)
        while self.held and (len(self.held) > MAX_HELD or next(iter(self.held.values()))[0] < now - HOLD_S):
            self.held.popitem(last=False)
        self.answered += 1
        return {  # the fields of vLLM 0.33's NixlConnector (pull mode), in its order
            "do_remote_prefill": True,
            "do_remote_decode": False,
            # one list per KV cache group (the simulated model has one, full attention), as vLLM nests them
            "remote_block_ids": [list(range((len(prompt) + self.block_size - 1) // self.block_size))],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": len(prompt),
            "remote_blocks_expiry_time": time.perf_counter() + HOLD_S,
            "remote_registration_generation": 0,
            "transfer_mode": "pull",
        }

    async def pulled(self, body: dict) -> bool:
        """Whether a decode request's KV came from the prefill producer its params name (False: it
        prefills itself); a request that does not ask to pull is not counted."""
        params = body.get("kv_transfer_params")
        if self.role == "prefill" or not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return False
        host, port, request_id = params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id")
        got = False
        if isinstance(host, str) and isinstance(port, int) and isinstance(request_id, str):
            if self._session is None:
                self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
            try:
                async with self._session.get(f"http://{host}:{port}/sim/kv/{request_id}") as response:
                    got = response.status == 200 and (await response.json()) == list(body.get("token_ids") or ())
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                got = False
        if got:
            self.remote_prefills += 1
        else:
            self.local_prefills += 1
        return got

    async def take(self, request: web.Request) -> web.Response:
        """GET /sim/kv/{request id}: the held prompt, handed over once (404 if not held)."""
        held = self.held.pop(request.match_info["request_id"], None)
        if held is None or held[0] < time.monotonic() - HOLD_S:
            return web.json_response({"error": "not held"}, status=404)
        return web.json_response(held[1])

    def stats(self) -> dict:
        return {
            "role": self.role,
            "held": len(self.held),
            "answered": self.answered,
            "remote_prefills": self.remote_prefills,
            "local_prefills": self.local_prefills,
        }

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
