"""The `kernelapprox.testing` battery over every registered estimator, one test per check."""

from __future__ import annotations

import pytest

import kernelapprox as ka
from kernelapprox.testing import check_feature_map, feature_map_checks


@pytest.mark.parametrize(
    ("estimator", "check"),
    list(feature_map_checks(ka.estimators())),
    ids=lambda x: getattr(x, "name", None) or getattr(x, "__name__", str(x)),
)
def test_estimator(estimator, check):
    check(estimator)


def test_battery_catches_a_broken_map():
    """A map whose kernel is off by 5 % fails the battery (the checks can fail)."""

    class Broken(ka.PositiveRF):
        def kernel(self, q, k, *, compute_dtype=None):
            return 1.05 * super().kernel(q, k, compute_dtype=compute_dtype)

    with pytest.raises(AssertionError, match="kernel differs"):
        check_feature_map(lambda **kw: Broken(4, 8, **kw))


def test_battery_catches_a_biased_map():
    """Features scaled by sqrt(1.05): phi phi^T = 1.05 K, consistent with kernel, but biased."""

    class Biased(ka.PositiveRF):
        def log_features(self, x, shared=False):
            f, s = super().log_features(x, shared)
            return f, s + 0.5 * 0.04879016416943205  # log(1.05) / 2

    from kernelapprox.testing import check_unbiased

    with pytest.raises(AssertionError, match="biased kernel"):
        check_unbiased(lambda **kw: Biased(4, 8, **kw))
