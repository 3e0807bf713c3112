"""The `corestream` command: argument parsing for every service, and `corestream admin`."""

from services.common import grpc_experiments

# Before any of the command's modules imports grpc, which reads it once (the module says why).
grpc_experiments.apply()
