"""The embedded task's character-level tokenizer, as a transformers ``PreTrainedTokenizerFast``.

Every character of the chain task (digits, ``+ - * = # ? :``, space and the 52 step labels) is one token; ``<bos>`` is
prepended by the post-processor, ``<eos>`` ends a response, anything else maps to ``<unk>``. It is built with the
``tokenizers`` library and saved beside the model (``tokenizer.json`` + ``tokenizer_config.json``), so
``transformers.AutoTokenizer.from_pretrained(model_dir)`` loads it with no network.

Departures: none from the paper (which uses the models' own BPE tokenizers); a real model brings its own
tokenizer, loaded by :func:`load_tokenizer` from the same local folder.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import BadInput, NotFound

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
LABELS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
CHARS = "0123456789+-*=#?: " + LABELS


def build_tokenizer(chars: str = CHARS):
    """The chain task's tokenizer: ids 0-3 are ``<pad> <bos> <eos> <unk>``, then one id per character of ``chars``
    (another alphabet gives a character tokenizer for other text, e.g. small test models on word problems)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + tuple(dict.fromkeys(chars)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=1024, clean_up_tokenization_spaces=False)


def load_tokenizer(path: str | os.PathLike):
    """Load the tokenizer saved in a local model folder (ours or a real model's), never from a hub."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise NotFound(f"no tokenizer in {str(path)!r}: the folder needs tokenizer.json / "
                       "tokenizer_config.json (save it with tokenizer.save_pretrained(folder))")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:                           # noqa: BLE001 - tokenizers/transformers raise many kinds
        raise BadInput(f"the tokenizer in {str(path)!r} cannot be loaded ({type(e).__name__}: "
                       f"{' '.join(str(e).split())[:300]}); copy tokenizer.json / tokenizer_config.json from the "
                       "original model again") from None
