"""The embedded broker: kombu's filesystem transport, made safe for several processes.

It needs no server, and worker, beat and producer processes on one machine share its queue
directory. Two changes to the stock transport:

- a message file is written under a temporary name and renamed into place, so a consumer never
  reads a half-written message;
- a consumer claims a message by renaming it within the same directory, which exactly one
  process can win, instead of moving it to the system temp directory (a copy across
  filesystems, which two consumers can both perform).

Messages a killed worker had taken are lost, as on any broker that deletes on receipt: Charlie's
correctness comes from the database and the beat sweep (I4), never from redelivery.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from queue import Empty
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads

from charlie.home import open_private, private_dir

SCHEME = "charliefs"


class Channel(filesystem.Channel):
    _backlog: dict[str, list[str]]

    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        folder = self.data_folder_out
        final = f"{round(monotonic() * 1000):015d}_{uuid.uuid4().hex}.{queue}.msg"
        tmp = os.path.join(folder, f"tmp-{uuid.uuid4().hex}")
        try:
            # 0600 whatever the umask: a message carries a task's prompt or a person's reply
            with os.fdopen(open_private(Path(tmp), os.O_WRONLY | os.O_EXCL), "wb", 0) as f:
                f.write(str_to_bytes(dumps(payload)))
            os.rename(tmp, os.path.join(folder, final))
        except OSError as exc:
            raise ChannelError(f"cannot add message to {folder!r}: {exc}") from exc

    def _get(self, queue: str) -> Any:
        suffix = f".{queue}.msg"
        folder = self.data_folder_in
        backlog = self.__dict__.setdefault("_backlog", {}).setdefault(queue, [])
        if not backlog:
            # One listing serves many gets: with a deep queue, listing per message is quadratic.
            backlog.extend(sorted(n for n in os.listdir(folder) if n.endswith(suffix)))
        while backlog:
            name = backlog.pop(0)
            src = os.path.join(folder, name)
            claimed = os.path.join(folder, f"claimed-{uuid.uuid4().hex}")
            try:
                os.rename(src, claimed)
            except OSError:
                continue  # another consumer won it
            try:
                with open(claimed, "rb") as f:
                    payload = f.read()
            finally:
                os.unlink(claimed)
            return loads(bytes_to_str(payload))
        raise Empty()

    def _size(self, queue: str) -> int:
        suffix = f".{queue}.msg"
        return sum(1 for n in os.listdir(self.data_folder_in) if n.endswith(suffix))


class Transport(filesystem.Transport):
    Channel = Channel
    driver_type = "charliefs"
    driver_name = "charliefs"


def register() -> None:
    TRANSPORT_ALIASES[SCHEME] = "charlie.broker:Transport"


def transport_options(broker_dir: Path, polling_interval: float) -> dict[str, Any]:
    queue_dir = broker_dir / "queue"
    control = broker_dir / "control"
    for d in (queue_dir, control):
        private_dir(d)
    return {
        "data_folder_in": str(queue_dir),
        "data_folder_out": str(queue_dir),
        "control_folder": str(control),
        "polling_interval": polling_interval,
    }
