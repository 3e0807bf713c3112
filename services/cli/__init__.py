"""The `corestream` command: argument parsing for every service, and `corestream admin`."""

import sys

from services.common import grpc_experiments

# Before any of the command's modules imports grpc, which reads it once (the module says
# why, and why the frontend only). `python -m services.cli frontend` and the console
# script alike have the command in argv[1] while this package is imported.
if sys.argv[1:2] == ["frontend"]:
    grpc_experiments.apply()
