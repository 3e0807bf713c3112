"""Collectives across the ranks of one model: data parallel (expert parallelism) and
tensor parallel.

`collectives` is the one collective interface (gloo, NCCL on CUDA through `nccl`);
`dp_group` and `tp_group` are the process's DP and TP groups built on it.
`expert_parallel` shards experts over the DP group and moves tokens to them. Users of
these live elsewhere: the tensor-parallel layers with the models
(`services.engine.models.tp_layers`), the empty forward of an idle DP rank with the
worker (`services.engine.worker.dummy_batch`), and the tensor-parallel executor and
its worker processes in `services.engine.executor`.
"""
