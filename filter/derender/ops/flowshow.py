"""``derender queue show``: flow control's state as the filter's metrics port tells it (every
worker's, summed): requests waiting by band and key, what became of the requests so far, how long
they waited, and each backend's estimated load against its capacity."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def show(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read(32 << 20).decode("utf-8", "replace")
    waiting: dict[tuple[str, str], float] = {}
    outcomes: dict[str, float] = {}
    waited: dict[str, tuple[float, float]] = {}
    load: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "derender_queue_waiting_requests" and sample.value:
                where = (labels.get("band", ""), labels.get("key", ""))
                waiting[where] = waiting.get(where, 0) + sample.value
            elif sample.name == "derender_flow_requests_total":
                outcomes[labels["outcome"]] = outcomes.get(labels["outcome"], 0) + sample.value
            elif sample.name in ("derender_queue_wait_seconds_sum", "derender_queue_wait_seconds_count"):
                total, count = waited.get(labels["outcome"], (0.0, 0.0))
                if sample.name.endswith("_sum"):
                    total += sample.value
                else:
                    count += sample.value
                waited[labels["outcome"]] = (total, count)
            elif sample.name == "derender_backend_load":
                load.setdefault(labels["cluster"], {})[labels["what"]] = sample.value
    lines = ["waiting now:" if waiting else "waiting now: nothing"]
    for (band, key), count in sorted(waiting.items(), key=lambda item: (int(item[0][0] or 0), item[0][1])):
        lines.append(f"  band {band}  key {key}: {count:.0f}")
    lines.append("requests so far: " + (", ".join(f"{k} {v:.0f}" for k, v in sorted(outcomes.items())) or "none"))
    for outcome, (total, count) in sorted(waited.items()):
        if count:
            lines.append(f"  {outcome}: waited {total / count:.2f} s on average ({count:.0f})")
    for cluster, values in sorted(load.items()):
        lines.append(f"backend {cluster}: load {values.get('load', 0):.0f} of capacity {values.get('capacity', 0):.0f}")
    return "\n".join(lines)
