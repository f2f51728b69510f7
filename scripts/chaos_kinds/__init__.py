"""The chaos round (``python scripts/chaos.py``), one module per fault kind.

``kills`` (SIGKILL of workers), ``messages`` (I22), ``verdicts`` (I23, I24, I27), ``waiting``
(I25), ``forks`` (I26) and ``mcp`` each hold what the kind does to the run and its checker;
``person`` is the thread that plays the people's parts of every kind; ``harness`` the plans and
shared reads, ``checks`` the run-wide checker and its table, ``runner`` the options and the run.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the cluster and the fake tools live in the repository's tests/support
sys.path.insert(0, str(REPO))
