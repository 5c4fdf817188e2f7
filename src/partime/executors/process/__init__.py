"""The process executor: one OS process per stage but the last, shared-memory channels and the semaphores they use.

Everything here is internal to partime unless ``partime`` exports it.
"""
