"""The levers, one module each with a pure core and a thin torch shell: precision (+ the loss scaler),
accumulation, activation checkpointing, and auto-fit (the run-time micro-batch shrink on out-of-memory).

Rule: a lever imports the foundation and the meters; it is handed the model, optimizer or run it acts on,
never builds one.
"""
