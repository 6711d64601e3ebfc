"""Statistics of paired comparisons: intervals, their simulated coverage, llama.cpp-style token figures."""
