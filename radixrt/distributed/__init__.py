"""Tensor parallelism on torch.distributed: how a model's shapes split over ranks (`sharding`),
the process group and its collectives (`group`), and the per-step commands rank 0 sends the other
ranks (`commands`). The rank processes themselves are `radixrt.executor.tp_worker`'s."""
