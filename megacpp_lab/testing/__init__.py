"""Test helpers: the packed-row leak harness and small reference mixers with planted leaks."""

from megacpp_lab.testing import leaks, planted
from megacpp_lab.testing.leaks import (
    Dependence,
    DocSpan,
    LeakReport,
    VacuousCheckError,
    Violation,
    assert_no_leaks,
    check_leaks,
    influence_matrix,
    influence_violation,
    plot_influence,
)
from megacpp_lab.testing.planted import (
    CausalSmoother,
    CenteredSmoother,
    DocCausalAttention,
    TokenMixer,
    ZeroInitProjection,
)

__all__ = [*leaks.__all__, *planted.__all__]
