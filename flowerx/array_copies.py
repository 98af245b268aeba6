"""Fast path ``array-fewer-copies``: an array's chunks deflated and inflated with one copy each.

A Flower ``Array`` travels as its metadata object plus one ``ArrayChunk`` object per
``FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE`` bytes of its data. Flower 1.41 / 1.42 copy the data more
often than the bytes they produce need:

* ``ArrayChunk.deflate`` (``add_header_to_object_body``) builds the chunk's object content in a
  ``bytearray`` (header, divider, body) and returns ``bytes(...)`` of it: two copies of the body;
* ``ArrayChunk.inflate`` slices the body out of the received content (a copy) before wrapping it
  in a ``memoryview``;
* ``Array.inflate`` appends every chunk to a growing ``bytearray`` and returns ``bytes(...)`` of
  it: the whole array twice, besides the chunks.

With this fast path a chunk's content is ``b"".join((header, divider, body))`` (one copy, the same
bytes), a received chunk's data is a ``memoryview`` into its content (no copy; the chunk keeps the
content alive, body plus a header of a few bytes, what the copy held before), and an array's data
is ``b"".join`` of its chunks (one copy). Flower's own ``Array.inflate`` still does every check
(object type, children ids against the metadata) and builds the ``Array``; only its data is
joined here. Object ids, requests and messages are the same as Flower's
(``tests/test_array_copies.py`` compares them byte for byte).

Installed by graphfl's ServerApp (:mod:`graphfl.server.flower_adapter`) and warm ClientApp
worker (:mod:`graphfl.deploy.warm`), the two processes that deflate and inflate arrays; the
SuperLink and the SuperNodes move object contents without inflating them. Off
(:mod:`graphfl.flowerx.policy`): Flower's methods.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from graphfl.flowerx.checks import first_reason, lacks_attributes, lacks_source
from graphfl.flowerx.policy import FastPath, decide

logger = logging.getLogger(__name__)

FAST_PATH = FastPath("array-fewer-copies", "an array's chunks deflated and inflated with one copy each",
                     "Flower copies an array's data twice to deflate a chunk and twice to inflate an array")

_HEADER_NEEDLES = ('header = f"%s{HEAD_VALUE_DIVIDER}%s{HEAD_VALUE_DIVIDER}%d" % (', "obj.__class__.__qualname__,",
                   '",".join((obj.children or {}).keys()),', "len(object_body),",
                   'ret.extend(header.encode(encoding="utf-8"))', "ret.extend(HEAD_BODY_DIVIDER)",
                   "ret.extend(object_body)", "return bytes(ret)")
_CHUNK_DEFLATE_NEEDLES = ("return add_header_to_object_body(object_body=self.data, obj=self)",)
_CHUNK_INFLATE_NEEDLES = ("if children:", "obj_body = get_object_body(object_content, cls)",
                          "return cls(data=memoryview(obj_body))")
_ARRAY_INFLATE_NEEDLES = ("children_ids = get_object_children_ids_from_object_content(object_content)",
                          'chunk_ids_indices = cast(list[int], array_metadata["arraychunk_ids"])',
                          "chunk_ids = [children_ids[i] for i in chunk_ids_indices]",
                          "buff += cast(ArrayChunk, children[ch_id]).data", "array.data = bytes(buff)",
                          "return array")
_GET_BODY_NEEDLES = ("index = object_content.find(HEAD_BODY_DIVIDER)",
                     "return object_content[index + len(HEAD_BODY_DIVIDER) :]")

_originals: dict[str, Any] = {}
"""Flower's methods while the fast path is installed in this process (name -> the original)."""


def _flower() -> tuple[Any, Any, Any, Any]:
    from flwr.app.message import array as array_mod
    from flwr.app.message import arraychunk as chunk_mod
    from flwr.supercore import constant
    from flwr.supercore.inflatable import inflatable_object as io

    return array_mod, chunk_mod, io, constant


def check() -> str | None:
    """Why the fewer-copies methods do not fit this Flower's ``Array`` / ``ArrayChunk``, or ``None``.

    Beyond the source checks, a sample array is deflated and inflated by Flower's methods and by
    these: every object content, id and the inflated data must be the same.
    """
    array_mod, chunk_mod, io, constant = _flower()
    reason = first_reason(
        lacks_attributes(io, ("add_header_to_object_body", "get_object_body", "_get_object_body",
                              "get_object_type_from_object_content",
                              "get_object_children_ids_from_object_content")),
        lacks_attributes(constant, ("HEAD_BODY_DIVIDER", "HEAD_VALUE_DIVIDER")),
        lacks_attributes(array_mod, ("Array", "ArrayChunk")),
        lacks_attributes(chunk_mod, ("ArrayChunk",)),
        lacks_source(io.add_header_to_object_body, "object header", _HEADER_NEEDLES),
        lacks_source(io._get_object_body, "object body", _GET_BODY_NEEDLES),
        lacks_source(chunk_mod.ArrayChunk.deflate, "ArrayChunk.deflate", _CHUNK_DEFLATE_NEEDLES),
        lacks_source(chunk_mod.ArrayChunk.inflate, "ArrayChunk.inflate", _CHUNK_INFLATE_NEEDLES),
        lacks_source(array_mod.Array.inflate, "Array.inflate", _ARRAY_INFLATE_NEEDLES),
    )
    if reason is not None:
        return reason
    if chunk_mod.ArrayChunk is not array_mod.ArrayChunk:
        return "flwr.app.message.array uses another ArrayChunk class"
    return _self_test()


def stock_methods() -> tuple[Any, Any, Any]:
    """Flower's ``ArrayChunk.deflate``, ``ArrayChunk.inflate`` and ``Array.inflate`` as plain
    functions (``(self)``, ``(cls, content, children)``), installed or not.
    """
    array_mod, chunk_mod, _, _ = _flower()
    chunk_cls, array_cls = chunk_mod.ArrayChunk, array_mod.Array
    return (_originals.get("ArrayChunk.deflate", chunk_cls.deflate),
            _originals.get("ArrayChunk.inflate", chunk_cls.__dict__["inflate"]).__func__,
            _originals.get("Array.inflate", array_cls.__dict__["inflate"]).__func__)


def _self_test() -> str | None:
    """``None`` when these methods give Flower's bytes and data on a sample array of four chunks."""
    array_mod, chunk_mod, _, _ = _flower()
    chunk_cls, array_cls = chunk_mod.ArrayChunk, array_mod.Array
    stock_deflate, stock_chunk_inflate, stock_array_inflate = stock_methods()
    data = bytes(range(256)) * 3 + b"graphfl"
    for view in (memoryview(data), memoryview(data)[5:300]):
        chunk = chunk_cls(view)
        content = stock_deflate(chunk)
        if deflate_chunk(chunk) != content:
            return "its ArrayChunk content differs from Flower's"
        fast, stock = inflate_chunk(chunk_cls, content), stock_chunk_inflate(chunk_cls, content)
        if bytes(fast.data) != bytes(stock.data) or deflate_chunk(fast) != stock_deflate(stock):
            return "its inflated ArrayChunk differs from Flower's"
    parts = [bytes([i]) * 40 for i in range(3)] + [bytes([0]) * 40]  # a repeated chunk, as Flower allows
    chunks = [chunk_cls(memoryview(p)) for p in parts]
    holder = array_cls(dtype="uint8", shape=(len(parts) * 40,), stype="raw", data=b"".join(parts))
    holder.__dict__["_chunks"] = [(c.object_id, c) for c in chunks]  # several chunks (Flower's slice cache)
    content = array_cls.deflate(holder)
    received = {cid: stock_chunk_inflate(chunk_cls, stock_deflate(c)) for cid, c in holder.__dict__["_chunks"]}
    fast, stock = inflate_array(array_cls, content, received), stock_array_inflate(array_cls, content, received)
    if (fast.data, fast.dtype, fast.shape, fast.stype) != (stock.data, stock.dtype, stock.shape, stock.stype):
        return "its inflated Array differs from Flower's"
    return None


def _header(obj: Any, body_len: int) -> bytes:
    _, _, _, constant = _flower()
    sep = constant.HEAD_VALUE_DIVIDER
    return (f"%s{sep}%s{sep}%d" % (obj.__class__.__qualname__, ",".join((obj.children or {}).keys()),
                                   body_len)).encode("utf-8")


def deflate_chunk(self: Any) -> bytes:
    """``ArrayChunk.deflate``: header, divider and body joined by one copy (Flower's bytes)."""
    _, _, _, constant = _flower()
    return b"".join((_header(self, len(self.data)), constant.HEAD_BODY_DIVIDER, self.data))


def inflate_chunk(cls: Any, object_content: bytes, children: dict[str, Any] | None = None) -> Any:
    """``ArrayChunk.inflate``: Flower's checks, and the data as a ``memoryview`` into ``object_content``.

    Content that is not ``bytes`` (which a caller could change later) goes to Flower's method.
    """
    if type(object_content) is not bytes:
        return stock_methods()[1](cls, object_content, children)
    if children:
        raise ValueError("`ArrayChunk` objects do not have children.")
    _, _, io, constant = _flower()
    object_type = io.get_object_type_from_object_content(object_content)
    if object_type != cls.__qualname__:
        raise ValueError(f"Class name ({cls.__qualname__}) and object type ({object_type}) do not match.")
    index = object_content.find(constant.HEAD_BODY_DIVIDER)
    return cls(data=memoryview(object_content)[index + len(constant.HEAD_BODY_DIVIDER):])


def inflate_array(cls: Any, object_content: bytes, children: dict[str, Any] | None = None) -> Any:
    """``Array.inflate``: Flower's method checks and builds the ``Array`` from empty stand-in chunks;
    its data is then the chunks' data in the metadata's order, joined by one copy.
    """
    _, chunk_mod, io, _ = _flower()
    stock = stock_methods()[2]
    if not children:
        return stock(cls, object_content, children)
    empty = {cid: chunk_mod.ArrayChunk(memoryview(b"")) for cid in children}
    array = stock(cls, object_content, empty)  # every check of Flower's, data b""
    children_ids = io.get_object_children_ids_from_object_content(object_content)
    metadata = json.loads(io.get_object_body(object_content, cls).decode(encoding="utf-8"))
    array.data = b"".join(children[children_ids[i]].data for i in metadata["arraychunk_ids"])
    return array


def install() -> bool:
    """Replace ``ArrayChunk.deflate``/``inflate`` and ``Array.inflate`` in this process (idempotent).

    Returns ``False`` (and changes nothing) when the fast path is off here.
    """
    if not decide(FAST_PATH, check):
        return False
    array_mod, chunk_mod, _, _ = _flower()
    if _originals:
        return True
    chunk_cls, array_cls = chunk_mod.ArrayChunk, array_mod.Array
    _originals.update({"ArrayChunk.deflate": chunk_cls.deflate,
                       "ArrayChunk.inflate": chunk_cls.__dict__["inflate"],
                       "Array.inflate": array_cls.__dict__["inflate"]})
    chunk_cls.deflate = deflate_chunk
    chunk_cls.inflate = classmethod(inflate_chunk)
    array_cls.inflate = classmethod(inflate_array)
    return True


def uninstall() -> None:
    """Put Flower's methods back (tests)."""
    if not _originals:
        return
    array_mod, chunk_mod, _, _ = _flower()
    chunk_mod.ArrayChunk.deflate = _originals["ArrayChunk.deflate"]
    chunk_mod.ArrayChunk.inflate = _originals["ArrayChunk.inflate"]
    array_mod.Array.inflate = _originals["Array.inflate"]
    _originals.clear()
