"""``--routing kv-events``: each request to the replica whose prefix cache holds the longest run of the
prompt's exact blocks, as the replicas' own KV cache events say (``kvfeed``, ``kvindex``).

The prompt's blocks are keyed as the index keys them (``kvnames``): a plain prompt's by Python's
chain of its blocks, any other by vLLM's (``prefix.BlockHasher``: ``hash_block_tokens``, the cache
salt, LoRA adapter and images as vLLM keys them), in vLLM's external form. The replica with the
longest match is chosen unless it has more requests in flight than ``bound`` times the mean
(counting this one; the process's workers' requests, as its hub reports them, ``kvhub``); ties go to
the fewest in flight, then to a hash of the prefix key and the replica's name (the same in every
process). No match, or the bound: Envoy's consistent hash on the prefix key decides, as in
``prefix`` mode. Every filter process reads the same events (its hub once for its workers), so all
decide alike without a shared store (only their in-flight counts differ).

Endpoints: ``--kv-events`` names each producer's PUB socket, in the order of ``--producer``'s URLs:
``tcp://HOST:PORT``, or ``:PORT`` for the producer URL's own host; ``--kv-events-replay`` its replay
socket the same way (optional; without it a gap is not filled). A producer's ``replica`` name is its
URL's ``IP:PORT`` (a host name resolved once, at start), as Envoy names the replica it reached.
"""

from __future__ import annotations

import hashlib
import socket
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

from vllm.v1.core.kv_cache_utils import hash_block_tokens

from ..ops import kvmetrics as metrics
from .kvclient import HubClient
from .kvfeed import Feed, FeedSpec, Standing
from .kvindex import LEFT, KvIndex, external
from .kvnames import PLAIN, PLAIN_SEED, Namer, python_chain
from .prefix import BlockHasher, Media, extra_keys


def replica_of(url: str) -> str:
    """``IP:PORT`` of a producer URL, as Envoy's upstream address names it."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        ip = str(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0])
    except OSError:
        ip = host
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _endpoint(item: str, url: str) -> str:
    item = item.strip()
    if item.startswith(":"):
        host = urlsplit(url if "://" in url else f"http://{url}").hostname or "127.0.0.1"
        return f"tcp://{host}{item}"
    if not item.startswith(("tcp://", "ipc://")):
        raise ValueError(f"a KV events endpoint is tcp://HOST:PORT, ipc://PATH or :PORT, not {item!r}")
    return item


def feed_specs(
    urls: Sequence[str], events: Sequence[str], replays: Sequence[str] = (), topic: str = ""
) -> list[FeedSpec]:
    """One ``FeedSpec`` per producer URL (``events`` and ``replays`` in their order; one ``:PORT`` item
    stands for every producer)."""
    if not events:
        raise ValueError("kv-events routing needs each producer's events endpoint (--kv-events)")
    events = list(events) * len(urls) if len(events) == 1 and events[0].strip().startswith(":") else list(events)
    replays = list(replays) * len(urls) if len(replays) == 1 and replays[0].strip().startswith(":") else list(replays)
    if len(events) != len(urls) or (replays and len(replays) != len(urls)):
        raise ValueError(f"{len(urls)} producer URLs need as many KV events endpoints (and replay endpoints, if any)")
    return [
        FeedSpec(replica_of(url), _endpoint(e, url), _endpoint(replays[i], url) if replays else None, topic)
        for i, (url, e) in enumerate(zip(urls, events, strict=True))
    ]


def tie(key: str | None, replica: str) -> int:
    """The same order of tied replicas in every process (Python's own hash is salted per process)."""
    return int.from_bytes(hashlib.blake2b(f"{key}|{replica}".encode(), digest_size=8).digest(), "big")


class KvRouting:
    """One model's KV-event view in one worker process: the index, a feed per replica."""

    MEMO = 1 << 18  # blocks whose vLLM hash is remembered (per process); cleared when full

    def __init__(
        self,
        hasher: BlockHasher,
        specs: Sequence[FeedSpec],
        max_blocks: int = 1 << 20,
        predict_s: float = 2.0,
        chain_blocks: int = 1024,
        stale_s: float = 30.0,
        hub: str | None = None,
    ) -> None:
        self.hasher = hasher
        self.specs = list(specs)
        self.index = KvIndex(max_blocks, predict_s)
        self.namer = Namer(hasher.block_size, max_blocks)
        self.stale_s = stale_s
        self.hub = hub  # a hub's socket (``kvhub``): its events relayed from there; None: its own feeds
        self.client: HubClient | None = None
        self.feeds: dict[str, Feed | Standing] = {}
        if hub is None:
            self.read_feeds()
        else:
            self.feeds = {spec.replica: Standing(spec.replica, self, stale_s) for spec in specs}
        self.chain_blocks = chain_blocks
        self._memo: dict[int, tuple] = {}  # python_chain's name of a block -> (vLLM's hash, its external form)
        # Requests in flight: this worker's per replica (its ``Balancer``'s, reported to the hub), and
        # the sum of the other workers' (relayed by the hub; updated in place).
        self.in_flight: dict[str, int] = {}
        self.others: dict[str, int] = {}
        self._applied: dict[str, object] = {}  # replica -> its worker-side batches counter, bound once
        self._size = metrics.kv_index_gauge()

    def read_feeds(self) -> dict[str, Feed]:
        """This process subscribes to every replica itself (no hub, or the hub is gone)."""
        feeds = {
            spec.replica: Feed(spec, self, stale_s=self.stale_s, block_size=self.hasher.block_size)
            for spec in self.specs
        }
        self.feeds = dict(feeds)
        return feeds

    def start(self) -> None:
        if self.hub is not None:
            self.client = HubClient(self.hub, self)
            self.client.start()
            return
        for feed in self.feeds.values():
            feed.start()  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.stop()
        for feed in list(self.feeds.values()):
            if isinstance(feed, Feed):
                await feed.stop()

    # -- the events (``kvfeed.Sink``) ------------------------------------------------------------------
    @property
    def entries(self) -> int:
        return self.index.entries

    def apply(self, replica: str, events: list) -> None:
        """One batch of a replica's events, read by this process's own feed."""
        self.index.apply_ops(replica, self.namer.ops(events))
        self._count(replica)

    def cleared(self, replica: str) -> None:
        self.index.cleared(replica)

    def left(self, replica: str) -> None:
        self.index.cleared(replica)

    def relayed(self, batches: list) -> None:
        """Batches the hub relays (``kvhub.Relay``): ``(replica, ops, batches)``, each op ``(STORED,
        keys)``, ``(REMOVED, keys)``, ``(CLEARED,)`` or ``(LEFT,)``, the blocks keyed as ``Namer`` keys
        them."""
        index, feeds = self.index, self.feeds
        counts: dict[str, int] = {}
        for replica, ops, count in batches:
            standing = feeds.get(replica)
            if standing is None:
                continue
            counts[replica] = counts.get(replica, 0) + count
            if ops and ops[0][0] == LEFT:  # (``CLEARED`` or ``LEFT`` comes first, if at all)
                standing.leave("the hub's feed left", quiet=True)
            else:
                standing.alive()
            index.apply_ops(replica, ops)
        for replica, count in counts.items():
            self._count(replica, count)

    def _count(self, replica: str, batches: int = 1) -> None:
        counter = self._applied.get(replica)
        if counter is None:
            counter = self._applied[replica] = metrics.kv_applied(replica)
        counter.inc(batches)  # type: ignore[attr-defined]
        self._size.set(self.index.entries)

    def chain(
        self, ids: Sequence[int], cache_salt: str | None, lora: tuple[str, str] | None, media: Sequence[Media]
    ) -> list[int]:
        """The index's keys of the prompt's full blocks (``Namer``), at most ``chain_blocks``: a plain
        prompt's blocks by their names; any other prompt's by vLLM's block hashes, in vLLM's external
        form.

        vLLM's chain costs ~1.5 us a block (a pickle and a sha256, even memoized per block it builds a
        key); a conversation's later turns repeat its earlier blocks. So each block is first named by
        Python's own 64-bit hash chain (C speed, ~0.2 us a block; seeded by the salt, adapter and
        images), and the vLLM hash of a block so named is remembered: only blocks never seen are hashed
        vLLM's way. Python's chain only finds what vLLM's gives; a collision of it (2^-64) could name a
        wrong block, which costs a routing hit, never an answer."""
        size = self.hasher.block_size
        full = min(len(ids) // size, self.chain_blocks)
        seed = (cache_salt, lora, tuple(media))
        if seed == PLAIN:  # keyed by their names (``Namer``), every block: the chosen replica is
            # predicted to hold them all (``started``). python_chain's loop written out here.
            out: list[int] = []
            name = PLAIN_SEED
            for block in zip(*[iter(ids[: full * size])] * size, strict=False):
                name = hash((name, block))
                out.append(name)
            return out
        names = list(python_chain(ids, size, full, hash(seed)))
        memo = self._memo
        out = []
        parent = None
        for name in names:
            known = memo.get(name)
            if known is None:
                break
            parent = known[0]
            out.append(known[1])
        if len(out) == full:
            return out
        if len(memo) > self.MEMO:
            memo.clear()
        hash_fn = self.hasher.hash_fn
        media = tuple(media)
        for i in range(len(out), full):
            start = i * size
            extra = extra_keys(start, start + size, cache_salt, lora, media)
            parent = hash_block_tokens(hash_fn, parent, tuple(ids[start : start + size]), extra)
            h = external(parent)
            memo[names[i]] = (parent, h)
            out.append(h)
        return out

    def matches(self, chain: Sequence[int]) -> dict[str, int]:
        depth = self.index.match(chain, time.monotonic())
        return {r: d for r, d in depth.items() if (feed := self.feeds.get(r)) is not None and feed.in_index}

    def started(self, replica: str, chain: Sequence[int], matched: int, blocks: int) -> None:
        """A request reached ``replica``: it holds the chain from now on (predicted until its events
        say so), and unless it already held all ``blocks`` of the prompt, its events should follow."""
        now = time.monotonic()
        # The first ``matched`` it holds already (its events said so, or an earlier prediction did).
        self.index.predict(replica, chain[matched:], now)
        feed = self.feeds.get(replica)
        if feed is not None and matched < blocks:
            feed.expect(now)
