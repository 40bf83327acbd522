"""Tensor/expert parallelism: the rank group and its collectives (`collectives`, the only module
that calls torch.distributed), and the processes of the ranks (`ranks`)."""
