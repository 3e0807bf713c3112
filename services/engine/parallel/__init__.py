"""Collectives across the data-parallel ranks of one model (expert parallelism).

`dp_group` owns the process group, `expert_parallel` shards experts over it and
moves tokens to them, `nccl` is the CUDA transport, `dummy_batch` the empty forward
an idle rank runs so that its collectives still line up with the busy ranks'.
"""
