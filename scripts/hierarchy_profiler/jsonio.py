"""The Chrome trace's JSON: parsed and written with ``orjson`` where it is installed, else ``json``.

``orjson`` (pinned in requirements.txt) parses the profiler's export in about half the time of
``json`` and writes trace.json about ten times as fast, with the same Python values: it parses
floats exactly (shortest round trip, as ``json``) and writes them back as ``repr`` does.  The
two differ only outside strict JSON, where ``orjson`` refuses what ``json`` accepts (``NaN``,
``Infinity``, a lone surrogate ``\\ud800``, a byte order mark: then ``json`` parses it),
parses an integer beyond the 64-bit ranges as a float (``json``: an int; the profiler's
writer prints C++ 64-bit integers, so none occur in its export), and writes ``NaN`` as
``null`` (so a trace that did not parse as strict JSON is written back with ``json``).
Without ``orjson`` (your own venv) everything goes through ``json``: slower, same values.
"""

from __future__ import annotations

import gzip
import json
import mmap
import os
from typing import Any

try:
    import orjson
except ImportError:  # optional: the workbench's .venv has it (requirements.txt)
    orjson = None  # type: ignore[assignment]

GZIP_MAGIC = b"\x1f\x8b"  # a JSON document starts with neither byte


def loads(data: bytes | memoryview) -> tuple[Any, bool]:
    """The value of the JSON document ``data``, and whether ``orjson`` parsed it (strict JSON)."""
    if orjson is not None:
        try:
            return orjson.loads(data), True
        except orjson.JSONDecodeError:
            pass  # not strict JSON: json may still accept it (NaN, Infinity, ...)
    return json.loads(bytes(data) if isinstance(data, memoryview) else data), False


def load(path: str | os.PathLike[str]) -> tuple[Any, bool]:
    """:func:`loads` of the file at ``path``, mapped into memory rather than read into a copy;
    a gzip file (``tensorboard_trace_handler(use_gzip=True)``) is decompressed.

    With ``MAP_POPULATE`` (Linux) the kernel maps the file's pages in one call: a trace of
    tens of MB read into a new ``bytes`` costs a page fault per 4 KiB, several ms on a VM.
    """
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return loads(b"")
        populate = getattr(mmap, "MAP_POPULATE", None)
        if populate is None:  # not Linux: read it
            raw = f.read()
            return loads(gzip.decompress(raw) if raw[:2] == GZIP_MAGIC else raw)
        with mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE | populate, prot=mmap.PROT_READ) as mapped:
            if mapped[:2] == GZIP_MAGIC:
                return loads(gzip.decompress(mapped))
            with memoryview(mapped) as data:
                return loads(data)


def dumps(value: Any, strict: bool) -> bytes:
    """``value`` as JSON (UTF-8); ``strict``: it came from :func:`loads` as strict JSON."""
    if orjson is not None and strict:
        try:
            return orjson.dumps(value)
        except TypeError:
            pass  # what orjson does not write (a non-str key, an int beyond 64 bits): json does
    return json.dumps(value).encode()
