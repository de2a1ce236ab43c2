from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from modeldock.bench.sse import SSEEvent, SSEParser


def parse_all(chunks: list[bytes]) -> list[SSEEvent]:
    parser = SSEParser()
    events: list[SSEEvent] = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    return events


def test_events_comments_and_fields() -> None:
    stream = b": hello\nevent: ping\nid: 7\ndata: one\n\ndata:two\ndata:  three\n\nretry: 10\n\n"
    assert parse_all([stream]) == [
        SSEEvent(data="one", event="ping", id="7"),
        SSEEvent(data="two\n three", event="message", id="7"),
    ]


def test_event_without_data_is_not_dispatched() -> None:
    assert parse_all([b"event: nothing\n\n: comment\n\n"]) == []


def test_bare_data_field_dispatches_empty_data() -> None:
    assert parse_all([b"data\n\n"]) == [SSEEvent(data="")]


def test_unterminated_event_is_dropped() -> None:
    assert parse_all([b"data: a\n\ndata: partial\n"]) == [SSEEvent(data="a")]


def test_crlf_split_between_cr_and_lf() -> None:
    # If the LF after a chunk-ending CR were taken as a second line end, the
    # event would be dispatched early and "b" would become its own event.
    assert parse_all([b"data: a\r", b"\ndata: b\r\n\r\n"]) == [SSEEvent(data="a\nb")]


def test_lone_cr_line_endings() -> None:
    assert parse_all([b"data: a\r\rdata: b\r", b"\r"]) == [SSEEvent(data="a"), SSEEvent(data="b")]


def test_utf8_character_split_across_chunks() -> None:
    raw = "data: héllo → 世界\n\n".encode()
    cut = raw.index("世".encode()) + 1  # inside the three-byte character
    assert parse_all([raw[:cut], raw[cut:]]) == [SSEEvent(data="héllo → 世界")]


def test_byte_order_mark_is_ignored_even_when_split() -> None:
    assert parse_all([b"\xef\xbb", b"\xbfdata: x\n\n"]) == [SSEEvent(data="x")]


def test_one_byte_at_a_time() -> None:
    stream = b'data: {"a": 1}\n\ndata: [DONE]\n\n'
    events = parse_all([stream[i : i + 1] for i in range(len(stream))])
    assert events == [SSEEvent(data='{"a": 1}'), SSEEvent(data="[DONE]")]


# Field values never contain CR or LF: those end the line, which is what multi-line data is for.
_text = st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=["Cs"]), max_size=20)
_name = st.text(st.characters(blacklist_characters="\r\n:", blacklist_categories=["Cs"]), min_size=1, max_size=8)
_event = st.tuples(
    st.lists(_text, min_size=1, max_size=3),  # data lines
    st.one_of(st.none(), _name),  # event type
    st.booleans(),  # a comment before the event
)


@given(
    events=st.lists(_event, max_size=6),
    line_end=st.sampled_from(["\n", "\r\n", "\r"]),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
)
def test_any_chunking_gives_the_same_events(
    events: list[tuple[list[str], str | None, bool]], line_end: str, cuts: list[int]
) -> None:
    text = ""
    expected: list[SSEEvent] = []
    for data_lines, name, comment in events:
        if comment:
            text += ": note" + line_end
        if name is not None:
            text += f"event: {name}" + line_end
        text += "".join(f"data: {line}" + line_end for line in data_lines)
        text += line_end
        expected.append(SSEEvent(data="\n".join(data_lines), event=name or "message"))
    raw = text.encode()
    points = sorted({c % (len(raw) + 1) for c in cuts})
    chunks = [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)], strict=True)]
    assert parse_all(chunks) == expected
