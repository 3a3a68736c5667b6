"""pass@k: the probability that at least one of k samples solves a problem, estimated without bias.

Chen et al. 2021, "Evaluating Large Language Models Trained on Code" (arXiv:2107.03374), §2.1:
draw ``n >= k`` samples per problem, count the ``c`` correct ones, and estimate

    pass@k = E_problems[ 1 - C(n - c, k) / C(n, k) ]

(the chance that a k-subset drawn without replacement from the n samples holds a correct one). The
binomial coefficients overflow for large n, so, as in the paper's Figure 3, the ratio is computed as
a product:

    C(n - c, k) / C(n, k) = prod_{i = n - c + 1}^{n} (1 - k / i)      (= 0 when n - c < k)

No deviation from the paper. The naive ``1 - (1 - c / n) ** k`` (sampling with replacement) is
biased low for k > 1 and is not used.
"""
from __future__ import annotations

from collections.abc import Iterable


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem.

    Args:
        n: samples drawn for the problem (``n >= k``).
        c: how many of them are correct (``0 <= c <= n``).
        k: the budget of attempts.

    Returns:
        ``1 - C(n - c, k) / C(n, k)``, in [0, 1].

    Raises:
        ValueError: ``k < 1``, ``k > n`` or ``c`` outside ``[0, n]``.
    """
    if k < 1 or k > n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """pass@k averaged over problems (each weighs the same).

    Args:
        counts: ``(n, c)`` per problem: samples drawn and correct ones.
        k: the budget of attempts (``<= n`` of every problem).

    Returns:
        The mean of :func:`pass_at_k` over the problems; NaN when there are none.
    """
    values = [pass_at_k(n, c, k) for n, c in counts]
    return sum(values) / len(values) if values else float("nan")
