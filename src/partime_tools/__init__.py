"""partime's tools: the ``partime`` command, the benchmarks (``bench/``), the fidelity runs
(``fidelity/``), the demo (``demo/``) and the soak run.

They are users of the library, not parts of it, and need the ``tools`` extra (click, rich,
scikit-learn, Pillow, matplotlib, psutil): ``pip install partime[tools]``. Importing
``partime`` loads none of this package.

They reach the library through its public names (``partime.Pipeline``, ``partime.sources``,
``partime.streams``, ``partime.metrics``, ``partime.Partition``) and, where they measure or
reproduce what lies below a ``Pipeline``, through the one seam ``partime.internals`` and nothing
deeper: the planner (the cut a pipeline would choose, timed with the threads it would use), a
``Stage`` and its own tick (for the bench's bound), what ``"auto"`` chooses, the layers of a
traced model, the same drop policy for a plain loop (``newest``), and the process executor's
channels, semaphores and ``keep_freed_memory`` (the bench's replicas run on the same transport as
the pipelines they are compared with, and the distributed bench on the same links between ranks).
``tests/test_imports.py`` holds them to it.
"""
