"""Collectives across the ranks of one model: data parallel (expert parallelism) and
tensor parallel.

`collectives` is the one collective interface (gloo, NCCL on CUDA through `nccl`);
`dp_group` and `tp_group` are the process's DP and TP groups built on it.
`expert_parallel` shards experts over the DP group and moves tokens to them,
`dummy_batch` is the empty forward an idle DP rank runs so that its collectives still
line up with the busy ranks'. The tensor-parallel layers live with the models
(`services.engine.models.tp_layers`).
"""
