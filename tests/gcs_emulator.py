"""gcp-storage-emulator on 127.0.0.1, with the one call of GCS's JSON API that gcsfs needs and the emulator lacks.

    python tests/gcs_emulator.py PORT

gcsfs (2026.x) renames an object with objects.moveTo, which the emulator answers with 501; gcsfs retries that for
half a minute before it falls back to copy and delete. Here moveTo is the emulator's own copy, then its own delete,
within one bucket. Everything else is the emulator as published.
"""

from __future__ import annotations

import sys
from http import HTTPStatus

from gcp_storage_emulator import server, settings
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects


def move(request, response, storage, *args, **kwargs) -> None:
    bucket, source, destination = (request.params[name] for name in ("bucket_name", "object_id", "dest_object_id"))
    try:
        moved = objects._copy(request.base_url, storage, bucket, source, bucket, destination)
    except NotFound:
        response.status = HTTPStatus.NOT_FOUND
        return
    objects._delete(storage, bucket, source)
    response.json(moved)


MOVE = r"/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/(?P<dest_object_id>.*[^/]+)$"
server.HANDLERS = (
    (rf"^{settings.API_ENDPOINT}{MOVE}", {server.POST: move}),
    (rf"^{MOVE}", {server.POST: move}),
    *server.HANDLERS,
)

if __name__ == "__main__":
    server.create_server("127.0.0.1", int(sys.argv[1]), in_memory=True).run()
