"""``partime fidelity``: what learning with delay costs, sequential against pipelines, and the live view.

Everything here is internal to partime unless ``partime`` exports it.
"""
