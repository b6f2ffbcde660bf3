"""The built-in character tokenizer: one token per character, a real ``PreTrainedTokenizerFast``.

Why a character tokenizer: no model hub is reachable, the built-in tasks are character
strings, and a ~100-token vocabulary keeps the tiny models' embedding and LM-head cheap.
It is an ordinary ``transformers`` tokenizer (``tokenizers`` WordLevel model, a ``Split("",
"isolated")`` pre-tokenizer, a ``Fuse`` decoder), so it saves and loads with
``save_pretrained`` / ``from_pretrained`` like any other and nothing downstream special-cases it.

Special ids: ``<pad>=0``, ``<bos>=1``, ``<eos>=2``, ``<unk>=3``. Encoding with
``add_special_tokens=True`` prepends ``<bos>``; padding is on the left (generation convention).
As in every HF tokenizer, a special token's text inside a string (``"<eos>"``) encodes to
that special token, not to its characters.

Chat template (``CHAR_CHAT_TEMPLATE``, for prompt files with a ``messages`` column): ``<bos>``,
then the turns' contents joined by newlines, each assistant turn closed by ``<eos>``; no role
markers and no generation header. So one user turn renders exactly as the plain prompt encodes
(``"<bos>57+08="``), and a chat of a built-in task prompts the model as its pretraining did.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3

#: Printable ASCII (digits, letters, punctuation, space) plus newline: covers every built-in
#: task and most user prompts; anything else maps to ``<unk>``.
CHARS: str = string.digits + string.ascii_lowercase + string.ascii_uppercase + string.punctuation + " \n"


#: see the module docstring: a single user turn renders as ``<bos>`` + its content
CHAR_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if not loop.first %}{{ '\\n' }}{% endif -%}"
    "{{ message['content'] }}"
    "{%- if message['role'] == 'assistant' %}{{ eos_token }}{% endif -%}"
    "{%- endfor -%}"
)


def char_vocab() -> dict[str, int]:
    """Token -> id: the four specials first, then ``CHARS`` in order."""
    return {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *CHARS])}


def char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character tokenizer (left padding, ``<bos>`` prepended by ``add_special_tokens``)."""
    core = Tokenizer(models.WordLevel(vocab=char_vocab(), unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")  # one token per char
    core.decoder = decoders.Fuse()  # join characters back without separators
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        chat_template=CHAR_CHAT_TEMPLATE,
    )
