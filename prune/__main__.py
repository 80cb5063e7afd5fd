"""`python -m prune` is the `prune` command."""

from .cli import main

raise SystemExit(main())
