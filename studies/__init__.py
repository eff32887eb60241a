"""Reproducible studies of random-feature approximations of the softmax kernel exp(q.k).

Run ``python -m studies list`` to see them and ``python -m studies run NAME|all`` to reproduce
the reports in ``reports/``.  Each study is a module defining ``STUDY = Study(...)`` (see
``studies._engine``); the modules are imported lazily by the runner, in this order.
"""

STUDY_MODULES: tuple[str, ...] = (
    "error_vs_r",
    "dlogd",
    "dlogd_converged",
    "orthogonal_gain",
    "attention_error",
    "cost_crossover",
    "state_capacity",
    "qr_sign_bias",
    "estimator_league",
    "diagnose_validation",
    "real_attention",
    "hybrid_attention",
    "linearize_recover",
    "repro_yu_orf_variance",
    "repro_performer_attention",
    "repro_sutherland_schneider",
    "repro_yu_table2",
)

__all__ = ["STUDY_MODULES"]
