"""partime's tools: the ``partime`` command, the benchmarks, the demo, the fidelity and soak runs.

They are users of the library, not parts of it, and need the ``tools`` extra (click, rich,
scikit-learn, Pillow, matplotlib, psutil): ``pip install partime[tools]``. Importing
``partime`` loads none of this package.
"""
