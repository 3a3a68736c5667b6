"""pass@k (Chen et al. 2021): hand-computed cases, the binomial definition, and large n."""
import math

import pytest

from megarl.algorithms.pass_at_k import mean_pass_at_k, pass_at_k


def test_hand_computed_case():
    # n = 5 samples, c = 2 correct. pass@1 = c / n; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10;
    # pass@3 = 1 - C(3,3)/C(5,3) = 1 - 1/10; pass@4: every 4-subset holds a correct sample.
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    assert pass_at_k(5, 2, 4) == 1.0
    assert pass_at_k(5, 0, 5) == 0.0 and pass_at_k(5, 5, 1) == 1.0


def test_equals_the_binomial_definition():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_stable_where_the_binomials_overflow_a_float():
    # C(1000, 500) ~ 1e299 and C(2000, 1000) overflows float64; the product form stays exact:
    # C(n-1, k) / C(n, k) = (n - k) / n.
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5, abs=1e-12)
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5, abs=1e-12)


def test_mean_over_problems_and_domain_errors():
    assert mean_pass_at_k([(5, 2), (5, 0), (5, 5)], 2) == pytest.approx((0.7 + 0.0 + 1.0) / 3)
    assert math.isnan(mean_pass_at_k([], 1))
    for n, c, k in ((4, 1, 5), (4, 1, 0), (4, 5, 1), (4, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)
