"""Checkpoints: a pipeline's whole state as plain values, its files, and the format that refuses a damaged one.

Everything here is internal to partime unless ``partime`` exports it.
"""
