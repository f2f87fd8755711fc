"""benchmarks/long_sequences.py's inputs and figures: the length distribution it promises and
the padded fraction of an unsorted plan, by hand."""
from __future__ import annotations

import statistics

from benchmarks.long_sequences import (MAX_LEN, MEDIAN, arrival_order_padded_fraction,
                                       response_lengths)


def test_lengths_are_long_tailed_and_capped():
    lengths = response_lengths(64)
    assert lengths == response_lengths(64)   # seeded
    assert max(lengths) == MAX_LEN and min(lengths) >= 8
    assert 0.6 * MEDIAN < statistics.median(lengths) < 1.5 * MEDIAN
    assert statistics.mean(lengths) > statistics.median(lengths)   # a right tail


def test_arrival_order_padded_fraction_by_hand():
    # rows of 2: [4, 2] -> 8 forwarded, [3, 3] -> 6, [5] -> 5: 17 real of 19
    assert arrival_order_padded_fraction([4, 2, 3, 3, 5], 2) == 1 - 17 / 19
