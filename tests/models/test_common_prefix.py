"""common_prefix_length: the longest common prefix of two token sequences, whatever their kinds."""

from __future__ import annotations

import pytest

from sdcp.models.backend import common_prefix_length


@pytest.mark.parametrize("kind", [list, tuple])
def test_the_common_prefix_of_a_tuple_and_a_list_is_counted(kind: type) -> None:
    # The lookahead judged its tuples of predicted tokens against lists of decided ones: every
    # prediction counted as wrong from its first token, and no guess was ever scored.
    assert common_prefix_length((1, 2, 3, 4), kind([1, 2, 3, 9, 9])) == 3
    assert common_prefix_length(kind([1, 2, 3]), (1, 2, 3, 4)) == 3
    assert common_prefix_length(kind([5]), (1,)) == 0


def test_every_length_of_common_prefix_is_found() -> None:
    held = list(range(100))
    for common in range(101):
        given = [*held[:common], -1, *held[common + 1 :]] if common < 100 else held
        assert common_prefix_length(held, given) == common
