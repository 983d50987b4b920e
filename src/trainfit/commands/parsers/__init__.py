"""The command line's parsers, one module per command, each exposing ``register(subparsers)``.

They import only light modules (the vocabulary, the config's facts, the run flags), never torch, numpy or the
front door: ``trainfit --help`` and ``trainfit CMD --help`` answer in a fraction of a second, and the command's
own module (``trainfit.commands.CMD``, which imports what it runs) is imported only when the command runs
(``trainfit.cli.run_command``). A fact whose home imports torch is mirrored here, named as such, and the mirror
is checked against its home by ``tests/test_help_speed.py``.
"""
