"""The front door: one library function per command, typed request in, typed report out.

``trainfit.plan``, ``trainfit.estimate_memory`` / ``trainfit.measure_memory``, ``trainfit.profile``,
``trainfit.verify``, ``trainfit.train`` and ``trainfit.prepare`` live here (one module per command); the
command line only turns flags and TOML into their arguments and prints what they return. A notebook, a
callback and the CLI all call the same functions.
"""
