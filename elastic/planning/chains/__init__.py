"""Quorum schedules and the search over them: which chain of groups a rollout shrinks through.

    schedule.py   the safe chains from W ranks down to the floor, and each stage's expert owners
    estimate.py   a chain's predicted rollout time and release area over samples of the lengths
    search.py     `ChainSearch`: the best chain under an objective (`objective_key`)
"""
