"""proxy.exposition.merge_expositions: engines' Prometheus texts as one, labelled by model and replica."""

from __future__ import annotations

import random
from bisect import bisect_left

from proxy.exposition import merge_expositions
from proxy.metrics import LATENCY_BUCKETS, OVERHEAD_BUCKETS, QUEUE_BUCKETS, bucket_of

# What llama-server's /metrics looks like (tools/server: counters and gauges, no labels).
ENGINE_TEXT = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 12
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
"""


def test_every_sample_gets_the_server_s_labels_with_or_without_braces() -> None:
    """A bare sample gets {labels}; one with labels gets them first; an empty {} gets them alone."""
    text = 'plain 1\nlabelled{le="0.5"} 2 1700000000\nempty{} 3\n'
    merged = merge_expositions([({"model": "m", "replica": "0"}, text)])
    assert merged.splitlines() == [
        'plain{model="m",replica="0"} 1',
        'labelled{model="m",replica="0",le="0.5"} 2 1700000000',
        'empty{model="m",replica="0"} 3',
    ]


def test_help_and_type_come_once_and_each_family_s_samples_stay_together() -> None:
    """Two replicas' texts: each family's HELP and TYPE once, then both replicas' samples of it."""
    merged = merge_expositions(
        [({"model": "m", "replica": "0"}, ENGINE_TEXT), ({"model": "m", "replica": "1"}, ENGINE_TEXT)]
    )
    assert merged.splitlines() == [
        "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.",
        "# TYPE llamacpp:prompt_tokens_total counter",
        'llamacpp:prompt_tokens_total{model="m",replica="0"} 12',
        'llamacpp:prompt_tokens_total{model="m",replica="1"} 12',
        "# HELP llamacpp:requests_processing Number of requests processing.",
        "# TYPE llamacpp:requests_processing gauge",
        'llamacpp:requests_processing{model="m",replica="0"} 1',
        'llamacpp:requests_processing{model="m",replica="1"} 1',
    ]
    assert merged.endswith("\n")


def test_a_histogram_s_series_stay_under_their_family() -> None:
    """_bucket, _sum and _count samples belong to the family their TYPE line names."""
    text = (
        "# TYPE latency histogram\n"
        'latency_bucket{le="1"} 1\nlatency_bucket{le="+Inf"} 2\nlatency_sum 3.5\nlatency_count 2\n'
        "# TYPE other gauge\nother 7\n"
    )
    merged = merge_expositions([({"replica": "0"}, text), ({"replica": "1"}, text)]).splitlines()
    assert merged.index("# TYPE other gauge") == 1 + 2 * 4
    assert merged[1:9:4] == ['latency_bucket{replica="0",le="1"} 1', 'latency_bucket{replica="1",le="1"} 1']


def test_label_values_are_escaped() -> None:
    """A backslash, a quote and a newline in a label value are written as the text format escapes them."""
    merged = merge_expositions([({"model": 'a\\b"c\nd'}, "up 1\n")])
    assert merged == 'up{model="a\\\\b\\"c\\nd"} 1\n'


def test_comments_and_blank_lines_are_not_samples() -> None:
    """Other comments, blank lines and lines no metric name starts are left out."""
    merged = merge_expositions([({"replica": "0"}, "# just a comment\n\n# EOF\n{bad} 1\nup 1\n")])
    assert merged == 'up{replica="0"} 1\n'


def test_no_texts_is_an_empty_exposition() -> None:
    assert merge_expositions([]) == ""


def test_a_value_falls_in_the_bucket_bisect_gives_it() -> None:
    """``bucket_of``: the index ``bisect_left`` gives, for the bounds of every histogram, at each
    bound, between them, below the first and past the last (+Inf)."""
    rnd = random.Random(5)
    for bounds in (OVERHEAD_BUCKETS, LATENCY_BUCKETS, QUEUE_BUCKETS):
        values = [*bounds, *(b * 0.999 for b in bounds), *(b * 1.001 for b in bounds), 0.0, -1.0]
        values += [rnd.uniform(0, bounds[-1] * 2) for _ in range(500)]
        for value in values:
            assert bucket_of(bounds, value) == bisect_left(bounds, value), (bounds, value)
