"""Test helpers: the packed-row leak harness (and its whole-model form), small reference mixers with planted leaks, the host-read tripwire."""

from megacpp_lab.testing import host_reads, leaks, model_leaks, planted
from megacpp_lab.testing.host_reads import LAUNCHER_PLUMBING, launcher_operators, no_host_reads
from megacpp_lab.testing.leaks import (
    Dependence,
    DocSpan,
    LeakReport,
    VacuousCheckError,
    Violation,
    assert_no_leaks,
    check_leaks,
    each_document_alone,
    influence_matrix,
    influence_violation,
    plot_influence,
    with_doc_ids,
)
from megacpp_lab.testing.model_leaks import model_leak_report, wake_zero_initialised
from megacpp_lab.testing.planted import (
    CausalSmoother,
    CenteredSmoother,
    DocCausalAttention,
    TokenMixer,
    ZeroInitProjection,
)

__all__ = [*host_reads.__all__, *leaks.__all__, *model_leaks.__all__, *planted.__all__]
