"""Where to cut a model and into how many stages: checking a balance, timing layers, what a boundary costs, the cut and the depth, and the measured check of ``balance="auto"``.

Everything here is internal to partime unless ``partime`` exports it.
"""
