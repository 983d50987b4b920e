"""Probes: build and step a :class:`~trainfit.run.Run` to learn something about it -- memory (measured and
estimated), the batch-size fit, profile and its advice, verify, and the planner's calibration. Each returns a
typed result (:mod:`trainfit.results`).

Rule: a probe steps a run only through ``run.step``; it may import anything below it (run, engine, levers,
strategies, meters, plan) but nothing above (report, commands).
"""
