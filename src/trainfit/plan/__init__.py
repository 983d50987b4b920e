"""The planner: choose precision, micro-batch, accumulation, checkpointing and strategy before running.

Pure: it takes a basis (bytes, FLOPs, activations per sample) and device/link facts given to it as values and
returns ranked plans with reasons. Rule: it imports only the foundation's pure modules (errors, units,
vocabulary, presets) and itself -- never torch, the run, the engine or a probe; what must be measured to
feed it is a probe (:mod:`trainfit.probes.calibrate`).
"""
