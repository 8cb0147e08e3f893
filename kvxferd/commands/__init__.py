"""One module per ``kvxferd`` subcommand: ``add_parser(subparsers)`` and a ``run(args)``."""
