"""Will a job of D days survive its restart budget? Fixed counts against the no-progress rule.

    survival = job_survival(costs, days=30, recovery_seconds=26.0)
    survival["fixed"][9], survival["by_progress"][3]      # probabilities in [0, 1]
    simulate_survival(costs, days=30, recovery_seconds=26.0, rule=("fixed", 9), jobs=2000, seed=0)

Faults arrive as a Poisson process at the job's rate (nodes / node MTBF), N ~ Poisson(λ = D / job MTBF).

- A fixed count of B restarts (ft_launcher's --max-restarts times the JobSet's maxRestarts, as the project
  had it) survives when N ≤ B: the Poisson CDF.
- The no-progress rule (trainer.resilience.budget) ends a job only after L recoveries in a row that did not
  advance the state. A recovery fails to advance when the next fault arrives before it has restarted,
  reloaded and saved its first new copy — within `recovery_seconds` of the fault — which happens with
  p = 1 − exp(−recovery_seconds / job MTBF) independently per fault (the gaps are exponential). A job dies
  when some fault opens a run of L such gaps: per fault p^L, so survival ≈ exp(−λ · p^L) (rare chains
  thin a Poisson process). The simulator counts the chains directly.

A crash loop (a fault that recurs at the same step) is not in these figures: the rule exists to end it.
"""

from __future__ import annotations

import math
import random

from trainer.planning.goodput import HOUR, Costs, PlanError

DAY = 24 * HOUR
FIXED_BUDGETS = (9, 30, 100)  # 9: the project's EKS budget before the rule (JobSet 2 x ft_launcher 3 + 3)
PROGRESS_LIMITS = (2, 3, 5)


def expected_faults(costs: Costs, days: float) -> float:
    return days * DAY / costs.job_mtbf_seconds


def poisson_cdf(k: int, mean: float) -> float:
    """P(N <= k) for N ~ Poisson(mean), summed in log space (mean may be in the thousands)."""
    if mean == 0:
        return 1.0
    total, term = 0.0, -mean  # log of P(N = 0)
    for n in range(k + 1):
        if n:
            term += math.log(mean) - math.log(n)
        total += math.exp(term)
    return min(1.0, total)


def poisson_quantile(mean: float, probability: float) -> int:
    """The smallest k with P(N <= k) >= probability."""
    k = 0
    while poisson_cdf(k, mean) < probability:
        k += 1
    return k


def no_progress_probability(costs: Costs, recovery_seconds: float) -> float:
    """The chance that the next fault arrives before a recovery has advanced the state."""
    return 1.0 - math.exp(-recovery_seconds / costs.job_mtbf_seconds)


def job_survival(costs: Costs, days: float, recovery_seconds: float, fixed=FIXED_BUDGETS,
                 limits=PROGRESS_LIMITS) -> dict:
    """{"expected_faults", "no_progress_probability", "fixed": {B: p}, "by_progress": {L: p}}."""
    if not (days > 0 and recovery_seconds > 0):
        raise PlanError(f"days (--work-days): must be > 0, got {days!r}; recovery_seconds must be > 0")
    mean = expected_faults(costs, days)
    p = no_progress_probability(costs, recovery_seconds)
    return {"days": days, "expected_faults": mean, "recovery_seconds": recovery_seconds, "no_progress_probability": p,
            "fixed": {budget: poisson_cdf(budget, mean) for budget in fixed},
            "by_progress": {limit: math.exp(-mean * p**limit) for limit in limits}}


def pod_restart_budget(costs: Costs, days: float, probability: float = 0.999) -> int:
    """JobSet maxRestarts for a job of `days`: gang restarts come from faults that take a pod (node and rack
    classes; ft_launcher restarts the rest in the pod); the budget covers their count with `probability`. The
    no-progress rule, not this count, ends crash loops (exit code 42 fails the JobSet at once)."""
    share = costs.fault_mix.get("node", 0.0) + costs.fault_mix.get("rack", 0.0)
    return poisson_quantile(expected_faults(costs, days) * share, probability)


def simulate_survival(costs: Costs, days: float, recovery_seconds: float, rule: tuple[str, int], jobs: int = 2000,
                      seed: int = 0) -> float:
    """The fraction of `jobs` seeded jobs that end under `rule` = ("fixed", B) or ("progress", L)."""
    kind, budget = rule
    if kind not in ("fixed", "progress") or budget < 0:
        raise PlanError(f"rule: {rule!r} is not ('fixed', B) or ('progress', L)")
    rng = random.Random(seed)
    horizon, mtbf = days * DAY, costs.job_mtbf_seconds
    survived = 0
    for _ in range(jobs):
        now, faults, streak, alive = rng.expovariate(1 / mtbf), 0, 0, True
        while now < horizon:  # a fault: its recovery starts, or the budget says no
            faults += 1
            if (kind == "fixed" and faults > budget) or (kind == "progress" and streak >= budget):
                alive = False
                break
            gap = rng.expovariate(1 / mtbf)
            # The next fault comes before this recovery advanced the state: one more in a row without progress.
            streak = streak + 1 if gap < recovery_seconds else 0
            now += gap
        survived += alive
    return survived / jobs
