"""Text tokenizer: Qwen2 byte-level BPE plus the CosyVoice 2 or 3 special tokens -> list[int].

Reads a `CosyVoice-BlankEN`-style directory: `vocab.json` + `merges.txt` + `tokenizer_config.json`
(the Qwen2 layout), or `tokenizer.json` when present. Without `tokenizer.json` the pipeline is rebuilt
the way a fast Qwen2 tokenizer is: NFC normaliser, Qwen2's split regex, byte-level mapping, BPE without
unknown token. The CosyVoice specials are then added in the official order, so for the real vocabulary
(151643 BPE entries + 3 Qwen specials) `<|endofprompt|>` = 151646 and `len(tokenizer)` = 151663.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from vocalis.config import ENDOFPROMPT_TOKEN, ENDOFSYSTEM_TOKEN
from vocalis.errors import ModelLoadError

logger = logging.getLogger(__name__)

# Qwen2's pre-tokenizer split pattern (digits are split one by one).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Specials native to the Qwen2 vocabulary, at ids base, base+1, base+2.
QWEN_SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# `additional_special_tokens` of CosyVoice2Tokenizer, in the official order. The first two already exist,
# so the 17 others are appended in this order.
COSYVOICE_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|im_start|>",
    "<|im_end|>",
    ENDOFPROMPT_TOKEN,
    "[breath]",
    "<strong>",
    "</strong>",
    "[noise]",
    "[laughter]",
    "[cough]",
    "[clucking]",
    "[accent]",
    "[quick_breath]",
    "<laughter>",
    "</laughter>",
    "[hissing]",
    "[sigh]",
    "[vocalized-noise]",
    "[lipsmack]",
    "[mn]",
)

# The phone tokens CosyVoice3Tokenizer adds after `<|endofsystem|>`, in its order (each written "[name]"): ARPAbet
# phones with stress digits, then pinyin initials and finals with tone marks.
_CV3_CMU_PHONES = """
    AA AA0 AA1 AA2 AE AE0 AE1 AE2 AH AH0 AH1 AH2 AO AO0 AO1 AO2 AW AW0 AW1 AW2 AY AY0 AY1 AY2 B CH D DH EH EH0 EH1
    EH2 ER ER0 ER1 ER2 EY EY0 EY1 EY2 F G HH IH IH0 IH1 IH2 IY IY0 IY1 IY2 JH K L M N NG OW OW0 OW1 OW2 OY OY0 OY1
    OY2 P R S SH T TH UH UH0 UH1 UH2 UW UW0 UW1 UW2 V W Y Z ZH
"""
_CV3_PINYIN_PHONES = """
    a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè ié iòng ióng iù iú
    iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p q r s sh t u uang ue un uo uà uài
    uàn uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī uō uǎ uǎi uǎn uǎng uǐ uǒ vè w x y z zh à ài
    àn àng ào á ái án áng áo è èi èn èng èr é éi én éng ér ì ìn ìng í ín íng ò òng òu ó óng óu ù ùn ú ún ā āi ān
    āng āo ē ēi ēn ēng ě ěi ěn ěng ěr ī īn īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ
"""
# `additional_special_tokens` of CosyVoice3Tokenizer: CosyVoice 2's list, `<|endofsystem|>`, the phone tokens. With the
# real vocabulary `<|endofsystem|>` = 151663, the last phone 151923 and `len(tokenizer)` = 151924.
COSYVOICE3_SPECIAL_TOKENS: tuple[str, ...] = (
    *COSYVOICE_SPECIAL_TOKENS,
    ENDOFSYSTEM_TOKEN,
    *(f"[{p}]" for p in (_CV3_CMU_PHONES + _CV3_PINYIN_PHONES).split()),
)
SPECIAL_TOKENS = {"cosyvoice2": COSYVOICE_SPECIAL_TOKENS, "cosyvoice3": COSYVOICE3_SPECIAL_TOKENS}


def qwen2_pipeline(model: BPE) -> Tokenizer:
    """Wrap a byte-level BPE model in the Qwen2 normaliser / pre-tokenizer / decoder pipeline."""
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _added_token(entry: dict) -> AddedToken:
    return AddedToken(
        entry["content"],
        single_word=entry.get("single_word", False),
        lstrip=entry.get("lstrip", False),
        rstrip=entry.get("rstrip", False),
        normalized=entry.get("normalized", False),
        special=entry.get("special", True),
    )


def _from_vocab_merges(directory: Path) -> Tokenizer:
    missing = [n for n in ("vocab.json", "merges.txt", "tokenizer_config.json") if not (directory / n).is_file()]
    if missing:
        raise ModelLoadError(f"tokenizer directory {directory} lacks {', '.join(missing)} (and has no tokenizer.json)")
    vocab, merges = BPE.read_file(str(directory / "vocab.json"), str(directory / "merges.txt"))
    tokenizer = qwen2_pipeline(BPE(vocab, merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    # Added tokens are appended in id order; each must land on the id the config declares.
    for token_id, entry in sorted(config.get("added_tokens_decoder", {}).items(), key=lambda kv: int(kv[0])):
        existing = tokenizer.token_to_id(entry["content"])
        if existing is None:
            token = _added_token(entry)
            if token.special:
                tokenizer.add_special_tokens([token])
            else:
                tokenizer.add_tokens([token])
            existing = tokenizer.token_to_id(entry["content"])
        if existing != int(token_id):
            raise ModelLoadError(
                f"{directory / 'tokenizer_config.json'}: {entry['content']!r} declared as id {token_id} "
                f"but lands on {existing}; vocab.json does not match the config"
            )
    return tokenizer


class TextTokenizer:
    """Qwen2 BPE + CosyVoice specials. `encode` adds no BOS/EOS, like the official `encode`."""

    def __init__(self, tokenizer: Tokenizer, base_vocab_size: int, family: str = "cosyvoice2") -> None:
        if family not in SPECIAL_TOKENS:
            raise ValueError(f"unknown model family {family!r}: one of {', '.join(SPECIAL_TOKENS)}")
        self.tokenizer = tokenizer
        self.base_vocab_size = base_vocab_size
        specials = SPECIAL_TOKENS[family]
        # Same rule as the official `add_special_tokens`: tokens already present keep their ids, new ones are
        # appended in list order. With Qwen2's 3 native specials this gives <|endofprompt|> = base + 3.
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        expected = {t: tokenizer.token_to_id(t) for t in (*QWEN_SPECIAL_TOKENS, *specials)}
        missing = [t for t, i in expected.items() if i is None]
        if missing:
            raise ModelLoadError(f"tokenizer lacks special tokens {missing}")
        canonical = base_vocab_size + len(QWEN_SPECIAL_TOKENS)
        if expected[ENDOFPROMPT_TOKEN] != canonical:
            logger.warning("non-standard special-token layout: %s = %d (CosyVoice 2 uses base vocabulary + 3 = %d)",
                           ENDOFPROMPT_TOKEN, expected[ENDOFPROMPT_TOKEN], canonical)
        self.endofprompt_id: int = expected[ENDOFPROMPT_TOKEN]
        self.endoftext_id: int = expected["<|endoftext|>"]

    @classmethod
    def from_dir(cls, directory: str | Path, family: str = "cosyvoice2") -> TextTokenizer:
        """Load from a `CosyVoice-BlankEN`-style directory (real Qwen2 files or the bundled tiny ones), with the
        special tokens of `family` ("cosyvoice2", or "cosyvoice3": 261 more, `<|endofsystem|>` and phone tokens)."""
        directory = Path(directory)
        if not directory.is_dir():
            raise ModelLoadError(f"tokenizer directory {directory} does not exist")
        if (directory / "tokenizer.json").is_file():
            tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        else:
            tokenizer = _from_vocab_merges(directory)
        base = tokenizer.get_vocab_size(with_added_tokens=False)
        logger.debug("tokenizer %s: %d BPE entries", directory, base)
        return cls(tokenizer, base, family)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; inline special tokens (`[laughter]`, `<|endofprompt|>`, ...) map to one id each."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def count(self, text: str) -> int:
        """Number of tokens of `text`: the length measure `split_paragraph` uses for English."""
        return len(self.encode(text))

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)
