"""The prefill graphs' memory estimate and the default buckets a device affords
(engine/prefill_graph_memory.py), at the H200's measured
sizes: the 80B preset keeps every default bucket, Flash-Next's FP8 weights leave room for those up to
2,048 tokens."""

from __future__ import annotations

from morion.config import EngineConfig
from morion.engine.prefill_graph_memory import (
    DEFAULT_BUCKETS_SHARE,
    GRAPH_MEMORY_FACTOR,
    affordable_buckets,
    affordable_default_buckets,
    graph_memory_bytes,
)

GIB = 2**30


def test_the_estimate_scales_the_peak_to_the_largest_bucket():
    assert graph_memory_bytes(GIB, 4096, 4096) == int(GRAPH_MEMORY_FACTOR * GIB)
    assert graph_memory_bytes(GIB, 4096, 1024) == int(GRAPH_MEMORY_FACTOR * GIB / 4)
    # Above what the H200 measured: 80B 2.74 GiB with a 0.65 GiB peak; Flash-Next 2.16 GiB up to 2,048
    # tokens with a 0.95 GiB peak at 4,096.
    assert graph_memory_bytes(int(0.65 * GIB), 4096, 4096) > 2.74 * GIB
    assert graph_memory_bytes(int(0.95 * GIB), 4096, 2048) > 2.16 * GIB


def test_a_device_affords_a_prefix_of_the_buckets():
    buckets = (256, 512, 1024, 2048, 4096)
    assert affordable_buckets(buckets, int(0.65 * GIB), 4096, 60 * GIB) == buckets  # the 80B's room
    assert affordable_buckets(buckets, int(0.95 * GIB), 4096, 15 * GIB) == (256, 512, 1024, 2048)
    assert affordable_buckets(buckets, int(0.95 * GIB), 4096, GIB) == ()
    # At the share exactly, a bucket is kept.
    room = int(graph_memory_bytes(GIB, 4096, 1024) / DEFAULT_BUCKETS_SHARE) + 1
    assert affordable_buckets(buckets, GIB, 4096, room) == (256, 512, 1024)


def test_default_buckets_are_cut_and_the_cut_is_said(capsys):
    config = affordable_default_buckets(EngineConfig(), int(0.95 * GIB), 4096, 15 * GIB)
    assert config.prefill_graph_buckets == (256, 512, 1024, 2048)
    line = capsys.readouterr().err
    assert "for token buckets 256, 512, 1024, 2048 only: graphs up to 4096 tokens" in line
    assert "--prefill-graph-tokens" in line
    off = affordable_default_buckets(EngineConfig(), int(0.95 * GIB), 4096, GIB)
    assert off.prefill_graph_buckets == () and "prefill graphs off" in capsys.readouterr().err


def test_given_buckets_and_affordable_defaults_stay():
    given = EngineConfig(prefill_graph_tokens=(512, 4096))
    assert affordable_default_buckets(given, int(0.95 * GIB), 4096, GIB) is given
    roomy = EngineConfig()
    assert affordable_default_buckets(roomy, int(0.65 * GIB), 4096, 60 * GIB) is roomy
