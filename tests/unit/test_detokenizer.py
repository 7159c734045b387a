"""Streamed text stays valid UTF-8 across token boundaries; stop strings are never leaked."""

from __future__ import annotations

from coordinator.detokenizer import IncrementalDetokenizer, StopStrings
from specdec_cli import tiny

TEXT = "Le café est très chaud 🚀🙂 日本語のテキスト end"


def _byte_symbol(byte):
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    # GPT-2 byte-to-unicode table
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, map(chr, cs)))
    assert table[byte] in alphabet
    return table[byte]


def test_deltas_never_split_a_character():
    tokenizer = tiny.byte_level_tokenizer()
    ids = tokenizer(TEXT)["input_ids"]
    byte_ids = [tokenizer.convert_tokens_to_ids(_byte_symbol(b)) for b in TEXT.encode()]
    for sequence in (ids, byte_ids):
        detok = IncrementalDetokenizer(tokenizer, [])
        deltas = [detok.add(t) for t in sequence]
        deltas.append(detok.flush())
        assert "".join(deltas) == TEXT
        assert all("\ufffd" not in d for d in deltas)
    # byte by byte, the multi-byte characters were held back until complete
    assert any(d == "🚀" for d in deltas)


def test_context_tokens_keep_leading_spaces():
    tokenizer = tiny.byte_level_tokenizer()
    prompt = tokenizer("The quick")["input_ids"]
    rest = tokenizer(" brown fox")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert "".join(detok.add(t) for t in rest) + detok.flush() == " brown fox"


def test_stop_strings_find_and_hold_back():
    stops = StopStrings(("\n\n", "END"))
    assert stops.holdback == 2
    text = "abc\n"
    assert stops.find(text, 0) == -1
    assert stops.safe_length(text) == 2  # "\n" might start a stop string
    text += "\nmore"
    assert stops.find(text, 4) == 3
    assert StopStrings(()).safe_length("abc") == 3
    assert StopStrings(("",)).find("abc", 0) == -1
