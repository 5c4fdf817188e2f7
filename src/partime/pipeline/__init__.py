"""The ``Pipeline`` class (``pipeline.py``, exported as ``partime.Pipeline``) and what it alone
uses: its argument checks, the state of its stream, how it reads a stream's arrivals and
samples, SIGTERM while it is open, and the warning that it skips most samples.

Everything here but ``Pipeline`` is internal to partime.
"""
