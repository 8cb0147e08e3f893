"""``python -m kvxferd`` runs the CLI."""

from kvxferd.cli import main

raise SystemExit(main())
