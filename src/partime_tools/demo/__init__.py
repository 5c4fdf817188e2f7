"""``partime demo``: a recorded and a live stream learnt by a pipeline beside the plain model.

Everything here is internal to partime unless ``partime`` exports it.
"""
