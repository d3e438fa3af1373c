"""A byte-level BPE tokenizer trained offline, with ChatML special tokens and chat template, saved
the way Hugging Face folders carry one (tokenizer.json + tokenizer_config.json), so that
transformers' AutoTokenizer and mlx-lm's TokenizerWrapper load it like a hub model's."""

import inspect
import json
import warnings
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def training_corpus() -> list[str]:
    """English prose and code that every Python install carries: the standard library's docstrings."""
    import collections
    import email
    import json as json_module
    import logging
    import pathlib
    import textwrap
    import typing

    texts = []
    with warnings.catch_warnings():  # typing.io / typing.re warn when touched
        warnings.simplefilter("ignore", DeprecationWarning)
        for module in (collections, email, json_module, logging, pathlib, textwrap, typing, inspect):
            for _, obj in inspect.getmembers(module):
                doc = inspect.getdoc(obj)
                if doc:
                    texts.append(doc)
    texts.append("The capital of France is Paris. Hello, world! Ünïcödé: 日本語 테스트 😀 — naïve café.")
    return texts


def train_tokenizer(dest: Path, vocab_size: int = 2048) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    dest = Path(dest)
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<pad>",
                "unk_token": None,
                "model_max_length": 4096,
                "chat_template": CHATML_TEMPLATE,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    (dest / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<pad>"}))
    return tok
