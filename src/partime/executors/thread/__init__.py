"""The thread executor: one thread per stage in the caller's process.

Everything here is internal to partime unless ``partime`` exports it.
"""
