"""`python -m services.cli`: the `corestream` command without its console script."""

from services.cli.main import entry

entry()
