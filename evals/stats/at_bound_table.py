"""Each gate statistic's split of a look's error between its PASS end and its FAIL end, written by
evals/stats/at_bound.py from the simulation with the truth on the policy's bound: do not edit by hand.

Regenerate with: python -m qtoolkit.evals.stats.at_bound --output measurements/2026-12-04/issue39/at-bound.json --runs 20000 --resamples 2000 --seed 0 --table evals/stats/at_bound_table.py
"""

ONE_LOOK, SEVERAL_LOOKS = "one look", "several looks"
# statistic -> schedule -> (share of a look's error spent by the PASS end, by the FAIL end)
SIDE_SHARES = {
    "kld": {ONE_LOOK: (0.07, 0.99), SEVERAL_LOOKS: (0.09, 1.47)},
    "nll": {ONE_LOOK: (0.16, 0.86), SEVERAL_LOOKS: (0.19, 1.03)},
    "bounded": {ONE_LOOK: (0.5, 1.07), SEVERAL_LOOKS: (0.28, 2.11)},
    "binary": {ONE_LOOK: (0.92, 0.55), SEVERAL_LOOKS: (1.57, 1.31)},
}
