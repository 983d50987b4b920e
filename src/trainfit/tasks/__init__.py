"""Tasks: model + data + loss. Built-ins, ``hf:Class`` (transformers) and ``module:callable``.

``tasks.make`` builds them (``make_task``, ``task_of``); ``tasks.spec`` says what data a job reads, without torch.
This package module imports nothing, so a pure submodule loads without torch (``trainfit plan`` from its cache).
"""
