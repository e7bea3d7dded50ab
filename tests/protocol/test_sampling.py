"""Target distribution and token draws (SDCP 4.1, 6.4)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdcp.protocol.messages import Sampling
from sdcp.protocol.sampling import InvalidDistribution, draw_token, target_distribution


def direct_target(logits: list[float], sampling: Sampling | None) -> list[float]:
    """A plain, loop-by-loop reading of SDCP 4.1 to compare the vectorised code against."""
    profile = sampling or Sampling()
    size = len(logits)
    if profile.temperature_milli == 0:
        best = max(range(size), key=lambda t: (logits[t], -t))
        return [1.0 if t == best else 0.0 for t in range(size)]
    temperature = 1.0 if profile.temperature_milli is None else profile.temperature_milli / 1000
    scaled = [value / temperature for value in logits]
    top = max(scaled)
    weights = [math.exp(value - top) for value in scaled]
    probs = [w / sum(weights) for w in weights]
    ranked = sorted(range(size), key=lambda t: (-probs[t], t))
    if profile.top_k:
        kept = set(ranked[: profile.top_k])
        probs = [p if t in kept else 0.0 for t, p in enumerate(probs)]
        probs = [p / sum(probs) for p in probs]
        ranked = sorted(range(size), key=lambda t: (-probs[t], t))
    if profile.top_p_milli is not None and profile.top_p_milli < 1000:
        kept, mass = set(), 0.0
        for token in ranked:
            kept.add(token)
            mass += probs[token]
            if mass >= profile.top_p_milli / 1000:
                break
        probs = [p if t in kept else 0.0 for t, p in enumerate(probs)]
        probs = [p / sum(probs) for p in probs]
    return probs


PROFILES = [
    None,
    Sampling(),
    Sampling(temperature_milli=0),
    Sampling(temperature_milli=500),
    Sampling(temperature_milli=2500, top_k=3),
    Sampling(top_k=2),
    Sampling(top_k=0),
    Sampling(top_k=50),
    Sampling(top_p_milli=0),
    Sampling(top_p_milli=700),
    Sampling(top_p_milli=1000),
    Sampling(temperature_milli=700, top_k=4, top_p_milli=800, seed=3),
]


@pytest.mark.parametrize("sampling", PROFILES)
def test_matches_a_direct_implementation_on_small_rows(sampling: Sampling | None) -> None:
    rows = np.random.default_rng(11).normal(scale=2.0, size=(5, 7))
    rows[0, 2] = rows[0, 5]  # a tie
    result = target_distribution(rows, sampling)
    assert result.dtype == np.float64 and result.shape == rows.shape
    for row, probs in zip(rows, result, strict=True):
        np.testing.assert_allclose(probs, direct_target(list(row), sampling), atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-30, 30), min_size=1, max_size=9),
    temperature_milli=st.none() | st.integers(0, 4000),
    top_k=st.none() | st.integers(0, 10),
    top_p_milli=st.none() | st.integers(0, 1000),
)
def test_matches_a_direct_implementation_on_random_rows(
    logits: list[float], temperature_milli: int | None, top_k: int | None, top_p_milli: int | None
) -> None:
    sampling = Sampling(temperature_milli=temperature_milli, top_k=top_k, top_p_milli=top_p_milli)
    np.testing.assert_allclose(
        target_distribution(np.array(logits), sampling), direct_target(logits, sampling), atol=1e-9
    )


def test_temperature_comes_before_top_p() -> None:
    # At temperature 1 the top token holds 0.665 > 0.6 and stands alone; at temperature 2 it holds
    # 0.506 and needs the second token. Top-p applied before temperature would keep one token.
    logits = np.array([2.0, 1.0, 0.0])
    hot = target_distribution(logits, Sampling(temperature_milli=2000, top_p_milli=600))
    assert np.count_nonzero(hot) == 2
    assert np.count_nonzero(target_distribution(logits, Sampling(top_p_milli=600))) == 1


def test_top_k_comes_before_top_p_on_the_renormalised_distribution() -> None:
    # p = (0.4, 0.35, 0.25). Top-k 2 renormalises to (0.533, 0.467), so top-p 0.5 keeps one token;
    # top-p first (0.4 < 0.5) would keep two, and top-k 2 would then keep both.
    logits = np.log(np.array([0.4, 0.35, 0.25]))
    result = target_distribution(logits, Sampling(top_k=2, top_p_milli=500))
    np.testing.assert_array_equal(result, [1.0, 0.0, 0.0])


def test_temperature_zero_is_one_hot_with_ties_to_the_smallest_id() -> None:
    logits = np.array([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0]])
    np.testing.assert_array_equal(
        target_distribution(logits, Sampling(temperature_milli=0, top_p_milli=1000, top_k=3)),
        [[0, 1, 0, 0], [1, 0, 0, 0]],
    )


def test_top_k_and_top_p_break_ties_by_ascending_id() -> None:
    logits = np.zeros(4)
    np.testing.assert_array_equal(target_distribution(logits, Sampling(top_k=2)), [0.5, 0.5, 0, 0])
    np.testing.assert_array_equal(target_distribution(logits, Sampling(top_p_milli=500)), [0.5, 0.5, 0, 0])
    np.testing.assert_array_equal(target_distribution(logits, Sampling(top_p_milli=0)), [1, 0, 0, 0])


def test_top_p_cut_is_at_least_top_p() -> None:
    # Cumulative masses 0.5, 0.75, 1.0: top-p 0.75 stops exactly at the second token.
    logits = np.log(np.array([0.5, 0.25, 0.25]))
    np.testing.assert_allclose(target_distribution(logits, Sampling(top_p_milli=750)), [2 / 3, 1 / 3, 0])


def test_large_and_masked_logits_are_stable() -> None:
    logits = np.array([1e6, 1e6 - 1.0, -np.inf, -1e6])
    result = target_distribution(logits, None)
    np.testing.assert_allclose(result, [1 / (1 + math.e**-1), 1 / (1 + math.e), 0, 0])
    assert np.all(np.isfinite(result))


def test_one_and_two_dimensional_inputs_agree() -> None:
    rows = np.random.default_rng(3).normal(size=(3, 11)).astype(np.float32)
    profile = Sampling(temperature_milli=800, top_k=5, top_p_milli=900)
    batched = target_distribution(rows, profile)
    for row, expected in zip(rows, batched, strict=True):
        np.testing.assert_array_equal(target_distribution(row, profile), expected)
    np.testing.assert_allclose(batched.sum(axis=-1), 1.0)


@pytest.mark.parametrize(
    "logits",
    [
        np.array([1.0, np.nan]),
        np.array([np.inf, 0.0]),
        np.array([-np.inf, -np.inf]),
        np.zeros((2, 0)),
        np.zeros((2, 2, 2)),
        np.array(1.0),
    ],
)
def test_unusable_logits_are_refused(logits: np.ndarray) -> None:
    with pytest.raises(InvalidDistribution):
        target_distribution(logits, None)


# --- draw_token -------------------------------------------------------------------------------


@pytest.mark.parametrize(("r", "token"), [(0.0, 0), (0.2499, 0), (0.25, 2), (0.7499, 2), (0.75, 3), (1 - 2**-53, 3)])
def test_draw_token_is_an_inverse_cdf_over_ascending_ids(r: float, token: int) -> None:
    assert draw_token(np.array([0.25, 0.0, 0.5, 0.25]), r) == token


def test_draw_token_accepts_unnormalised_weights() -> None:
    assert draw_token(np.array([1.0, 3.0]), 0.24) == 0
    assert draw_token(np.array([1.0, 3.0]), 0.25) == 1


@pytest.mark.parametrize("total", [1.0, 3.0, 2.0**40, 0.1 + 0.2, 7e-300])
def test_draw_token_never_returns_a_trailing_zero_probability_token(total: float) -> None:
    weights = np.array([total / 3, total - total / 3, 0.0, 0.0])
    assert draw_token(weights, 1 - 2**-53) == 1


@settings(max_examples=100, deadline=None)
@given(
    weights=st.lists(st.sampled_from([0.0, 1e-300, 0.1, 0.3, 1.0, 7.0]), min_size=1, max_size=8).filter(any),
    r=st.floats(0.0, 1.0, exclude_max=True),
)
def test_draw_token_returns_a_token_with_probability(weights: list[float], r: float) -> None:
    assert weights[draw_token(np.array(weights), r)] > 0.0


@pytest.mark.parametrize(
    ("probs", "r", "error"),
    [
        (np.array([0.5, 0.5]), 1.0, ValueError),
        (np.array([0.5, 0.5]), -0.1, ValueError),
        (np.array([0.0, 0.0]), 0.5, InvalidDistribution),
        (np.array([0.5, -0.1]), 0.5, InvalidDistribution),
        (np.array([0.5, np.nan]), 0.5, InvalidDistribution),
        (np.array([[0.5, 0.5]]), 0.5, InvalidDistribution),
        (np.array([]), 0.5, InvalidDistribution),
    ],
)
def test_draw_token_refuses_bad_input(probs: np.ndarray, r: float, error: type[Exception]) -> None:
    with pytest.raises(error):
        draw_token(probs, r)
