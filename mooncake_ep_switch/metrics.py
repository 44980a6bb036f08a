"""Export `Buffer.stats()` as metrics: plain samples always, a Prometheus collector when `prometheus_client`
is installed (an optional extra: nothing here imports it until a collector is made).

`stats_samples(stats)` turns one snapshot into `(name, labels, value, kind)` rows an engine can feed to
any metrics system. `PrometheusCollector(buffers)` reads the snapshots of the Buffers (or
ElasticBuffers) given at each scrape, on the scraping thread (`stats()` never blocks and costs the
calls nothing); register it with `prometheus_client.REGISTRY.register(...)` or use
`register_prometheus(buffer)`. Buffers are held weakly: a Buffer that was freed is no longer reported,
one destroyed keeps its last counters. See docs/observability.md.
"""
import weakref
from typing import Iterable, List, NamedTuple

from mooncake_ep_switch.errors import MooncakeEpError

__all__ = ["Sample", "stats_samples", "PrometheusCollector", "register_prometheus"]

DEFAULT_PREFIX = "mooncake_ep"


class Sample(NamedTuple):
    """One metric sample of a `Buffer.stats()` snapshot.

    Fields:
        name: metric name without its prefix (`calls_total`, `bytes_total`, `wait_seconds_total`,
            `masks_total`, `epoch`, `members`).
        labels: dict of label name -> str value (`rank`, and `call` or `cause`).
        value: float.
        kind: `"counter"` (only grows) or `"gauge"`.
    """

    name: str
    labels: dict
    value: float
    kind: str


_HELP = {
    "calls_total": "dispatch and combine calls issued",
    "bytes_total": "bytes of bf16 token rows given to dispatch / returned by combine",
    "wait_seconds_total": "seconds spent in the transport sending and waiting for rows",
    "masks_total": "ranks masked in active_ranks by the calls, by cause",
    "epoch": "the Buffer's membership epoch",
    "members": "ranks in the Buffer's current view",
}


def stats_samples(stats: dict) -> List[Sample]:
    """The samples of one `Buffer.stats()` snapshot.

    Arguments:
        stats: a dict as `Buffer.stats()` returns it.

    Returns:
        samples: list of `Sample`, labelled with the snapshot's rank.

    Raises:
        KeyError: `stats` lacks a field `Buffer.stats()` has.
    """
    rank = str(stats["rank"])
    rows = [Sample("calls_total", {"rank": rank, "call": "dispatch"}, float(stats["dispatches"]), "counter"),
            Sample("calls_total", {"rank": rank, "call": "combine"}, float(stats["combines"]), "counter"),
            Sample("bytes_total", {"rank": rank, "call": "dispatch"}, float(stats["dispatch_bytes"]), "counter"),
            Sample("bytes_total", {"rank": rank, "call": "combine"}, float(stats["combine_bytes"]), "counter"),
            Sample("wait_seconds_total", {"rank": rank}, float(stats["wait_s"]), "counter")]
    rows += [Sample("masks_total", {"rank": rank, "cause": cause}, float(count), "counter")
             for cause, count in sorted(stats["masks"].items())]
    rows += [Sample("epoch", {"rank": rank}, float(stats["epoch"]), "gauge"),
             Sample("members", {"rank": rank}, float(stats["members"]), "gauge")]
    return rows


class PrometheusCollector:
    """A `prometheus_client` collector of Buffers' `stats()`, read at every scrape.

    Arguments:
        buffers: the `Buffer`s or `ElasticBuffer`s to report (held weakly).
        prefix: metric name prefix (default `"mooncake_ep"`: `mooncake_ep_calls_total`, ...).

    Raises:
        ImportError: `prometheus_client` is not installed (`pip install prometheus_client`).
        TypeError: an element of `buffers` has no `stats()`.
    """

    def __init__(self, buffers: Iterable, prefix: str = DEFAULT_PREFIX):
        try:
            import prometheus_client.core  # noqa: F401 - the optional extra, checked here once
        except ImportError as error:
            raise ImportError("PrometheusCollector needs prometheus_client, an optional extra: "
                              "pip install prometheus_client") from error
        buffers = list(buffers)
        for index, buffer in enumerate(buffers):
            if not callable(getattr(type(buffer), "stats", None)):
                raise TypeError(f"buffers[{index}]: expected a Buffer or ElasticBuffer (with stats()), got "
                                f"{type(buffer).__name__}")
        self._buffers = [weakref.ref(buffer) for buffer in buffers]
        self.prefix = prefix

    def collect(self):
        """Yield one metric family per metric name, with a sample per live Buffer (prometheus_client's hook)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families = {}
        for ref in self._buffers:
            buffer = ref()
            if buffer is None:
                continue
            try:
                stats = buffer.stats()
            except MooncakeEpError:  # an ElasticBuffer destroyed: nothing to report any more
                continue
            for sample in stats_samples(stats):
                family = families.get(sample.name)
                if family is None:
                    name = f"{self.prefix}_{sample.name}"
                    labels = sorted(sample.labels)
                    if sample.kind == "counter":  # the family's name is given without its "_total"
                        family = CounterMetricFamily(name[:-len("_total")], _HELP[sample.name], labels=labels)
                    else:
                        family = GaugeMetricFamily(name, _HELP[sample.name], labels=labels)
                    families[sample.name] = family
                family.add_metric([sample.labels[key] for key in sorted(sample.labels)], sample.value)
        yield from families.values()


def register_prometheus(*buffers, registry=None, prefix: str = DEFAULT_PREFIX) -> PrometheusCollector:
    """Report `buffers`' `stats()` on a Prometheus registry (an engine then serves it, e.g. with
    `prometheus_client.start_http_server`).

    Arguments:
        buffers: the `Buffer`s or `ElasticBuffer`s to report.
        registry: the `prometheus_client` registry (default: its global `REGISTRY`).
        prefix: metric name prefix (default `"mooncake_ep"`).

    Returns:
        collector: the registered `PrometheusCollector` (`registry.unregister(collector)` removes it).

    Raises:
        ImportError: `prometheus_client` is not installed.
        TypeError: an element of `buffers` has no `stats()`.
    """
    collector = PrometheusCollector(buffers, prefix=prefix)
    if registry is None:
        from prometheus_client import REGISTRY as registry
    registry.register(collector)
    return collector
