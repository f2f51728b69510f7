"""The executor: pure phase functions (``phases/``) and the tick shell around them (``tick.py``)."""
