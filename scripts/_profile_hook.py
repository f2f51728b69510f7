"""Loaded into a profiled worker (``--include _profile_hook``; scripts/profile_turn.py): a
cProfile of the worker's main thread, counting CPU time (``time.process_time``, so a loaded
machine's waiting is not counted), switched by a control file the driver writes.

At each task's prerun (a solo pool runs tasks, and consumes and publishes, in the main thread):
``PROFILE_CTL`` reading ``on`` starts the profile; ``off`` stops it and writes its stats to
``PROFILE_OUT`` (pstats' format).
"""

from __future__ import annotations

import cProfile
import os
import time
from pathlib import Path
from typing import Any

from celery.signals import task_prerun

_CTL = os.environ.get("PROFILE_CTL")
_OUT = os.environ.get("PROFILE_OUT")
_profile: cProfile.Profile | None = None


def _switch(**_: Any) -> None:
    global _profile
    if not _CTL or not _OUT:
        return
    try:
        wanted = Path(_CTL).read_text().strip()
    except OSError:
        return
    if wanted == "on" and _profile is None:
        _profile = cProfile.Profile(time.process_time)
        _profile.enable()
    elif wanted == "off" and _profile is not None:
        _profile.disable()
        _profile.dump_stats(_OUT + ".part")
        os.replace(_OUT + ".part", _OUT)
        _profile = None


task_prerun.connect(_switch, weak=False)
