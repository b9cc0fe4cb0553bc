"""Which producer replica a request goes to: ``--routing least-request|prefix|precise``.

The filter holds every prompt's token ids, so it can say, before Envoy picks a
replica, which prompts share a prefix that vLLM's prefix cache can reuse:

- ``least-request``: nothing is said; the producer cluster balances by least request.
- ``prefix``: the request gets ``KEY_HEADER``, the routing key of ``PrefixKey`` (the
  chain hash of the first turn's blocks); the cluster balances by consistent hashing
  on it (``ring_hash`` with a ``hash_balance_factor`` bound). Stateless: every worker
  and every filter replica sends a conversation to the same producer replica.
- ``precise``: the same header, and the filter also remembers which replica last
  served what lies beyond a key (Envoy names the replica in ``UPSTREAM_HEADER``). A
  request that extends what a replica is known to hold goes there (``Decision.chosen``:
  the filter hands it to Envoy as dynamic metadata ``envoy.lb`` / ``ENDPOINT_KEY``, the
  Gateway API Inference Extension's names, read by Envoy's ``override_host`` load
  balancing; a client cannot send metadata), unless that replica has more requests of this
  process in flight than ``bound`` times the mean, counting this one (no rounding up:
  this worker sees only its own share of the load); then, and without a match, the cluster's consistent hash on the key
  decides, as in ``prefix`` mode. The memory is per worker process: with several
  workers or filter replicas, each learns from the requests it sees, and the shared
  key keeps a conversation's first sighting in one place anyway.

Precise mode overrides the consistent hash only for a match beyond the key's own
prefix: a match on the key's prefix alone (a tenant's system prompt, the first
turn) is what the hash already spreads and sticks, and following it would pile a
tenant's conversations onto one replica. What precise adds is following a
conversation whose later turns the load bound moved, and prompts that share more
than their first turn.

Routing never changes an answer. A replica Envoy did not use when asked to (it is
down, or unhealthy) is forgotten with everything it held; it is learnt again once
Envoy sends a request there. The precise index starts where the key ends (chained to
the key) and chains Python's own 64-bit hash over stretches of ``STRIDE`` blocks (64
tokens at vLLM's default 16): a match is known to within a stretch, at ~0.6 us a
stretch on this machine where vLLM's sha256 chain costs ~2 us a block (measured in
``bench/prefix_routing.py``). Only the header key must be vLLM's.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .flow import FlowSpec
from .handoff import HandoffSpec
from .kvroute import KvRouting, feed_specs, tie
from .prefix import Media, PrefixKey

log = logging.getLogger("derender.balance")

LEAST_REQUEST, PREFIX, PRECISE, KV_EVENTS = "least-request", "prefix", "precise", "kv-events"
MODES = (LEAST_REQUEST, PREFIX, PRECISE, KV_EVENTS)
KEY_HEADER = "x-derender-prefix-key"
# Where precise routing's choice travels: Envoy dynamic metadata, never a request header.
ENDPOINT_NAMESPACE, ENDPOINT_KEY = "envoy.lb", "x-gateway-destination-endpoint"


@dataclass
class Decision:
    """What routing did for one request, for its log line and metrics."""

    mode: str
    prompt_tokens: int = 0
    key_blocks: int = 0  # leading blocks the key covers
    matched_blocks: int = 0  # precise, kv-events: blocks the chosen replica is known to hold
    chosen: str | None = None  # precise: the replica asked for (ENDPOINT_KEY)
    why: str = ""  # precise: match, bound (the match was too loaded), key (nothing known beyond the key)
    chain: list[int] | None = None
    counted: str | None = None  # the replica this request is counted in flight on
    served: str | None = None  # the replica Envoy reached
    cpu_us: float = 0.0  # this process's CPU time for the decision

    def fields(self) -> dict[str, object]:
        """For the request's log line."""
        out: dict[str, object] = {
            "replica": self.served,
            "routing": self.mode,
            "prefix_blocks": self.key_blocks,
            "routing_us": round(self.cpu_us, 1),
        }
        if self.mode in (PRECISE, KV_EVENTS):
            out["route"] = self.why
            out["matched_blocks"] = self.matched_blocks
        return out


def block_chain(ids: Sequence[int], size: int, seed: object = None) -> list[int]:
    """One 64-bit id per full stretch of ``size`` tokens, each chaining its parent's, the first
    chained to ``seed`` (the precise index)."""
    full = len(ids) // size * size
    parent = hash(seed)
    out: list[int] = []
    append = out.append
    for block in map(hash, zip(*[iter(ids[:full])] * size, strict=False)):
        parent = hash((parent, block))
        append(parent)
    return out


class Balancer:
    """The routing of one model's requests in one worker process."""

    REMEMBER = 1 << 18  # stretch ids remembered; the oldest tenth is dropped when full
    STRIDE = 4  # blocks per stretch of the precise index

    def __init__(self, mode: str, key: PrefixKey, bound: float = 1.25, kv: KvRouting | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"routing must be one of {', '.join(MODES)}")
        if (mode == KV_EVENTS) != (kv is not None):
            raise ValueError("kv-events routing needs the replicas' events (and only it uses them)")
        self.mode = mode
        self.prefix_key = key
        self.bound = bound
        self.owners: dict[int, str] = {}  # block id -> the replica that last served it
        self.in_flight: dict[str, int] = {}  # known replicas -> this process's requests there
        self.kv = kv
        self.others: dict[str, int] = {}  # kv-events: the other workers' requests in flight (their hub's word)
        if kv is not None:
            self.in_flight = dict.fromkeys(kv.feeds, 0)
            kv.in_flight = self.in_flight  # reported to the hub, which tells the other workers
            self.others = kv.others

    def route(
        self,
        ids: Sequence[int] | None,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        media: Sequence[Media] = (),
    ) -> tuple[dict[str, str], Decision]:
        """The headers that route this prompt, and the decision to report back (its ``chosen``:
        the replica precise routing asks Envoy for, if any)."""
        decision = Decision(self.mode, prompt_tokens=len(ids or ()))
        if self.mode == LEAST_REQUEST or not ids:
            return {}, decision
        key, covered = self.prefix_key.key(ids, cache_salt, lora, media)
        size = self.prefix_key.hasher.block_size
        decision.key_blocks = covered // size
        headers = {KEY_HEADER: key} if key else {}
        if self.mode == KV_EVENTS:
            self._kv_route(decision, ids, key, cache_salt, lora, media)
        elif self.mode == PRECISE:
            # The index starts where the key ends: what lies within the key, the hash places.
            decision.chain = block_chain(ids[covered:], size * self.STRIDE, key)
            best, depth = self._longest(decision.chain)
            depth = (covered + depth * size * self.STRIDE) // size
            if best is None:
                decision.why = "key"  # nothing known beyond what the key's hash places
            elif self._over_bound(best):
                decision.why = "bound"
            else:
                decision.why, decision.chosen, decision.matched_blocks = "match", best, depth
                self._count(decision, best)
        return headers, decision

    def _kv_route(
        self,
        decision: Decision,
        ids: Sequence[int],
        key: str | None,
        cache_salt: str | None,
        lora: tuple[str, str] | None,
        media: Sequence[Media],
    ) -> None:
        """The replica holding the longest run of the prompt's blocks, unless it is too loaded."""
        assert self.kv is not None
        decision.chain = chain = self.kv.chain(ids, cache_salt, lora, media)
        depth = self.kv.matches(chain)
        if not depth:
            decision.why = "key"
            return
        in_flight, others = self.in_flight, self.others
        order = {r: (-d, in_flight.get(r, 0) + others.get(r, 0)) for r, d in depth.items()}
        best = min(order, key=order.__getitem__)
        if sum(1 for o in order.values() if o == order[best]) > 1:  # a tie: the same order in every process
            best = min(order, key=lambda r: (*order[r], tie(key, r)))
        if self._over_bound(best):
            decision.why = "bound"
            return
        decision.why, decision.chosen, decision.matched_blocks = "match", best, depth[best]
        self._count(decision, best)

    def _over_bound(self, replica: str) -> bool:
        """One more request would put more requests on ``replica`` than ``bound`` times the mean over
        the known replicas, counting this one: this process's requests in flight, and in kv-events mode
        its sibling workers' too, as their hub last reported them. precise does not round up (its
        balance went past 1.3 max/mean when it did); kv-events does: several filter processes each
        see only their share of the requests, and 1.5x a small mean left a fifth of two processes'
        decisions to the key's hash."""
        in_flight, others = self.in_flight, self.others
        mine = in_flight.get(replica, 0) + 1
        total = sum(in_flight.values()) + 1
        if others:
            mine += others.get(replica, 0)
            total += sum(others.values())
        allowed = self.bound * total / max(1, len(in_flight))
        if self.kv is not None:  # kv-events rounds up (a filter process of several sees only its share)
            allowed = math.ceil(allowed)
        return mine > max(1.0, allowed)

    def _longest(self, chain: list[int]) -> tuple[str | None, int]:
        """The live replica that last served the longest leading run of ``chain``, and its length."""
        best, depth = None, 0
        owners, live = self.owners, self.in_flight
        for i, block in enumerate(chain):
            owner = owners.get(block)
            if owner is None or owner not in live:
                break
            best, depth = owner, i + 1
        return best, depth

    def _count(self, decision: Decision, replica: str | None) -> None:
        if decision.counted == replica:
            return
        if decision.counted is not None and decision.counted in self.in_flight:
            self.in_flight[decision.counted] -= 1
        decision.counted = replica
        if replica is not None:
            self.in_flight[replica] = self.in_flight.get(replica, 0) + 1

    def started(self, decision: Decision, upstream: str | None, status: int) -> None:
        """The producer's response started (``upstream``: the replica Envoy reached)."""
        decision.served = upstream
        if self.mode == KV_EVENTS:
            self._count(decision, upstream if upstream is not None and status == 200 else None)
            if self.kv is not None and upstream is not None and status == 200:
                matched = decision.matched_blocks if upstream == decision.chosen else 0
                size = self.prefix_key.hasher.block_size
                self.kv.started(upstream, decision.chain or [], matched, decision.prompt_tokens // size)
            return
        if self.mode != PRECISE:
            return
        if decision.chosen is not None and upstream != decision.chosen:
            self.forget(decision.chosen, f"Envoy sent a request for it to {upstream or 'none'} (status {status})")
        if upstream is None or status != 200:
            self._count(decision, None)
            return
        self._count(decision, upstream)
        if decision.chain:
            owners = self.owners
            for block in decision.chain:
                owners[block] = upstream
            if len(owners) > self.REMEMBER:
                for old in list(itertools.islice(owners, len(owners) // 10)):
                    del owners[old]

    def finished(self, decision: Decision) -> None:
        """The exchange is over: no longer in flight."""
        if self.mode in (PRECISE, KV_EVENTS):
            self._count(decision, None)

    def forget(self, replica: str, why: str) -> None:
        if self.in_flight.pop(replica, None) is not None:
            log.warning("precise routing: replica %s forgotten with its cached prefixes (%s)", replica, why)


@dataclass(frozen=True)
class RoutingSpec:
    """``--routing`` and its knobs, for every model (a config file entry may name its own mode)."""

    mode: str = LEAST_REQUEST
    block_size: int = 16  # --prefix-block-size: vLLM's prefix-cache block size
    hash_algo: str = "sha256"  # --prefix-caching-hash-algo, as the producers run
    bound: float = 1.25  # precise: a matched replica's share of requests in flight, over the mean
    # kv-events: the same, looser: the events say what a replica holds, where precise guesses
    # (bench/prefix_routing.py: 1.25 left 11 % of the decisions to the key's hash, 1.5 about 1 %)
    kv_bound: float = 1.5
    key_blocks: int = 256  # --prefix-key-blocks: the most blocks a key covers
    kv_events: tuple[str, ...] = ()  # --kv-events: each producer's events endpoint (kvroute)
    kv_events_replay: tuple[str, ...] = ()  # --kv-events-replay
    kv_events_topic: str = ""  # --kv-events-topic
    kv_hub: str | None = None  # the process's hub of KV events (``kvhub``), or each worker reads them itself
    flow: FlowSpec = field(default_factory=FlowSpec)  # --replica-capacity and the queue's flags (flow control)
    handoff: HandoffSpec = field(default_factory=HandoffSpec)  # --prefill and its flags (prefill/decode)

    def balancer(
        self,
        tokenizer: object | None,
        mode: str | None = None,
        producer_urls: Sequence[str] = (),
        kv_events: Sequence[str] | None = None,
        kv_events_replay: Sequence[str] | None = None,
    ) -> Balancer | None:
        """A ``Balancer`` for one model (its tokenizer finds the first answer's header), or None;
        kv-events routing subscribes to ``producer_urls``' events (``kv_events``: a config entry's
        own endpoints, else the flags')."""
        mode = mode or self.mode
        if mode == LEAST_REQUEST:
            return None
        from .prefix import BlockHasher, answer_marker

        marker = answer_marker(tokenizer) if tokenizer is not None else ()
        hasher = BlockHasher(self.block_size, self.hash_algo)
        kv = None
        if mode == KV_EVENTS:
            specs = feed_specs(
                producer_urls,
                kv_events or self.kv_events,
                kv_events_replay or self.kv_events_replay,
                self.kv_events_topic,
            )
            kv = KvRouting(hasher, specs, hub=self.kv_hub)
        bound = self.kv_bound if mode == KV_EVENTS else self.bound
        return Balancer(mode, PrefixKey(hasher, marker, self.key_blocks), bound, kv)
