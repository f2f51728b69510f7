"""Export a recorded task and replay it with today's code (I35; docs/replay.md).

- ``case``: the case file's format, how it is read back, and the scrubbing of secrets;
- ``engine``: the replay, driving the phase functions with ports that answer from the record;
- ``export``: ``charlie export``, the record read through the API into a case.

``charlie.testing.replay`` is the face of it for a test suite.
"""
