"""The Kimi tokenizer (tiktoken.model + tokenizer_config.json) against ids worked out by hand, the
presets' tokenizer files, streaming decode, the tokenizer.json path, and bad tokenizer files."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from deltafin.checkpoint import synthetic
from deltafin.checkpoint.synthetic import config_dict, special_token_ids, tiktoken_model, tokenizer_config
from deltafin.tokenizer import ByteStreamDecoder, KimiTokenizer, TokenizerError, load_tokenizer, stream_decoder
from conftest import KL_CODE_TINY

# A hand-made vocabulary: the 256 bytes, then these merges (rank = position).
MERGES = [b"he", b"ll", b"hell", b"hello", b" w", b"34"]  # ranks 256..261
ADDED = {262: "[BOS]", 263: "[EOS]", 265: "<|im_end|>", 266: "<|im_user|>", 267: "<|im_assistant|>",
         268: "<|im_middle|>", 269: "[PAD]"}  # 264 is left out: a reserved token
TEMPLATE = ("{%- for m in messages -%}{{- '<|im_' + m['role'] + '|>' + m['role'] + '<|im_middle|>' + m['content'] "
            "+ '<|im_end|>' -}}{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}{%- endif -%}")


def write_vocab(folder: Path, tokens: list[bytes], added: dict[int, str], **conf) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n"
                                                  for r, t in enumerate(tokens)))
    body = {"added_tokens_decoder": {str(i): {"content": t, "special": True} for i, t in added.items()},
            "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "chat_template": TEMPLATE}
    body.update(conf)
    (folder / "tokenizer_config.json").write_text(json.dumps(body))
    return folder


@pytest.fixture
def hand(tmp_path) -> KimiTokenizer:
    return KimiTokenizer(write_vocab(tmp_path / "tok", [bytes([b]) for b in range(256)] + MERGES, ADDED))


def test_encode_applies_merges_by_rank(hand):
    # "hello": he(256) and ll(257) first, then hell(258), then hello(259); " world": " w"(260) + bytes.
    assert hand.encode("hello world") == [259, 260, ord("o"), ord("r"), ord("l"), ord("d")]
    assert hand.decode([259, 260, 111, 114, 108, 100]) == "hello world"
    assert hand.encode("345") == [261, ord("5")]


def test_kimi_pattern_splits_numbers_in_threes(hand):
    # "12345" is pre-tokenized as "123" + "45", so the "34" merge cannot apply across the cut.
    assert hand.encode("12345") == [ord(c) for c in "12345"]
    assert hand.encode("x12345") == [ord("x")] + [ord(c) for c in "12345"]


def test_special_tokens_numbered_after_the_base_vocabulary(hand):
    assert hand.num_base_tokens == 262 and len(hand) == 270
    assert (hand.bos_token_id, hand.eos_token_id, hand.pad_token_id) == (262, 263, 269)
    assert hand.special_tokens["<|reserved_token_264|>"] == 264  # the gap is filled, as in the original
    assert hand.encode("[BOS]hello<|im_end|>") == [262, 259, 265]
    assert hand.decode([262, 259, 264, 265]) == "[BOS]hello<|reserved_token_264|><|im_end|>"
    assert hand.decode([262, 259, 264, 265], skip_special_tokens=True) == "hello"
    assert hand.convert_tokens_to_ids("<|im_end|>") == 265 and hand.convert_tokens_to_ids("hello") == 259
    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        hand.decode([270])


def test_chat_template_renders_and_encodes(hand):
    messages = [{"role": "user", "content": "hello"}]
    text = hand.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_user|>user<|im_middle|>hello<|im_end|><|im_assistant|>assistant<|im_middle|>"
    u, s, e, r = ord("u"), ord("s"), ord("e"), ord("r")
    want = [266, u, s, e, r, 268, 259, 265, 267, ord("a"), s, s, ord("i"), s, ord("t"), ord("a"), ord("n"),
            ord("t"), 268]
    assert hand.apply_chat_template(messages, add_generation_prompt=True) == want
    assert hand.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"] == want


def test_long_runs_are_cut_like_the_original(hand):
    text = "a" * 30_000 + " " + "hello"
    ids = hand.encode(text)
    assert hand.decode(ids) == text and ids[-1] == 259


def test_stream_decoder_emits_only_whole_characters(hand):
    han = "日".encode()  # three bytes, one token each here
    dec = stream_decoder(hand, [])
    assert isinstance(dec, ByteStreamDecoder)
    assert [dec.add(b) for b in han] == ["", "", "日"]
    assert dec.add(262) == "" and dec.add(259) == "hello"  # special tokens are skipped
    assert dec.add(han[0]) == "" and dec.flush() == "\ufffd"  # an unfinished character at the very end


def test_presets_ship_the_kimi_format(tiny_k3_path, tiny_kl_path):
    for path in (tiny_k3_path, tiny_kl_path):
        assert (path / "tiktoken.model").exists() and not (path / "tokenizer.json").exists()
        tok = load_tokenizer(path)
        assert isinstance(tok, KimiTokenizer)
        raw = json.loads((path / "config.json").read_text())
        t = raw.get("text_config", raw)
        # The Kimi numbering, shortened for a 512-token vocabulary: [BOS] right after the 480 base
        # tokens, [PAD] the last id.
        assert (t["bos_token_id"], t["eos_token_id"], t["pad_token_id"]) == (480, 481, 511)
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (480, 481, 511)
        assert tok.convert_tokens_to_ids("<|im_end|>") == 482 and len(tok) == t["vocab_size"] == 512
        gen = json.loads((path / "generation_config.json").read_text())
        assert gen["eos_token_id"] == [481, 482]
        text = "naïve café 日本語 — def f(x):\n    return x ** 2  # done"
        ids = tok.encode(text)
        assert tok.decode(ids) == text and max(ids) < 480
        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]}]
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert rendered == ("<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
                            "<|im_user|>user<|im_middle|>Hi there<|im_end|><|im_assistant|>assistant<|im_middle|>")
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)
        assert ids[0] == 490 and ids[-1] == 497 and ids.count(482) == 2 and tok.decode(ids) == rendered


def test_full_size_vocabulary_puts_specials_where_k3_has_them(tmp_path):
    t = config_dict("k3-slice", {"num_experts": 16})["text_config"]
    assert (t["bos_token_id"], t["pad_token_id"], t["vocab_size"]) == (163584, 163839, 163840)
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tiktoken.model").write_text(tiktoken_model(163840))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(163840, 1048576)))
    tok = KimiTokenizer(folder)
    assert tok.num_base_tokens == 163584 and len(tok) == 163840
    ids = special_token_ids(163840)
    assert (tok.bos_token_id, tok.pad_token_id, ids["<|im_end|>"], ids["<|im_middle|>"]) == \
        (163584, 163839, 163586, 163601)
    text = "Question: What is the capital of France?"
    assert tok.decode(tok.encode(text)) == text and max(tok.encode(text)) < synthetic.TRAINED_TOKENS


@pytest.mark.skipif(not (KL_CODE_TINY / "tokenizer.json").exists(), reason="kl-code-tiny is not on this machine")
def test_tokenizer_json_checkpoints_keep_working():
    tok = load_tokenizer(KL_CODE_TINY)
    assert not isinstance(tok, KimiTokenizer)
    text = "def add(a, b):\n    return a + b  # ünïcode 日本"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    dec = stream_decoder(tok, ids[:2])
    assert "".join(dec.add(t) for t in ids[2:]) + dec.flush() == tok.decode(ids[2:])


@pytest.mark.parametrize("vocab, conf, message", [
    (b"aGk= x\n", {}, "expected 'base64-token rank'"),
    (b"!!!! 0\n", {}, "expected 'base64-token rank'"),
    (b"aGk= 0\naGk= 1\n", {}, "listed twice"),
    (b"aGk= 5\n", {}, "ranks must be 0..0"),
    (None, {"bos_token": "[NOPE]"}, "bos_token '\\[NOPE\\]' is not one of the added tokens"),
    (None, {"added_tokens_decoder": {"3": {"content": "[BOS]"}}}, "inside the base vocabulary"),
    (None, {"added_tokens_decoder": {"x": {"content": "[BOS]"}}}, "needs a numeric id"),
    (None, {"chat_template": [{"name": "default", "template": "x"}]}, "chat_template must be a string"),
])
def test_bad_tokenizer_files_are_named(tmp_path, vocab, conf, message):
    folder = write_vocab(tmp_path / "tok", [bytes([b]) for b in range(256)] + MERGES, ADDED, **conf)
    if vocab is not None:
        (folder / "tiktoken.model").write_bytes(vocab)
    with pytest.raises(TokenizerError, match=message):
        KimiTokenizer(folder)


def test_missing_byte_or_config_is_named(tmp_path):
    folder = write_vocab(tmp_path / "tok", [bytes([b]) for b in range(255)], {255: "[BOS]", 256: "[EOS]",
                                                                                257: "[PAD]"})
    with pytest.raises(TokenizerError, match="single byte 0xff has no rank"):
        KimiTokenizer(folder)
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(TokenizerError, match="tokenizer_config.json: missing"):
        load_tokenizer(folder)
