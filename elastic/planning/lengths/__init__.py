"""What the planner believes about response lengths, from epochs before the batch only.

    predict.py     `Predictor`: a predictive distribution per prompt from the history (`LengthDist`)
    guard.py       `TailGuard`: a calibrated upper bound on every length, and the KV reserve it sets
    remaining.py   `OnlineModel`: live responses' remaining lengths, re-estimated while the rollout runs
                   (tokens so far, finished siblings); `conditioned`: what is left of a carried response
"""
