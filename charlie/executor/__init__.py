"""The executor: pure phase functions (``phases/``, ``boundary.py``) and the shell around them:
``tick.py`` (one tick, the inline chain) → ``invoke.py`` (one tool call) → ``settle.py`` (settle
a call and move its turn). It imports nothing of the API, the sweeps or the worker shell."""
