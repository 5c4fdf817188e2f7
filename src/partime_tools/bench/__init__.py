"""``partime bench``: partime against the plain model, replicas and torch.distributed.pipelining, interleaved in one run.

Everything here is internal to partime unless ``partime`` exports it.
"""
