"""The `corestream` command: argument parsing for every service, and `corestream admin`."""
