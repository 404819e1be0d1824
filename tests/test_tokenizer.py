"""The offline Qwen2.5 and Qwen3 tokenizers against tiktoken with the same ranks, pattern and added
tokens."""

import random
import unicodedata

import pytest

from sem_jax.model.tokenizer import (QWEN3_ADDED_TOKENS, QWEN25_ADDED_TOKENS, QWEN25_PATTERN, load_tokenizer,
                                     qwen25_ranks_file, save_tokenizer)

FRAGMENTS = [
    "The quick brown fox", " jumps over", " the lazy dog.", "Who was the mayor of Paris in 1850?",
    "def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) { s += a[i]; }", "#include <stdio.h>",
    "12345", "3.14159", " 2024-11-29", "1,000,000", "0x1F", "  ", "\n\n", "\t\t", "   \n  \n",
    "北京是中国的首都。", "東京タワー", "한국어 문장", "Ελληνικά", "русский текст", "مرحبا",
    "😀", "👨‍👩‍👧", "🇫🇷", "naïve café", "e\u0301", "A\u030a", "I'm", " you'll", "THEY'RE",
    "<search>capital of France</search>", "</search>", "?</search>\n\n", "<answer>42</answer>",
    "<think>", "</think>\n\n", "<tool_response>\n{}</tool_response>", "<tool_call>", "<|im_end|>", "!!!", "...", " --", "$$x^2$$", "¿Qué?", "\u00a0", "ﬁ", "\U0001d400",
]


def _strings(n=300, seed=0):
    rng = random.Random(seed)
    out = list(FRAGMENTS)
    while len(out) < n:
        out.append("".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(2, 6))))
    return out


@pytest.fixture(scope="module")
def tiktoken_enc():
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import load_tiktoken_bpe
    return tiktoken.Encoding("qwen2.5", pat_str=QWEN25_PATTERN, mergeable_ranks=load_tiktoken_bpe(qwen25_ranks_file()),
                             special_tokens={c: 151643 + i for i, (c, _) in enumerate(QWEN25_ADDED_TOKENS)})


def test_ids_match_tiktoken(qwen25_tokenizer, tiktoken_enc):
    strings = _strings()
    assert len(strings) >= 300
    for s in strings:
        # The HF tokenizer applies NFC first (Qwen2.5 does); tiktoken has no normaliser.
        want = tiktoken_enc.encode(unicodedata.normalize("NFC", s), allowed_special="all")
        got = qwen25_tokenizer.encode(s, add_special_tokens=False)
        assert got == want, repr(s)
        assert qwen25_tokenizer.decode(got) == unicodedata.normalize("NFC", s)


def test_qwen3_ids_match_tiktoken_with_its_added_tokens(qwen3_tokenizer, qwen25_tokenizer):
    """Qwen3's vocabulary: Qwen2.5's ranks with every added token at its real id, matched whole in
    text (tiktoken's special tokens, all allowed); text without them tokenizes as in Qwen2.5."""
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import load_tiktoken_bpe
    added = {content: 151643 + i for i, (content, _) in enumerate(QWEN3_ADDED_TOKENS)}
    assert [added[t] for t in ("<tool_response>", "</tool_response>", "<think>", "</think>")] == \
        [151665, 151666, 151667, 151668]
    enc = tiktoken.Encoding("qwen3", pat_str=QWEN25_PATTERN, mergeable_ranks=load_tiktoken_bpe(qwen25_ranks_file()),
                            special_tokens=added)
    tok = qwen3_tokenizer
    assert len(tok) == 151669 and tok.convert_tokens_to_ids(list(added)) == list(added.values())
    with_tags = 0
    for s in _strings():
        want = enc.encode(unicodedata.normalize("NFC", s), allowed_special="all")
        assert tok.encode(s, add_special_tokens=False) == want, repr(s)
        assert tok.decode(want) == unicodedata.normalize("NFC", s)
        if not any(t in s for t in ("<think>", "</think>", "<tool_response>", "</tool_response>")):
            assert qwen25_tokenizer.encode(s, add_special_tokens=False) == want
        else:
            with_tags += 1
    assert with_tags > 20
    # Qwen3's tags are added tokens that are not special: decoding keeps them.
    assert tok.decode([151667, 151668], skip_special_tokens=True) == "<think></think>"


def test_qwen3_chat_template_is_the_protocols_prompt_with_thinking_on(qwen3_tokenizer):
    """The SEM prompt is Qwen3's chat template with thinking enabled (its default): the answer's
    first `<think>` block is Qwen3's reasoning block. Thinking off adds the empty block that SEM's
    format does not use."""
    from sem_jax.data.example import Example
    from sem_jax.protocol import SEM

    ex = Example("q", "Who wrote Hamlet?", ("Shakespeare",), "mmlu", False)
    messages = [{"role": "system", "content": SEM.system_prompt}, {"role": "user", "content": ex.question}]
    on = qwen3_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert qwen3_tokenizer.decode(SEM.encode_prompt(qwen3_tokenizer, ex)) == on
    off = qwen3_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                              enable_thinking=False)
    assert off == on + "<think>\n\n</think>\n\n"


def test_special_tokens(qwen25_tokenizer):
    tok = qwen25_tokenizer
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    assert tok.convert_tokens_to_ids("<|file_sep|>") == 151643 + len(QWEN25_ADDED_TOKENS) - 1 == 151664
    assert len(tok) == 151665
    assert tok.eos_token_id == 151645 and tok.pad_token_id == 151643
    assert tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False) == \
        [151644, 872, 198, 6023, 151645]


def test_save_and_load_tokenizer_json(qwen25_tokenizer, tmp_path):
    qwen25_tokenizer.save_pretrained(str(tmp_path))
    assert (tmp_path / "tokenizer.json").exists()
    again = load_tokenizer(str(tmp_path))
    for s in _strings(40, seed=1):
        assert again.encode(s, add_special_tokens=False) == qwen25_tokenizer.encode(s, add_special_tokens=False)
    text = again.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "missing"))


def test_a_tokenizer_saved_again_keeps_its_source_class(qwen25_tokenizer, tmp_path):
    """Loaded without AutoTokenizer (no torch import), saved again (sem_jax.export) under the
    class its source named, and loaded by AutoTokenizer as that class with the same ids."""
    import json

    from transformers import AutoTokenizer

    src, out = tmp_path / "src", tmp_path / "out"
    qwen25_tokenizer.save_pretrained(str(src))
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps(dict(config, tokenizer_class="Qwen2Tokenizer")))
    save_tokenizer(load_tokenizer(str(src)), str(out))
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"
    again = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert type(again).__name__ == "Qwen2Tokenizer"
    for s in _strings(40, seed=2):
        assert again.encode(s, add_special_tokens=False) == qwen25_tokenizer.encode(s, add_special_tokens=False)


def test_a_directory_without_tokenizer_files_says_so(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path}: no tokenizer in this directory \(looked for "
                                                r"tokenizer\.json, vocab\.json\)"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="tokenizer directory not found"):
        load_tokenizer(str(tmp_path / "nowhere"))


def test_a_damaged_tokenizer_json_is_named(qwen25_tokenizer, tmp_path):
    """A tokenizer.json cut short, or without its `added_tokens`: a sentence naming the file (it was
    a bare `KeyError: 'added_tokens'` or the tokenizers library's parse error)."""
    import json

    qwen25_tokenizer.save_pretrained(str(tmp_path / "ok"))
    text = (tmp_path / "ok" / "tokenizer.json").read_text()
    for name, damaged in (("cut", text[:len(text) // 2]),
                          ("keyless", json.dumps({k: v for k, v in json.loads(text).items() if k != "added_tokens"}))):
        d = tmp_path / name
        d.mkdir()
        (d / "tokenizer.json").write_text(damaged)
        with pytest.raises(ValueError, match=rf"{d}/tokenizer.json \(or tokenizer_config.json beside it\): not a "
                                             r"readable tokenizer \(.*the file may be damaged"):
            load_tokenizer(str(d))
