# kombu's wire text, for the holder's own push of replies and its decoding of
# requests. kombu's Redis transport has no public way to make the text it pushes
# for a published message, nor to name the list it pushes it on, without its
# per-message publish machinery (Producer.publish, the virtual Channel's
# prepare_message and _inplace_augment_message, the Redis Channel's _put and
# _q_for_pri): the holder pushes a batch's replies itself, in one pipeline
# (holder/replies.py). kombu's JSON decoding (kombu.utils.json.loads) passes an
# object hook, so Python's json module makes a new decoder for every message.
# JSON is read and written by pydantic-core (a dependency through pydantic), several
# times faster than Python's json module, where the values come out the same.
# The same on every supported kombu (5.4.2-5.7); tests/test_compat.py compares what
# kombu's consumer reads of the text with what kombu's Producer pushes, and the
# decoding with kombu's.
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kombu.utils.json import loads as kombu_loads
from pydantic_core import from_json, to_json

_ENVELOPE = json.JSONEncoder()
"""For the envelope's number: kombu's encoder writes plain values as this one does."""


def redis_list_of(channel: Any) -> Callable[[str], str]:
    """queue -> the Redis list `channel` pushes a message of the default priority to that
    queue on (`_put`: `_q_for_pri` of `_get_message_priority`)."""
    message = {"properties": {"priority": channel.default_priority}}
    priority = channel._get_message_priority(message, reverse=False)
    list_for: Callable[[str, int], str] = channel._q_for_pri
    return lambda queue: list_for(queue, priority)


def redis_envelope(channel: Any, body: Any, *, routing_key: str, correlation_id: str | None,
                   delivery_tag: str, reply_to: str | None = None) -> str:
    """The text kombu pushes for `Producer(channel, serializer="json").publish(body,
    exchange="", routing_key=routing_key, correlation_id=correlation_id,
    reply_to=reply_to)` when the channel's next delivery tag is `delivery_tag`, but for
    the body's JSON: compact, not ASCII-only, the same values. `body` holds JSON's own
    types only (kombu's encoder would also write dates, UUIDs and decimals)."""
    encoded, encoding = channel.encode_body(to_json(body), channel.body_encoding)
    # kombu writes only the properties it is given, in the order given: publish_request's.
    replies = "" if reply_to is None else f'"reply_to": {_STRING(reply_to)}, '
    return _TEMPLATE % (_text(encoded), replies, _text(correlation_id), _text(routing_key),
                        _ENVELOPE.encode(channel.default_priority), _text(encoding),
                        _text(delivery_tag))


_TEMPLATE = ('{"body": %s, "content-encoding": "utf-8", "content-type": "application/json", '
             '"headers": {}, "properties": {%s"correlation_id": %s, "delivery_mode": 2, '
             '"delivery_info": {"exchange": "", "routing_key": %s}, "priority": %s, '
             '"body_encoding": %s, "delivery_tag": %s}}')
"""kombu's envelope (keys in its order, json's default separators) with its values to
fill in; delivery_mode 2 is the default exchange's (persistent)."""


def _text(value: str | None) -> str:
    """A string or None as JSON, as kombu's encoder writes it."""
    return "null" if value is None else _STRING(value)


_STRING: Callable[[str], str] = json.encoder.encode_basestring_ascii
"""How Python's json (so kombu's encoder, with its default ensure_ascii) writes a string."""


def _plain_json(text: str | bytes) -> bool:
    """Whether kombu's object hook leaves every object of the JSON `text` as it is: it
    turns only an object keyed exactly `__type__` and `__value__`, and without a `\\u`
    escape no key can spell `__type__` other than literally."""
    if isinstance(text, bytes):
        return b"__type__" not in text and b"\\u" not in text
    return "__type__" not in text and "\\u" not in text


def json_loads(text: str) -> Any:
    """kombu.utils.json.loads(text), the same result, errors included: pydantic-core's
    decoder where kombu's object hook would change nothing, and Python's where
    pydantic-core refuses the text (its nesting limit is lower, it refuses a lone
    surrogate escape), for Python's answer."""
    if not _plain_json(text):
        return kombu_loads(text)  # type: ignore[no-untyped-call]
    try:
        return from_json(text)
    except ValueError:
        return json.loads(text)


def decoded_json(message: Any) -> Any:
    """`message.decode()` (kombu's Message), the same result or error, for a message of a
    consumer accepting JSON: a non-empty JSON body that kombu's object hook would leave
    as it is goes through pydantic-core's decoder. Anything else, a body it refuses
    included (for kombu's own answer), goes to `message.decode()`."""
    body = message.body
    accept = message.accept
    if (message.content_type == "application/json" and accept is not None
            and "application/json" in accept and isinstance(body, bytes) and body
            and _plain_json(body)):
        try:
            return from_json(body)
        except ValueError:
            pass
    return message.decode()
