"""Any module whose forward torch.fx can trace, as layers that partime cuts: the graph, its segments, what a cut holds and each stage fused.

Everything here is internal to partime unless ``partime`` exports it.
"""
