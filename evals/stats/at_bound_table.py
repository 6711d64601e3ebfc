"""Each gate statistic's split of a look's error between its PASS end and its FAIL end, written by
evals/stats/at_bound.py from the simulation with the truth on the policy's bound: do not edit by hand.

(placeholder until the simulation writes it: an even split, the two-sided interval the sign-off used before)
"""

SIDE_SHARES = {"kld": (0.5, 0.5), "nll": (0.5, 0.5), "bounded": (0.5, 0.5), "binary": (0.5, 0.5)}
