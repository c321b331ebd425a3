"""The ``binbatch`` subcommands, one module per command group.

Each module has ``register(subparsers)``: it adds its commands, their flags and
their handlers (``func``) to the top-level parser that ``binbatch_sidecar.cli``
builds. Every command has a one-line ``help`` (listed by ``binbatch --help``) and
a ``description`` (its own ``--help``), worded as the docs name it.
"""
