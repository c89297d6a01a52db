"""Tensor parallelism on torch.distributed: how a model's shapes split over ranks (`sharding`),
the process group and its collectives (`group`), the per-step commands rank 0 sends the other
ranks (`commands`), and the rank processes themselves (`workers`)."""
