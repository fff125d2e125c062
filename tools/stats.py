"""tools/stats.py: the small-sample statistics of the miniature's comparisons, in plain Python.

  t_quantile, t_interval   Student's t quantile (by bisection on its CDF, the regularised incomplete
                           beta function) and the t-based interval of a mean
  sign_flip_p              the exact paired test: every one of the 2^n sign patterns of the paired
                           differences, on their mean (two-sided, or one-sided "greater")
  holm                     Holm's step-down adjustment for a family of p-values
  clustered_bootstrap      a percentile interval of a mean difference over a seeds x prompts grid,
                           resampling seeds and prompt clusters (digit triples) both
  value_at_level           a trajectory's y where its x first reaches a level (the frontier's
                           matched comparison)

No scipy: the project's packages do not include it, and these few functions are short.
"""

import itertools
import math
import random
import statistics


def _continued_fraction(a, b, x):
    """The continued fraction of the incomplete beta function (modified Lentz), converging for
    x < (a + 1) / (a + b + 2)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return result


def regularized_beta(x, a, b):
    """I_x(a, b), the regularised incomplete beta function, for 0 <= x <= 1."""
    if x <= 0.0 or x >= 1.0:
        return float(x >= 1.0)
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _continued_fraction(b, a, 1.0 - x) / b


def t_cdf(t, df):
    """P(T <= t) for Student's t with df degrees of freedom."""
    tail = 0.5 * regularized_beta(df / (df + t * t), df / 2, 0.5)
    return 1.0 - tail if t > 0 else tail


def t_quantile(p, df):
    """The t with P(T <= t) = p (0 < p < 1), by bisection to 1e-12."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must lie in (0, 1), got {p}")
    low, high = -1.0, 1.0
    while t_cdf(low, df) > p:
        low *= 2
    while t_cdf(high, df) < p:
        high *= 2
    while high - low > 1e-12 * max(1.0, abs(low)):
        middle = (low + high) / 2
        low, high = (middle, high) if t_cdf(middle, df) < p else (low, middle)
    return (low + high) / 2


def t_interval(values, level=0.95):
    """(mean, low, high): the t-based interval of the mean of values (n >= 2)."""
    n = len(values)
    if n < 2:
        raise ValueError("a t interval needs at least two values")
    mean = statistics.fmean(values)
    half = t_quantile(0.5 + level / 2, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return mean, mean - half, mean + half


def sign_flip_p(differences, alternative="two-sided"):
    """The exact p-value of "the paired differences are symmetric about zero": the fraction of the
    2^n sign patterns whose mean is at least as far from zero as the observed one (two-sided), or
    at least as large (alternative "greater": a non-inferiority test once a margin has been added to
    each difference). With n = 8 the smallest two-sided p is 2/256."""
    n = len(differences)
    if not 1 <= n <= 20:
        raise ValueError(f"the exact test enumerates 2^n patterns: n = {n} is out of range")
    if alternative not in ("two-sided", "greater"):
        raise ValueError(f"alternative must be 'two-sided' or 'greater', got {alternative!r}")
    magnitudes = [abs(d) for d in differences]
    measure = abs if alternative == "two-sided" else (lambda total: total)
    observed = measure(sum(differences)) - 1e-12 * sum(magnitudes)  # ties count as extreme
    extreme = sum(measure(sum(s * m for s, m in zip(signs, magnitudes))) >= observed
                  for signs in itertools.product((1, -1), repeat=n))
    return extreme / 2 ** n


def holm(p_values):
    """Holm's adjusted p-values, in the input's order: the i-th smallest p times (m - i + 1),
    made monotone and capped at 1. Reject where the adjusted p is <= alpha."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def clustered_bootstrap(differences, clusters, resamples=2000, level=0.95, seed=0):
    """A percentile interval of the grand mean of differences[seed][prompt], resampling both the
    seeds (rows) and the prompt clusters (clusters[prompt]: e.g. its digit triple) with
    replacement: prompts sharing a cluster are not independent, nor are a seed's prompts.
    Returns (mean, low, high, standard error of the resampled means)."""
    rows = len(differences)
    members = {}
    for prompt, cluster in enumerate(clusters):
        members.setdefault(cluster, []).append(prompt)
    groups = list(members.values())
    # per seed and cluster: the sum and count of its prompts' differences
    sums = [[sum(row[p] for p in group) for group in groups] for row in differences]
    sizes = [len(group) for group in groups]
    rng = random.Random(seed)
    means = []
    for _ in range(resamples):
        chosen_rows = [rng.randrange(rows) for _ in range(rows)]
        chosen_groups = [rng.randrange(len(groups)) for _ in range(len(groups))]
        count = sum(sizes[g] for g in chosen_groups)
        means.append(sum(sums[r][g] for r in chosen_rows for g in chosen_groups) / (rows * count))
    means.sort()
    tail = (1 - level) / 2
    low = means[int(math.floor(tail * (resamples - 1)))]
    high = means[int(math.ceil((1 - tail) * (resamples - 1)))]
    grand = statistics.fmean(x for row in differences for x in row)
    return grand, low, high, statistics.stdev(means)


def value_at_level(xs, ys, level):
    """Along a trajectory of points (xs[i], ys[i]), the y where x first reaches level, linear
    between points; None if x never reaches it."""
    for i, (x, y) in enumerate(zip(xs, ys)):
        if x >= level:
            if i == 0:  # before it, x was below the level: x > xs[i - 1]
                return y
            x0, y0 = xs[i - 1], ys[i - 1]
            return y0 + (level - x0) * (y - y0) / (x - x0)
    return None
