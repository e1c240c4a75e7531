"""Where a run's checkpoints are stored: a local folder, or an object store every node reaches.

``[checkpoint] folder`` may be an fsspec URL (``s3://bucket/run``; any S3-compatible service:
set ``AWS_ENDPOINT_URL`` for R2, MinIO or Google Cloud Storage's interoperability endpoint, and
the usual ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``). TorchTitan's checkpointer and DCP
read and write such a folder through fsspec (``torchtitan.tools.filesystem``, DCP's
``FsspecWriter``), so every node sees one checkpoint and a node that is replaced by a machine
with an empty disk resumes from it, losing only the steps since the last save. This module holds
what the plugin itself does with the folder: where it is, writing a small file into it, and the
start-up check that the store is installed, reachable and writable.
"""

from __future__ import annotations

import os
import socket

from torchtitan.tools import filesystem


def checkpoint_folder(config) -> str:
    """The run's checkpoint folder: ``[checkpoint] folder`` under ``dump_folder``, or the
    folder itself where it is a URL (TorchTitan's rule)."""
    return filesystem.join(config.dump_folder, config.checkpoint.folder)


def write_text(folder: str, name: str, text: str) -> None:
    """Write ``folder/name`` whole, so a reader never sees half of it: locally through a
    temporary name of this host and process and a rename, in an object store by one put (an
    object appears whole)."""
    if filesystem.is_remote(folder):
        from fsspec.core import url_to_fs

        fs, path = url_to_fs(filesystem.join(folder, name))
        fs.pipe_file(path, text.encode())
        return
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{name}.{socket.gethostname()}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(folder, name))


def store_problem(folder: str) -> str | None:
    """Why the object store of ``folder`` cannot hold the checkpoints (None: it can, or the
    folder is local): its fsspec backend is not installed, or a probe object can not be written,
    read back and removed (credentials, endpoint, bucket). One line."""
    if not filesystem.is_remote(folder):
        return None
    import fsspec
    from fsspec.core import url_to_fs

    protocol = folder.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as e:
        return f"fsspec cannot open {protocol}:// ({str(e).splitlines()[0]})"
    probe = filesystem.join(folder, f".probe-{socket.gethostname()}-{os.getpid()}")
    try:
        fs, path = url_to_fs(probe)
        fs.pipe_file(path, b"protocol_models")
        ok = fs.cat_file(path) == b"protocol_models"
        fs.rm_file(path)
    except Exception as e:  # any backend's failure becomes the one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return f"writing a probe object there failed ({type(e).__name__}: {first})"
    return None if ok else "a probe object read back differs from what was written"
