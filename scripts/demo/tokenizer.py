"""The demo model's tokenizer: byte-level BPE trained on the demo corpus, DeepSeek-V4 specials first.

Pre-tokenization does not split at spaces (ByteLevel without its regex), so the fixed parts of the
chat format (the tool-section preamble, DSML markup, schema JSON) merge into long tokens and a
tool prompt stays a few dozen tokens: that is what lets a small model train on this CPU. It does
isolate capitalised words (and runs of them: "La Paz"), so a name is split into the same tokens
wherever it stands: in the user's words, a tool call's argument or a tool result. Copying a name
is then copying a token sequence, which a small model learns; otherwise a name merged with its
neighbours ("in Paris?") would have to be re-spelled in different tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from dsv4.tiny import SPECIAL_TOKENS, TEXT_TOKENS

CAPITALISED_WORDS = r"[A-Z][a-z]*(?:[ -][A-Z][a-z]*)*"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(CAPITALISED_WORDS), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
                                  max_token_length=256)
    # Special tokens are always matched whole before BPE runs; learning merges over their bytes would
    # waste vocabulary on sequences that only a malfunctioning model could emit.
    split = re.compile("|".join(re.escape(token) for token in SPECIAL_TOKENS))
    tokenizer.train_from_iterator((piece for text in texts for piece in split.split(text) if piece), trainer=trainer)
    # As in dsv4.tiny: the reasoning/tool-call markers stay in decoded text, the others are special.
    spec = json.loads(tokenizer.to_str())
    for added in spec["added_tokens"]:
        added["special"] = added["content"] not in TEXT_TOKENS
    tokenizer = HFTokenizer.from_str(json.dumps(spec))
    for token_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != token_id:
            raise RuntimeError(f"special token {token!r} is not at id {token_id}")
    return tokenizer
