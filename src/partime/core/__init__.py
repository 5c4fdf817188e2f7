"""What SPEC.md defines, written once for every executor: the tick schedule, what one stage does in one tick, a stage with its learning, random stream and records, and what crosses a boundary.

Everything here is internal to partime unless ``partime`` exports it.
"""
