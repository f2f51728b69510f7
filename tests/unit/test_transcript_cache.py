"""The transcript cache remembers where a run's newest compaction is, found as items are put,
so that a model call's planning need not walk the whole transcript for it (I29)."""

from __future__ import annotations

import pytest

from charlie.domain import Item, ItemKind
from charlie.store.transcripts import TranscriptCache

pytestmark = pytest.mark.backend_free


def item(seq: int, kind: ItemKind = ItemKind.TOOL_RESULT) -> Item:
    return Item(seq, 0, kind, None, {"content": str(seq)})


def test_the_newest_compaction_is_found_as_the_prefix_grows() -> None:
    cache = TranscriptCache()
    items = [item(n) for n in range(5)]
    cache.put("x", "run", items)
    assert cache.remembered("x", "run") == (tuple(items), -1)
    items += [item(5, ItemKind.COMPACTION), item(6)]
    cache.put("x", "run", items)
    assert cache.remembered("x", "run")[1] == 5
    items += [item(n) for n in range(7, 10)]
    cache.put("x", "run", items)
    assert cache.remembered("x", "run") == (tuple(items), 5)
    items += [item(10, ItemKind.COMPACTION)]
    cache.put("x", "run", items)
    assert cache.remembered("x", "run")[1] == 10


def test_a_prefix_put_anew_is_walked_whole() -> None:
    """Items that are not the remembered objects (read again from the database) are checked
    and searched from the start."""
    cache = TranscriptCache()
    cache.put("x", "run", [item(0), item(1, ItemKind.COMPACTION), item(2)])
    again = [item(0), item(1, ItemKind.COMPACTION), item(2), item(3)]
    cache.put("x", "run", again)
    assert cache.remembered("x", "run") == (tuple(again), 1)
    plain = [item(0), item(1), item(2), item(3), item(4)]  # read anew: no compaction now
    cache.put("x", "run", plain)
    assert cache.remembered("x", "run") == (tuple(plain), -1)


def test_another_runs_items_are_not_its_compactions() -> None:
    cache = TranscriptCache()
    cache.put("x", "run", [item(0), item(1, ItemKind.COMPACTION)])
    assert cache.remembered("x", "other incarnation") == ((), -1)
    assert cache.remembered("x", "run") == ((), -1)  # forgotten with it
    cache.put("y", "run", [item(0), item(2)])  # misnumbered: not remembered
    assert cache.remembered("y", "run") == ((), -1)
