"""partime's tools: the ``partime`` command, the benchmarks (``bench/``), the fidelity runs
(``fidelity/``), the demo (``demo/``) and the soak run.

They are users of the library, not parts of it, and need the ``tools`` extra (click, rich,
scikit-learn, Pillow, matplotlib, psutil): ``pip install partime[tools]``. Importing
``partime`` loads none of this package.

They reach the library through its public names (``partime.Pipeline``, ``partime.sources``,
``partime.streams``, ``partime.metrics``) and, where they measure or reproduce what lies below a
``Pipeline``, through one seam of internal modules, which a change to them must keep working for
the tools: the planner and its ``Partition`` (the cut a pipeline would choose, timed with the
threads it would use), ``core.stage`` (a stage's own tick, for the bench's bound),
``learning.compensation`` (what ``"auto"`` chooses), ``traced`` (the layers of a traced model),
``pipeline.arrivals`` (the same drop policy for a plain loop), and the process executor's
channels, semaphores and ``executors.malloc`` (the bench's replicas run on the same transport as
the pipelines they are compared with, and the distributed bench on the same links between ranks).
"""
