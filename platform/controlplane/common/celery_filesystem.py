"""The broker-less Celery transport of the embedded default, whose messages appear whole or not at all.

Kombu's filesystem transport creates a message file under its final name and only then writes it, so a
consumer polling every 10 ms can take the file while it is still empty and fail to decode it, which
stops the jobs process. Here a message is written under a name no consumer reads and then renamed into
place, which is atomic within one file system.
"""

import os
import uuid
from time import monotonic

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue, payload, **kwargs):
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final_path = os.path.join(self.data_folder_out, name)
        staging_path = os.path.join(self.data_folder_out, f".staging-{name}")
        try:
            with open(staging_path, "wb") as staging:
                staging.write(str_to_bytes(dumps(payload)))
            os.replace(staging_path, final_path)
        except OSError as error:
            raise ChannelError(f"Cannot add message file {final_path!r}") from error


class Transport(filesystem.Transport):
    Channel = Channel
