from dsv4.engine.output import TextStream


class CharDetokenizer:
    """Token id i decodes to chr(i); holds back nothing."""

    def push(self, token_id):
        return chr(token_id)

    def flush(self):
        return ""


def run(text, stop):
    stream = TextStream(CharDetokenizer(), stop)
    out = ""
    for ch in text:
        out += stream.push(ord(ch))
        if stream.stopped:
            return out, True
    return out + stream.finish(), False


def test_stop_string_is_trimmed_and_ends_the_stream():
    assert run("hello world. more", ("world",)) == ("hello ", True)
    assert run("abcab", ("cab", "b")) == ("a", True)


def test_text_that_may_start_a_stop_string_is_held_back_then_released():
    stream = TextStream(CharDetokenizer(), ("END",))
    assert stream.push(ord("x")) == "x"
    assert stream.push(ord("E")) == ""
    assert stream.push(ord("N")) == ""
    assert stream.push(ord("d")) == "ENd"
    assert stream.push(ord("E")) == ""
    assert stream.finish() == "E"


def test_no_stop_strings_passes_everything_through():
    assert run("plain text", ()) == ("plain text", False)


def test_hidden_token_ids_add_no_text():
    stream = TextStream(CharDetokenizer(), (), hidden_token_ids=(ord("#"),))
    assert "".join(stream.push(ord(ch)) for ch in "a#b##c") + stream.finish() == "abc"
