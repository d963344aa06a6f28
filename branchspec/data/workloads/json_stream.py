"""A streaming reader for one top-level JSON array, for files cut off mid-element.

ShareGPT's packaged file is one (DESIGN.md section 6): ``json.load`` rejects it, while
this reader yields every complete element and reports the cut-off tail.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from typing import Any, BinaryIO


class JsonArrayReader:
    """The complete elements of a top-level JSON array read from a byte stream, one at a
    time, tolerating a stream that is cut off in the middle of an element.

    Memory stays around one element plus one chunk, so a file need not fit in memory
    twice. An element that cannot be decoded before the end of the stream is the cut-off
    tail: iteration stops there and ``truncated_chars`` says how much was dropped (0 if
    the array closed with ``]``). A syntax error earlier in the stream cannot be told
    apart from "element not complete yet" until ``max_element_chars`` have been buffered;
    then ValueError is raised rather than reading the rest of the file into one element.
    """

    _SPACE = re.compile(r"\s*")
    _SKIP = re.compile(r"[\s,]*")  # between elements

    def __init__(self, stream: BinaryIO, *, chunk_bytes: int = 1 << 20, max_element_chars: int = 1 << 26):
        self._stream = stream
        self._chunk_bytes = chunk_bytes
        self._max_element_chars = max_element_chars
        self.num_elements = 0
        self.closed = False
        self.truncated_chars = 0

    def __iter__(self) -> Iterator[Any]:
        decoder = json.JSONDecoder()
        # Incremental decoding: a chunk boundary, or the cut at the end of the file, may
        # split a multi-byte UTF-8 character; the decoder holds the partial bytes back.
        utf8 = codecs.getincrementaldecoder("utf-8")()
        buf, pos, base, eof = "", 0, 0, False  # base: char offset of buf[0] in the stream

        def refill(min_bytes: int) -> None:
            nonlocal buf, pos, base, eof
            data = self._stream.read(max(min_bytes, self._chunk_bytes))
            eof = not data
            base += pos
            buf = buf[pos:] + utf8.decode(data)
            pos = 0

        while True:
            refill(self._chunk_bytes)
            pos = self._SPACE.match(buf, pos).end()
            if pos < len(buf) or eof:
                break
        if pos == len(buf):
            return  # an empty stream holds no elements
        if buf[pos] != "[":
            raise ValueError(f"expected a JSON array, found {buf[pos:pos + 20]!r}")
        pos += 1
        while True:
            pos = self._SKIP.match(buf, pos).end()
            if pos == len(buf):
                if eof:
                    return  # cut exactly between elements
                refill(self._chunk_bytes)
                continue
            if buf[pos] == "]":
                self.closed = True
                return
            try:
                element, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    self.truncated_chars = len(buf) - pos
                    return
                pending = len(buf) - pos
                if pending > self._max_element_chars:
                    raise ValueError(
                        f"JSON array element at char {base + pos} is malformed or longer than "
                        f"{self._max_element_chars} chars"
                    ) from None
                # Read at least as much again: re-decoding restarts at the element's
                # start, and geometric growth keeps the total work linear.
                refill(pending)
                continue
            if end == len(buf) and not eof and not isinstance(element, (dict, list, str)):
                refill(self._chunk_bytes)  # a number or literal may continue in the next chunk
                continue
            self.num_elements += 1
            pos = end
            yield element
