"""Incremental detokenization and stop strings (the engine's, so offline `LLM` has them too): the pieces a stream
sends add up to the whole text, never half a character, never text a stop string cuts off."""
import pytest

from minillm.engine.detokenizer import Detokenizer

PIECES = {0: b"he", 1: b"llo", 2: b" wo", 3: b"rld", 4: b"\xe4\xbd", 5: b"\xa0", 6: b"!", 7: b""}
SPECIAL = 7  # decodes to nothing, like an end-of-sequence token with skip_special_tokens


class ByteTokenizer:
    """Each id is a few bytes; decoding joins them and replaces broken UTF-8, as real BPEs do."""

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def stream(ids, stop=(), finish=True, min_tokens=0):
    """Feed one token per step; return the pieces handed out and the detokenizer."""
    text = Detokenizer(ByteTokenizer(), stop, min_tokens)
    pieces = []
    for i, token in enumerate(ids):
        text.add([token])
        if finish and i == len(ids) - 1:
            text.finish()
        pieces.append(text.take())
        if text.stopped:
            break
    return pieces, text


def test_pieces_add_up_to_the_whole_text_and_wait_for_whole_characters():
    ids = [0, 1, 4, 5, 2, 3, SPECIAL, 6]
    pieces, text = stream(ids)
    assert "".join(pieces) == ByteTokenizer().decode(ids) == "hello你 world!"
    assert pieces[2] == "" and pieces[3] == "你"  # the first two bytes of 你 wait for the third
    assert "\ufffd" not in "".join(pieces)
    assert text.token_ids == ids


def test_a_broken_character_at_the_end_is_flushed_when_finished():
    pieces, _ = stream([0, 4])
    assert "".join(pieces) == "he\ufffd"


@pytest.mark.parametrize("stop, expected", [("lo w", "hel"), ("rld", "hello wo"), ("!", "hello world"),
                                            ("你", "hello world!"), ("xyz", "hello world!你")])
def test_the_text_ends_before_the_first_stop_string(stop, expected):
    pieces, text = stream([0, 1, 2, 3, 6, 4, 5], stop=[stop, "never"])
    assert "".join(pieces) == text.text == expected
    assert text.stopped == (stop != "xyz")


def test_text_a_stop_string_might_start_with_is_held_back():
    text = Detokenizer(ByteTokenizer(), ["lo wx"])
    text.add([0, 1])
    assert text.take() == "h"  # the last 4 characters could be the start of "lo wx"
    text.add([2])
    assert text.take() == "ell"
    text.add([3])
    assert text.take() == "o w" and not text.stopped  # "lo wo" is not the stop string
    text.finish()
    assert text.take() == "orld"


def test_without_a_tokenizer_only_ids_count():
    text = Detokenizer(None)
    text.add([1, 2, 3])
    text.finish()
    assert (text.text, text.take(), text.token_ids) == ("", "", [1, 2, 3])


def test_no_stop_string_counts_before_min_tokens():
    ids = [0, 1, 2, 3, 0, 1, 6]  # "hello world hello!"
    pieces, text = stream(ids, stop=["llo"], min_tokens=3)
    assert (text.stopped, text.text) == (True, "hello worldhe")  # the second "llo", past 3 tokens
    assert "".join(pieces) == "hello worldhe" and text.token_ids == ids[:6]
    _, early = stream(ids, stop=["llo"])
    assert early.text == "he"


def test_several_tokens_in_one_step_stop_where_one_token_a_step_would():
    """A step that brings several tokens (speculative decoding): the stop string, min_tokens and the
    ids kept are those of one token a step."""
    ids = [0, 1, 2, 3, 0, 1, 6]
    _, one_a_step = stream(ids, stop=["llo"], min_tokens=3)
    text = Detokenizer(ByteTokenizer(), ["llo"], 3)
    text.add(ids[:3])
    assert text.add(ids[3:])
    assert (text.stopped, text.text, text.token_ids) == (True, "hello worldhe", ids[:6])
    assert (text.text, text.token_ids) == (one_a_step.text, one_a_step.token_ids)
    assert text.take() == "hello worldhe"


def test_without_stop_strings_nothing_is_decoded_until_asked():
    """A step pays for no text nobody reads: the ids wait until take(), which decodes them at once
    and gives what one take per token would."""
    ids = [0, 1, 4, 5, 2, 3, SPECIAL, 6]
    text = Detokenizer(ByteTokenizer())
    text.add(ids[:5])
    assert text.text == ""
    assert text.take() == "hello你 wo"
    text.add(ids[5:])
    text.finish()
    assert text.take() == "rld!" and text.sent == "".join(stream(ids)[0])
