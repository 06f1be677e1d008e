"""Streamed text is released only once final: never half a character, never the start of a stop string that the
next tokens may complete, and never anything from a stop string on."""

from __future__ import annotations

from specheads.inference.serve.text_stream import TextStream


class Bytes:
    """Token i is the byte PIECES[i]; decoding joins the bytes as UTF-8 (a cut character decodes to U+FFFD)."""

    PIECES = [b"a", b"b", b"\xc3", b"\xa9", b" ", b"E", b"N", b"D", b"!"]

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", errors="replace")


def test_half_a_character_waits_for_its_other_half():
    text = TextStream(Bytes())
    assert [text.add([i]) for i in (0, 2, 3, 1)] == ["a", "", "é", "b"]
    assert text.flush() == ""


def test_a_stop_string_across_tokens_ends_the_text_before_it():
    text = TextStream(Bytes(), ["END"])
    assert [text.add([i]) for i in (0, 4, 5, 6)] == ["a", " ", "", ""]  # "EN" may become "END": held back
    assert text.add([7]) == "" and text.stopped  # it did: nothing of it is released
    assert text.add([8]) == "" and text.flush() == "" and text.text == "a "


def test_a_held_back_prefix_is_released_when_it_turns_out_not_to_stop():
    text = TextStream(Bytes(), ["END"])
    assert [text.add([i]) for i in (5, 6, 8)] == ["", "", "EN!"]
    assert not text.stopped


def test_the_rest_is_flushed_at_the_end():
    text = TextStream(Bytes(), ["END"])
    assert text.add([0, 5]) == "a" and text.flush() == "E"
