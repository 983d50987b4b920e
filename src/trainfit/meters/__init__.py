"""Meters: instruments that know nothing of a run -- the memory tracker, phase timers, FLOP counter, and the
device and hardware facts. They wrap a step from outside; the step does not know it is measured.

Rule: a meter imports only the foundation (errors, units, vocabulary, presets, tasks) and torch -- never the
engine, the run, a probe or the planner.
"""
