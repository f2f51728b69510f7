"""The tool tested as a worker runs it, without a database, a broker or a worker."""

import labels  # noqa: F401  (importing the module registers its tools)

from charlie.domain import Outcome
from charlie.testing import ToolEnvironment


def test_print_label(tmp_path):
    env = ToolEnvironment(workspace=tmp_path)
    done = env.run("print_label", order_id="A17", address="1 Main St")
    assert done.outcome is Outcome.OK
    assert done.result == {"label": "labels/A17.txt"}
    # killed after the label was printed: the hook finds it, and the call settles ok
    found = env.reconcile("print_label", order_id="A17", address="1 Main St")
    assert found.outcome is Outcome.OK
    # killed before: the model is told it was not printed
    missing = env.reconcile("print_label", order_id="B9", address="2 Side St")
    assert missing.outcome is Outcome.ERROR
    # a path outside the workspace is refused: an error the model sees, the run goes on
    escape = env.run("print_label", order_id="../../x", address="-")
    assert escape.outcome is Outcome.ERROR
