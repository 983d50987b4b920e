"""One module per CLI subcommand, exposing ``run(args)``: what the command does, imported only when it runs.

Each command's flags are registered by ``trainfit.commands.parsers.<name>`` (light modules only, so ``--help``
answers at once); the run flags they share, and turning them into a RunConfig, by ``trainfit.commands.flags``.
"""
