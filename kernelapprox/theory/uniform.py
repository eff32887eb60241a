r"""Uniform convergence over a ball: how many trig projections make $\sup|\hat K - K| \le \varepsilon$.

Every function returns the number ``r`` of random projections such that, with probability at
least $1-\delta$ over the draw,

$$
\sup_{\|x\|,\|y\|\le R}\big|\hat K(x,y) - e^{x^\top y}\big| \le \varepsilon
$$

(an *absolute* error) for trigonometric features on the ball $B(R)\subset\mathbb R^d$.
``radius`` bounds the inputs of $\exp(q^\top k)$ as the library receives them, i.e. *after*
the attention scaling $q/d^{1/4}$.

From the Gaussian to the softmax kernel [DERIVED]: trig features estimate
$e^{x^\top y} = e^{\|x\|^2/2}K_G(x,y)e^{\|y\|^2/2}$ by $e^{\|x\|^2/2}\hat K_G(x,y)
e^{\|y\|^2/2}$, so on $B(R)$

$$
|\hat K - K| \le e^{R^2}\,|\hat K_G - K_G|,
$$

and every Gaussian-kernel bound is run at $\varepsilon_G = \varepsilon e^{-R^2}$ on a set of
diameter $\ell = 2R$, with spectral second moment $\sigma_p^2 = E\|\omega\|^2 = d$.
The factor $e^{2R^2}$ in every ``r`` comes from this step.

Sources and how sure we are (read the tags):

* Rahimi–Recht 2007, Claim 1 [SOURCE-2nd]:
  $r = \frac{4(d+2)}{\varepsilon_G^2}\log\frac{2^8\sigma_p^2\ell^2}{\delta\varepsilon_G^2}$.
* Sutherland–Schneider 2015, Prop. 1 simplified form [RECALLED constants], sin/cos:
  $r = \frac{8(d+2)}{2\varepsilon_G^2}\log\frac{66\max(\sigma_p^2\ell^2/\varepsilon_G^2,\,1)}{\delta}$.
* Sriperumbudur–Szabó 2015, Thm 1 [RECALLED constants]:
  $r = \big((h + \sqrt{2\log(1/\delta)})/\varepsilon_G\big)^2$.
* Performer 2021, Thm 4 / Thm 7 [SOURCE, up to an unknown Θ constant]:
  $r = c\,\frac{d}{\delta_P^2}\log\frac{4d^{3/4}R_P}{\delta_P}$.
* The ε-net bound for iid sin/cos features with every step derived here [DERIVED]
  (`derived_sincos_features`): $r = \min_\rho \frac{8}{\varepsilon_G^2}\big[\log 2 +
  d\log(1 + 2\ell/\rho) - \log(\delta - 16\sigma_p^2\rho^2/\varepsilon_G^2)\big]$.

How far each value can be trusted is recorded in `CONSTANT_STATUS`, and what was checked, against
which text, in `CONSTANT_NOTES` (read both before quoting a number): the Rahimi–Recht constants
come from (secondary) transcriptions of the paper; the Sutherland–Schneider and Sriperumbudur–Szabó
constants are RECALLED — not checked against the statements in the papers.  What *was* checked for
Sutherland–Schneider: the opening of arXiv:1506.02785 defines the paired map $\tilde z$ with
$D/2$ frequencies (so ``r = D/2`` here), and re-running Rahimi–Recht's proof for that map gives
exactly the recalled exponent $D\varepsilon^2/(8(d+2))$ and a prefactor whose supremum over $d$
is 66.0 (`sutherland_schneider_features`, "Re-derivation") — consistency with our
re-derivation, not a reading of the paper.  The Performer value is a *shape* with its unknown
Θ-constant set to 1, so a measurement below it says nothing about validity.
``tests/test_theory_bounds.py`` pins the formulas to hand-computed golden values and shape
properties (the $\log$ term, the $d$, $\delta$ and $R$ dependence) and pins their ratio to a
measured $r^*$; it cannot verify recalled constants.

In $d$ every bound has the form $a\,d\log(C d)$ with a large $C$ (the $\log$ comes from the
$\varepsilon$-net over the ball); on $d\in[4, 128]$ they look like $d^{0.96}$–$d^{1.2}$.  A chaining
argument (Dudley's entropy integral) gives $E\sup\lesssim R\sqrt{d/r}$ without the
$\log d$, and Sudakov minoration the matching lower bound, i.e. $r^*\asymp d/\varepsilon^2$ at
fixed $R$ (van Handel, *Probability in High Dimension*, 2016 lecture notes, ch. 5–6).

References
----------
- [RR07] A. Rahimi, B. Recht. "Random Features for Large-Scale Kernel Machines", NIPS 2007,
   Claim 1.
- [SS15] D. J. Sutherland, J. Schneider. "On the Error of Random Fourier Features", UAI 2015,
   arXiv:1506.02785.
- [SSz15] B. Sriperumbudur, Z. Szabó. "Optimal Rates for Random Fourier Features", NIPS 2015,
   arXiv:1506.02155, Theorem 1.
- [Cho21] K. Choromanski et al. "Rethinking Attention with Performers", ICLR 2021,
   arXiv:2009.14794, Theorem 4 and Theorem 7 (App. F.5).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._common import _deprecated_keywords

__all__ = [
    "CONSTANT_NOTES",
    "CONSTANT_STATUS",
    "UNIFORM_BOUNDS",
    "rahimi_recht_features",
    "sutherland_schneider_features",
    "sriperumbudur_szabo_features",
    "performer_theorem4_features",
    "derived_sincos_features",
    "derived_sincos_failure_probability",
    "required_features_uniform",
]

#: Names accepted by ``required_features_uniform(bound=...)``.
UNIFORM_BOUNDS = ("rahimi-recht", "sutherland-schneider", "sriperumbudur-szabo", "performer")

#: How each bound's constants are known.  "SOURCE-2nd": read in secondary transcriptions of the
#: paper (not the paper itself); "RECALLED": from memory, NOT verified against the paper;
#: "SHAPE-ONLY": the theorem is a Θ statement, its constant is unknown and set to ``constant``
#: (default 1), so the value is a d/ε/R-shape, never a guarantee.  What was checked for each is
#: in `CONSTANT_NOTES`.
CONSTANT_STATUS = {
    "rahimi-recht": "SOURCE-2nd",
    "sutherland-schneider": "RECALLED",
    "sriperumbudur-szabo": "RECALLED",
    "performer": "SHAPE-ONLY",
}

#: What was compared with which text, per bound (the reason a tag is what it is).
CONSTANT_NOTES = {
    "rahimi-recht": (
        "SOURCE-2nd: 2^8 and 4(d+2) as in two secondary transcriptions of RR07 Claim 1 (a third "
        "gives 8(d+2)); not checked against the statement in RR07 itself. Re-running its proof: the exponent 4(d+2) holds for per-frequency terms "
        "of range 2 (sin/cos, r frequencies); for cos(w'x + b) terms (range 4, not "
        "shift-invariant) the proof's Hoeffding step does not carry over as written."),
    "sutherland-schneider": (
        "RECALLED: Prop. 1 (sin/cos, 66, 8(d+2)) and the cos + offset statement (98, 32(d+2)) of "
        "SS15 (arXiv:1506.02785) are not checked against the paper. Checked against its section 1: "
        "z~ has D/2 frequencies (r = D/2 here). Consistent with our re-derivation: RR07's proof steps for z~ give "
        "beta_d (sigma_p l / eps)^(2d/(d+2)) exp(-D eps^2 / (8(d+2))) with "
        "beta_d = ((d/2)^(-d/(d+2)) + (d/2)^(2/(d+2))) 2^((6d+2)/(d+2)), sup_d beta_d = 66.0 "
        "(d = 64), provided E L_f^2 <= sigma_p^2 (SS15's Lipschitz step, not re-derived: the "
        "derivation here proves 4 sigma_p^2). The offset constants are not re-derived."),
    "sriperumbudur-szabo": (
        "RECALLED: Thm 1 of SSz15 (arXiv:1506.02155) is not checked against the paper: h, the "
        "constants 32/32/16 and |S| = diameter are recalled."),
    "performer": (
        "SHAPE-ONLY: Thm 4 / Thm 7 of arXiv:2009.14794 state Theta(...) with any constant "
        "probability; the constant is a parameter."),
}


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def _check(eps: object, delta: object, dim: object, radius: object) -> tuple[float, float, int, float]:
    e = _number("eps", eps)
    if e <= 0:
        raise ValueError(f"eps must be > 0, got {e}")
    dl = _number("delta", delta)
    if not 0.0 < dl < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {dl}")
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise TypeError(f"dim must be a positive int, got {dim!r}")
    if dim <= 0:
        raise ValueError(f"dim must be a positive int, got {dim}")
    R = _number("radius", radius)
    if R <= 0:
        raise ValueError(f"radius must be > 0, got {R}")
    return e, dl, int(dim), R


def _ceil(x: float) -> int:
    if math.isinf(x) or x > 2**62:
        raise OverflowError(f"the bound requires more than 2**62 features ({x:.3g})")
    return max(1, math.ceil(x))


def gaussian_level(eps: float, radius: float) -> float:
    r"""$\varepsilon_G = \varepsilon e^{-R^2}$: the Gaussian-kernel error level for softmax error ``eps`` on $B(R)$."""
    return eps * math.exp(-radius * radius)


def rahimi_recht_features(eps: float, delta: float, dim: int, radius: float) -> int:
    r"""Rahimi–Recht Claim 1, transported to the softmax kernel on $B(R)$.

    Claim 1 (for $z(x)=\sqrt{2/D}\cos(\omega^\top x+b)$, $D$ features, a compact set
    $\mathcal M$ of diameter $\ell$):

    $$
    P\Big[\sup_{x,y\in\mathcal M}|z(x)^\top z(y)-k(x,y)|\ge\varepsilon\Big]
    \le 2^8\Big(\frac{\sigma_p\ell}{\varepsilon}\Big)^2\exp\Big(-\frac{D\varepsilon^2}{4(d+2)}\Big),
    $$

    solved for failure probability $\delta$ at $\varepsilon_G=\varepsilon e^{-R^2}$,
    $\ell = 2R$, $\sigma_p^2 = d$:

    $$
    r = \Big\lceil\frac{4(d+2)}{\varepsilon_G^2}\log\frac{2^8\,d\,(2R)^2}{\delta\,\varepsilon_G^2}\Big\rceil .
    $$

    ``r`` counts cosine features with random phase (``TrigRF(variant="offset")``, ``r`` projections).
    The same argument (Hoeffding plus a Lipschitz net) goes through for the sin/cos pairs, whose
    per-projection term has half the range, so the value is also a valid — conservative — ``r``
    for ``variant="sincos"`` [DERIVED].

    Status: SOURCE-2nd — the constants were read in two secondary transcriptions (a third one gives
    $8(d+2)$), not checked against the statement in the paper itself.
    Re-running the proof (as in `sutherland_schneider_features`, "Re-derivation") gives the
    exponent $D\varepsilon^2/(4(d+2))$ for $D$ per-frequency terms of range 2, i.e. the sin/cos
    map with $D$ frequencies; for $\cos(w^\top x+b)$ features the per-feature product has range
    4 and is not a function of $x - y$, so that Hoeffding step does not carry over as written
    (the reason Sutherland–Schneider state a separate bound for the offset map). The value for
    ``variant="offset"`` is Claim 1 as transcribed, not backed by a re-derivation.

    Parameters
    ----------
    eps : float
        Absolute sup error on $e^{x^\top y}$, > 0.
    delta : float
        Failure probability, in (0, 1).
    dim : int
        ``d``.
    radius : float
        ``R`` > 0, the bound on $\|x\|,\|y\|$ (inputs after attention scaling).

    Returns
    -------
    int

    References
    ----------
    Rahimi & Recht, NIPS 2007, Claim 1.

    Examples
    --------
    >>> rahimi_recht_features(0.5, 0.1, 2, 0.5) > rahimi_recht_features(1.0, 0.1, 2, 0.5)
    True
    """
    e, dl, d, R = _check(eps, delta, dim, radius)
    eg = gaussian_level(e, R)
    ell2 = (2.0 * R) ** 2
    D = 4.0 * (d + 2) / eg**2 * math.log(2.0**8 * d * ell2 / (dl * eg**2))
    return _ceil(D)


def sutherland_schneider_features(
    eps: float, delta: float, dim: int, radius: float, *, variant: str = "sincos"
) -> int:
    r"""Sutherland–Schneider's improved uniform bound, transported to the softmax kernel on $B(R)$.

    RECALLED, NOT VERIFIED (``CONSTANT_STATUS``, ``CONSTANT_NOTES``) — the constants 66/98 and the
    exponents below are recalled, not checked against the statement in arXiv:1506.02785; the sin/cos one is consistent with our re-derivation (below), the
    offset one is not re-derived.  A measured $r^*$ below this value is not evidence that the
    bound holds.

    * ``variant="sincos"`` ($\tilde z$, ``D = 2r`` coordinates, $D/2 = r$ frequencies — the
      paper's §1 definition): for $\varepsilon \le \sigma_p\ell$,
      $P[\|f\|_\infty\ge\varepsilon]\le66\big(\frac{\sigma_p\ell}{\varepsilon}\big)^2
      \exp\big(-\frac{D\varepsilon^2}{8(d+2)}\big)$, so
      $r = \big\lceil\frac{4(d+2)}{\varepsilon_G^2}\log\frac{66\,x}{\delta}\big\rceil$ with
      $x = \max(\sigma_p^2\ell^2/\varepsilon_G^2, 1)$.
    * ``variant="offset"`` ($\breve z$, ``D = r``): constant 98 and $32(d+2)$:
      $r = \big\lceil\frac{32(d+2)}{\varepsilon_G^2}\log\frac{98\,x}{\delta}\big\rceil$.

    with $\varepsilon_G = \varepsilon e^{-R^2}$, $\ell = 2R$, $\sigma_p^2 = d$.

    The $\max(\cdot, 1)$ [DERIVED]: the $(\sigma_p\ell/\varepsilon)^2$ form is stated for
    $\varepsilon\le\sigma_p\ell$, where it bounds the sharper
    $\beta_d(\sigma_p\ell/\varepsilon)^{2d/(d+2)}$; for $\varepsilon > \sigma_p\ell$ that power is
    below 1, so $66\cdot1$ (resp. $98\cdot1$) is the value that still bounds it. Without the
    $\max$ the formula would be below its own sharper form there (small $R\sqrt d$); it changes
    nothing where $\varepsilon_G \le 2R\sqrt d$.

    Re-derivation of the sin/cos form (Rahimi–Recht's proof run for $\tilde z$) [DERIVED]:
    $f(\Delta) = \frac2D\sum_{i\le D/2}\cos(\omega_i^\top\Delta) - k(\Delta)$ on
    $\mathcal M_\Delta = \{x - y\}$ (diameter $2\ell$). Cover $\mathcal M_\Delta$ by
    $T = (4\ell/\rho)^d$ balls of radius $\rho$; Hoeffding on the $D/2$ terms in $[-1, 1]$
    at level $\varepsilon/2$ gives $2T e^{-D\varepsilon^2/16}$ over the anchors; Markov on the
    Lipschitz constant with $E L_f^2\le\sigma_p^2$ gives $(2\sigma_p\rho/\varepsilon)^2$.
    Minimising $\kappa_1\rho^{-d}+\kappa_2\rho^2$ over $\rho$ gives
    $\kappa_1^{2/(d+2)}\kappa_2^{d/(d+2)}\big[(d/2)^{-d/(d+2)} + (d/2)^{2/(d+2)}\big]$, i.e.
    $\beta_d(\sigma_p\ell/\varepsilon)^{2d/(d+2)}e^{-D\varepsilon^2/(8(d+2))}$ with
    $\beta_d = \big[(d/2)^{-d/(d+2)} + (d/2)^{2/(d+2)}\big]2^{(6d+2)/(d+2)}$, whose supremum
    over $d$ is $66.0$ (at $d = 64$). The step $E L_f^2 \le \sigma_p^2$ is taken from the paper,
    not re-derived; `derived_sincos_features` replaces it by the $4\sigma_p^2$ proved there.

    Parameters
    ----------
    eps, delta, dim, radius
        As in `rahimi_recht_features`.
    variant : {"sincos", "offset"}, default "sincos"

    Returns
    -------
    int

    References
    ----------
    Sutherland & Schneider, UAI 2015, arXiv:1506.02785 (constants recalled).

    Examples
    --------
    >>> sutherland_schneider_features(0.5, 0.1, 2, 0.5) >= 1
    True
    """
    e, dl, d, R = _check(eps, delta, dim, radius)
    if variant not in ("sincos", "offset"):
        raise ValueError(f"variant must be 'sincos' or 'offset', got {variant!r}")
    eg = gaussian_level(e, R)
    ell2 = (2.0 * R) ** 2
    x = max(d * ell2 / eg**2, 1.0)  # (sigma_p l / eps_G)^2, at least 1
    if variant == "sincos":
        D = 8.0 * (d + 2) / eg**2 * math.log(66.0 * x / dl)
        return _ceil(D / 2.0)
    D = 32.0 * (d + 2) / eg**2 * math.log(98.0 * x / dl)
    return _ceil(D)


#: Net radii tried by `derived_sincos_features`, as fractions of the largest useful one (where
#: the Lipschitz term alone reaches delta). Every radius gives a valid bound, so the minimum over
#: this grid is valid; the grid only decides how close it is to the exact minimum.
_RHO_FRACTIONS = np.logspace(-6.0, math.log10(1.0 - 1e-9), 4001)


def derived_sincos_failure_probability(eps_g: float, num_projections: int, dim: int,
                                       radius: float) -> float:
    r"""Our ε-net bound on $P[\sup_{x,y\in B(R)}|\hat k - k| \ge \varepsilon_G]$, iid sin/cos features.

    For the Gaussian kernel $k(\Delta) = e^{-\|\Delta\|^2/2}$ ($\sigma_p^2 = E\|\omega\|^2 = d$)
    and $\hat k(\Delta) = \frac1n\sum_{i\le n}\cos(\omega_i^\top\Delta)$ with $n$ iid rows
    (``TrigRF(variant="sincos")``, ``n`` projections, $2n$ coordinates), on $B(R)$ so that
    $\Delta\in B(\ell)$, $\ell = 2R$ [DERIVED, every step]:

    1. a maximal $\rho$-separated set in $B(\ell)$ is a $\rho$-net with
       $N(\rho)\le(1 + 2\ell/\rho)^d$ points (volume of disjoint $\rho/2$-balls in
       $B(\ell + \rho/2)$);
    2. Hoeffding, $n$ terms in $[-1, 1]$, level $\varepsilon/2$, union over the net:
       $2N(\rho)e^{-n\varepsilon^2/8}$;
    3. $f = \hat k - k$ has $\|\nabla f\|\le\frac1n\sum\|\omega_i\| + E\|\omega\|$, so
       $E L_f^2 \le E(\frac1n\sum\|\omega_i\|)^2 + 3(E\|\omega\|)^2 \le 4\sigma_p^2$ (Jensen twice),
       and Markov: $P[L_f\ge\varepsilon/(2\rho)]\le(4\sigma_p\rho/\varepsilon)^2$;
    4. off both events, every $\Delta$ is within $\rho$ of a net point on a segment inside
       $B(\ell)$, so $|f(\Delta)| < \varepsilon/2 + L_f\rho < \varepsilon$.

    Hence $P \le \min_{\rho>0}\big[2(1 + 2\ell/\rho)^d e^{-n\varepsilon^2/8} +
    16\sigma_p^2\rho^2/\varepsilon^2\big]$ (the minimum is taken over a fixed grid of $\rho$; any
    $\rho$ is valid). Not for orthogonal rows (step 2 needs independent rows).

    Parameters
    ----------
    eps_g : float
        $\varepsilon_G > 0$, the Gaussian-kernel sup error.
    num_projections : int
        $n \ge 1$.
    dim : int
        $d$.
    radius : float
        $R > 0$.

    Returns
    -------
    float
        The bound, clipped to at most 1.

    Examples
    --------
    >>> derived_sincos_failure_probability(0.2, 8192, 2, 1.0) < 1e-3
    True
    """
    eg_ = _number("eps_g", eps_g)
    if eg_ <= 0:
        raise ValueError(f"eps_g must be > 0, got {eps_g!r}")
    e, _, d, R = _check(eg_, 0.5, dim, radius)
    if isinstance(num_projections, bool) or not isinstance(num_projections, (int, np.integer)) \
            or num_projections < 1:
        raise ValueError(f"num_projections must be a positive int, got {num_projections!r}")
    ell, sp = 2.0 * R, math.sqrt(d)
    rho = (e / (4.0 * sp)) * _RHO_FRACTIONS  # the Lipschitz term is < 1 on this grid
    log_net = math.log(2.0) + d * np.log1p(2.0 * ell / rho) - int(num_projections) * e * e / 8.0
    p = np.exp(np.minimum(log_net, 0.0)) + (4.0 * sp * rho / e) ** 2
    return float(min(1.0, p.min()))


def derived_sincos_features(eps: float, delta: float, dim: int, radius: float) -> int:
    r"""Projections ``r`` for $\sup_{B(R)}|\hat K - e^{x^\top y}|\le\varepsilon$ w.p. $1-\delta$, our ε-net bound.

    `derived_sincos_failure_probability` (every step derived; iid sin/cos rows) solved for $n$ at
    $\varepsilon_G = \varepsilon e^{-R^2}$: for each net radius $\rho$ with
    $16\sigma_p^2\rho^2/\varepsilon_G^2 < \delta$,

    $$
    n(\rho) = \frac{8}{\varepsilon_G^2}\Big[\log 2 + d\log\Big(1+\frac{2\ell}{\rho}\Big)
    - \log\Big(\delta - \frac{16\,d\,\rho^2}{\varepsilon_G^2}\Big)\Big],
    $$

    and $r = \lceil\min_\rho n(\rho)\rceil$ over a fixed grid of $\rho$ (each $\rho$ gives a
    valid bound). Status: DERIVED — no constant taken from a paper. It is below the recalled
    Sutherland–Schneider value (it keeps the exact net size and the $\rho$-optimum instead of
    their closed-form loosening) although its Lipschitz step is 4× weaker.

    Parameters
    ----------
    eps, delta, dim, radius
        As in `rahimi_recht_features`.

    Returns
    -------
    int

    Examples
    --------
    >>> derived_sincos_features(0.5, 0.1, 2, 0.5) < sutherland_schneider_features(0.5, 0.1, 2, 0.5)
    True
    """
    e, dl, d, R = _check(eps, delta, dim, radius)
    eg = gaussian_level(e, R)
    ell = 2.0 * R
    rho = (math.sqrt(dl) * eg / (4.0 * math.sqrt(d))) * _RHO_FRACTIONS
    lip = 16.0 * d * rho**2 / eg**2  # < delta on the grid
    n = 8.0 / eg**2 * (math.log(2.0) + d * np.log1p(2.0 * ell / rho) - np.log(dl - lip))
    return _ceil(float(n.min()))


def sriperumbudur_szabo_features(eps: float, delta: float, dim: int, radius: float) -> int:
    r"""Sriperumbudur–Szabó Theorem 1 (optimal $\sqrt{\log|S|/m}$ rate), transported to $B(R)$.

    RECALLED, NOT VERIFIED constants (``CONSTANT_STATUS``): with probability
    $\ge1-e^{-\tau}$,

    $$
    \sup_{x,y\in S}|\hat k_m-k|\le\frac{h(d,|S|,\sigma_p)+\sqrt{2\tau}}{\sqrt m},\quad
    h=32\sqrt{2d\log(2|S|+1)}+32\sqrt{2d\log(\sigma_p+1)}+16\sqrt{\frac{2d}{\log(2|S|+1)}},
    $$

    for $\hat k_m = \frac1m\sum\cos(\omega_i^\top(x-y))$ (sin/cos, ``m`` projections). With
    $\tau = \log(1/\delta)$, $|S| = 2R$, $\sigma_p=\sqrt d$ and
    $\varepsilon_G = \varepsilon e^{-R^2}$:
    $r = \big\lceil\big((h+\sqrt{2\log(1/\delta)})/\varepsilon_G\big)^2\big\rceil$.

    Parameters
    ----------
    eps, delta, dim, radius
        As in `rahimi_recht_features`.

    Returns
    -------
    int

    References
    ----------
    Sriperumbudur & Szabó, NIPS 2015, arXiv:1506.02155, Theorem 1 (constants recalled).

    Examples
    --------
    >>> sriperumbudur_szabo_features(1.0, 0.1, 2, 0.5) > 1000
    True
    """
    e, dl, d, R = _check(eps, delta, dim, radius)
    eg = gaussian_level(e, R)
    S = 2.0 * R
    L = math.log(2.0 * S + 1.0)
    h = (
        32.0 * math.sqrt(2.0 * d * L)
        + 32.0 * math.sqrt(2.0 * d * math.log(math.sqrt(d) + 1.0))
        + 16.0 * math.sqrt(2.0 * d / L)
    )
    return _ceil(((h + math.sqrt(2.0 * math.log(1.0 / dl))) / eg) ** 2)


def performer_theorem4_features(
    eps: float, delta: float, dim: int, radius: float, *, constant: float = 1.0
) -> int:
    r"""Performer Theorem 4 (trig features with orthogonal rows): ``r`` up to its unknown Θ constant.

    SOURCE (arXiv:2009.14794, Thm 4; general form Thm 7, App. F.5). For raw queries/keys with
    $\|q_i\|,\|k_j\|\le R_P$ and $\mathbf A = \exp(QK^\top/\sqrt d)$, let
    $l = R_Pd^{-1/4}$, $h^*=e^{l^2/2}$, $\delta_P = \varepsilon/(h^*)^2$; then

    $$
    m = \Theta\Big(\frac{d}{\delta_P^2}\log\frac{4d^{3/4}R_P}{\delta_P}\Big)
    \ \Rightarrow\ \|\hat{\mathbf A}-\mathbf A\|_\infty\le\varepsilon
    $$

    "with any constant probability". Here ``radius`` = $R$ bounds the *scaled* inputs, so
    $R_P = R d^{1/4}$, $l = R$ and $\delta_P = \varepsilon e^{-R^2}$ (the same
    $\varepsilon_G$); the returned value is
    $\lceil c\,\frac{d}{\delta_P^2}\log\frac{4 d R}{\delta_P}\rceil$ (at least 1).

    The Θ constant ``c`` is not given in the paper: ``constant=1.0`` is a placeholder, so this is
    the *shape* of the requirement (for plotting against measurements), not a guarantee
    (``CONSTANT_STATUS["performer"] == "SHAPE-ONLY"``): comparing it with a measured $r^*$ is
    not a validity check, whichever side the measurement falls on. The
    failure probability ``delta`` does not appear in the theorem (it is absorbed in the constant):
    it is validated and otherwise ignored. The OpenReview version states $\|\cdot\|_1$
    where arXiv v4 states $\|\cdot\|_\infty$.

    Parameters
    ----------
    eps, delta, dim, radius
        As in `rahimi_recht_features`.
    constant : float, default 1.0
        The unknown Θ constant ``c`` > 0.

    Returns
    -------
    int

    References
    ----------
    Choromanski et al., ICLR 2021, arXiv:2009.14794, Theorems 4 and 7.

    Examples
    --------
    >>> performer_theorem4_features(0.5, 0.1, 16, 0.5, constant=2.0) > performer_theorem4_features(0.5, 0.1, 16, 0.5)
    True
    """
    e, dl, d, R = _check(eps, delta, dim, radius)
    c = _number("constant", constant)
    if c <= 0:
        raise ValueError(f"constant must be > 0, got {c}")
    dp = gaussian_level(e, R)
    val = c * d / dp**2 * math.log(4.0 * d * R / dp)
    return _ceil(val)


_FUNCS = {
    "rahimi-recht": rahimi_recht_features,
    "sriperumbudur-szabo": sriperumbudur_szabo_features,
    "performer": performer_theorem4_features,
}


@_deprecated_keywords(kind="estimator")
def required_features_uniform(
    estimator: Any,
    eps: float,
    delta: float,
    dim: int,
    radius: float,
    *,
    bound: str = "rahimi-recht",
    constant: float = 1.0,
) -> int:
    r"""Number of trig projections for $\sup_{B(R)}|\hat K - e^{x^\top y}|\le\varepsilon$ w.p. $1-\delta$.

    Dispatches to `rahimi_recht_features`, `sutherland_schneider_features`,
    `sriperumbudur_szabo_features` or `performer_theorem4_features` (see each for
    its formula and source tag); all use $\varepsilon_G = \varepsilon e^{-R^2}$ on a set of
    diameter $2R$.

    Parameters
    ----------
    estimator : str or FeatureMap
        An estimator with uniform bounds (``"trig-sincos"``, ``"trig-offset"``) or such a
        feature map (``TrigRF``). Positive/hyperbolic features have no uniform bound here
        (Performer Theorem 4 is about trig features with ORF): ``ValueError``.
    eps : float
        Absolute sup error, > 0.
    delta : float
        Failure probability, in (0, 1).
    dim : int
    radius : float
        Bound on the norms of the (attention-scaled) inputs, > 0.
    bound : {"rahimi-recht", "sutherland-schneider", "sriperumbudur-szabo", "performer"}
    constant : float, default 1.0
        Θ constant of the Performer bound (ignored by the others).

    Returns
    -------
    int

    Examples
    --------
    >>> required_features_uniform("trig-sincos", 0.5, 0.05, 2, 0.5) == rahimi_recht_features(0.5, 0.05, 2, 0.5)
    True
    """
    variant = _variant(estimator)
    if bound not in UNIFORM_BOUNDS:
        raise ValueError(f"bound must be one of {UNIFORM_BOUNDS}, got {bound!r}")
    if bound == "sutherland-schneider":
        return sutherland_schneider_features(eps, delta, dim, radius, variant=variant)
    if bound == "performer":
        return performer_theorem4_features(eps, delta, dim, radius, constant=constant)
    return _FUNCS[bound](eps, delta, dim, radius)


def _variant(kind: Any) -> str:
    """The ``uniform_variant`` of an estimator name or a feature map (registry identity)."""
    from kernelapprox.maps.base import FeatureMap
    from kernelapprox.registry import estimator_of, get_estimator

    if isinstance(kind, str):
        est = get_estimator(kind)
    elif isinstance(kind, FeatureMap):
        est = estimator_of(kind)
    else:
        raise TypeError(f"estimator must be an estimator name or a feature map, got {type(kind).__name__}")
    th = est.theory
    variant = None if th is None else th.uniform_variant
    if variant is None:
        covered = [e.name for e in _uniform_estimators()]
        raise ValueError(
            f"no uniform-convergence bound for the {est.name!r} estimator here (covered: {covered}); "
            "Performer Theorem 4 and the other bounds are about trigonometric features; positive "
            "features only have pointwise results (use ka.theory.required_features)"
        )
    return variant


def _uniform_estimators() -> list:
    from kernelapprox.registry import estimators

    return estimators(closed_form="uniform", sampler="gaussian")  # the bounds are for iid rows
