"""Charlie's benchmark (``python scripts/bench.py``), one module per figure.

``harness`` holds what every figure shares (backends, processes, storage, statistics and
:class:`~benchmarks.harness.CellBase`, one backend's run); each figure module holds a mixin whose
method of the figure's name measures it (``--only NAME`` runs that method) and the ``ROWS`` it
fills in the table; ``table`` lists every module's rows in the order printed; ``runner`` puts the
mixins together into ``Cell`` and runs the parent and the per-backend children. Adding a figure:
docs/benchmarks.md, "Adding a figure".
"""
