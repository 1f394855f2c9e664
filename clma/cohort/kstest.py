"""fed-clma 0.1.1's ``clma.cohort.kstest``: :func:`signed_ks_statistic` (this package's,
:mod:`clma.cohort.ks`) and :func:`ks_pvalue`."""

from __future__ import annotations

import math

from scipy.special import kolmogorov

from clma.cohort.ks import signed_ks_statistic

__all__ = ["ks_pvalue", "signed_ks_statistic"]


def ks_pvalue(statistic: float, n_client: int, n_reference: int) -> float:
    r"""Asymptotic two-sided p-value of a (signed) KS statistic: the Kolmogorov survival
    function :math:`Q(\lambda) = 2\sum_{j\ge1}(-1)^{j-1}e^{-2j^2\lambda^2}`
    (``scipy.special.kolmogorov``) at Stephens' corrected
    :math:`\lambda = |D|\,(\sqrt{n_e} + 0.12 + 0.11/\sqrt{n_e})`,
    :math:`n_e = n_c n_r / (n_c + n_r)` (Stephens 1970; fed-clma 0.1.1's formula).

    Parameter vectors of one model are not independent samples: a ranking signal, not a
    calibrated level. Returns a float in [0, 1] (1.0 for ``D == 0``).

    Raises:
        ValueError: ``statistic`` not finite or outside [-1, 1]; a size not an integer >= 1.
    """
    d = float(statistic)
    if not math.isfinite(d) or abs(d) > 1.0:
        raise ValueError("statistic: must be a finite KS statistic in [-1, 1]")
    for field, n in (("n_client", n_client), ("n_reference", n_reference)):
        if isinstance(n, bool) or int(n) != n or n < 1:
            raise ValueError(f"{field}: must be an integer >= 1")
    if d == 0.0:
        return 1.0
    root = math.sqrt(n_client * n_reference / (n_client + n_reference))
    return float(min(1.0, max(0.0, kolmogorov(abs(d) * (root + 0.12 + 0.11 / root)))))
