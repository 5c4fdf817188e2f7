"""The distributed executor: one stage per torch.distributed rank, started by torchrun; what every rank shares, the plan rank 0 publishes, and the links between ranks.

Everything here is internal to partime unless ``partime`` exports it.
"""
