"""sentencepiece is the vocabulary: one joint model, or one per language.

Special ids are fixed when the model is trained (pad 0, unk 1, bos 2, eos 3)
and read back from the model file everywhere else.

Text may be normalised before sentencepiece sees it (``data.text``):

- ``raw``: as it is (cased, detokenized), the default.
- ``paper``: as Multi30k papers train, on the dataset's ``lc.norm.tok`` text:
  lowercased, Moses punctuation-normalised and Moses-tokenized (without XML
  escaping). Translations come back Moses-detokenized and lowercased. The
  choice is stored beside the sentencepiece model (``text.json``) and travels
  with it into the run directory, so inputs are always normalised as in training.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm
import torch

from mt.errors import ModelDirError

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

JOINT, SRC, TGT = "spm.model", "spm.src.model", "spm.tgt.model"
TEXT_JSON = "text.json"
TEXT_MODES = ("raw", "paper")


#: Lists shorter than this are encoded and decoded line by line: sentencepiece
#: hands a list to a thread pool made for the call, which costs more than a
#: short line itself, and on a busy machine its threads wait for a core. A
#: service tokenizes a few lines per request (docs/performance.md).
SHORT_LIST = 64


def _encode(proc: spm.SentencePieceProcessor, texts: list[str]) -> list[list[int]]:
    return [proc.encode(t) for t in texts] if len(texts) < SHORT_LIST else proc.encode(texts)


def _decode(proc: spm.SentencePieceProcessor, ids: list[list[int]]) -> list[str]:
    return [proc.decode(x) for x in ids] if len(ids) < SHORT_LIST else proc.decode(ids)


class TextNormalizer:
    """The text side of a tokenizer: what is done to a language's lines before
    sentencepiece (``normalize``) and to its decoded output (``restore``)."""

    def __init__(self, mode: str, lang: str):
        if mode not in TEXT_MODES:
            raise ModelDirError(f"unknown text mode {mode!r} (expected one of {', '.join(TEXT_MODES)})")
        self.mode, self.lang = mode, lang
        if mode == "paper":
            from sacremoses import MosesDetokenizer, MosesPunctNormalizer, MosesTokenizer

            self._norm, self._tok = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
            self._detok = MosesDetokenizer(lang=lang)

    def normalize(self, lines: list[str]) -> list[str]:
        if self.mode == "raw":
            return lines
        return [self._tok.tokenize(self._norm.normalize(x.lower()), return_str=True, escape=False) for x in lines]

    def restore(self, lines: list[str]) -> list[str]:
        if self.mode == "raw":
            return lines
        return [self._detok.detokenize(x.split(), unescape=False) for x in lines]


def write_text_config(directory: Path, mode: str, src_lang: str, tgt_lang: str) -> None:
    """Record the text mode beside the sentencepiece model(s) (only when not raw)."""
    if mode != "raw":
        (Path(directory) / TEXT_JSON).write_text(json.dumps({"mode": mode, "src": src_lang, "tgt": tgt_lang}))


def train_sentencepiece(lines: Iterable[str], prefix: Path, vocab_size: int, model_type: str) -> None:
    """Train a sentencepiece model on ``lines``; writes ``prefix``.model/.vocab."""
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=1.0,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        hard_vocab_limit=False,  # a small corpus may not support the full size
        minloglevel=2,
        num_threads=2,
    )


def pad_batch(seqs: list[list[int]], pad_id: int) -> torch.Tensor:
    """Token id lists -> (B, T) tensor, right-padded with ``pad_id``."""
    out = torch.full((len(seqs), max(len(s) for s in seqs)), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


class Tokenizer:
    """Source and target sentencepiece processors (the same object when joint)."""

    def __init__(
        self,
        src: spm.SentencePieceProcessor,
        tgt: spm.SentencePieceProcessor,
        src_text: TextNormalizer | None = None,
        tgt_text: TextNormalizer | None = None,
    ):
        self.src, self.tgt = src, tgt
        self.src_text = src_text or TextNormalizer("raw", "")
        self.tgt_text = tgt_text or TextNormalizer("raw", "")
        ids = {(p.pad_id(), p.unk_id(), p.bos_id(), p.eos_id()) for p in (src, tgt)}
        if len(ids) != 1:
            raise ModelDirError("source and target sentencepiece models disagree on special ids")
        self.pad_id, self.unk_id, self.bos_id, self.eos_id = ids.pop()
        if self.pad_id < 0:
            raise ModelDirError("the sentencepiece model has no pad id (train it with mt prepare)")

    @property
    def joint(self) -> bool:
        return self.src is self.tgt

    @property
    def lowercase(self) -> bool:
        """Whether translations come out lowercased (``paper`` text)."""
        return self.tgt_text.mode == "paper"

    @staticmethod
    def files(directory: Path) -> list[Path]:
        """The files that make up a tokenizer stored in ``directory``."""
        directory = Path(directory)
        files = [directory / JOINT] if (directory / JOINT).exists() else [directory / SRC, directory / TGT]
        return files + ([directory / TEXT_JSON] if (directory / TEXT_JSON).exists() else [])

    @classmethod
    def load(cls, directory: Path) -> Tokenizer:
        files = [f for f in cls.files(directory) if f.name != TEXT_JSON]
        missing = [f for f in files if not f.exists()]
        if len(missing) == 2:  # neither layout is there: name the usual one, the shared vocabulary
            raise ModelDirError(f"{Path(directory) / JOINT}: tokenizer model missing (or {SRC} and {TGT})")
        if missing:
            raise ModelDirError(f"{missing[0]}: tokenizer model missing")
        procs = []
        for f in files:
            try:
                procs.append(spm.SentencePieceProcessor(model_file=str(f)))
            except (RuntimeError, OSError) as e:  # sentencepiece: "could not parse ModelProto"
                raise ModelDirError(f"{f}: unreadable sentencepiece model ({e})") from None
        text_path = Path(directory) / TEXT_JSON
        if not text_path.exists():
            return cls(procs[0], procs[-1])
        try:
            text = json.loads(text_path.read_text())
            normalizers = TextNormalizer(text["mode"], text["src"]), TextNormalizer(text["mode"], text["tgt"])
        except (json.JSONDecodeError, KeyError, TypeError, ModelDirError) as e:
            raise ModelDirError(f"{text_path}: unreadable text settings ({e})") from None
        return cls(procs[0], procs[-1], *normalizers)

    def encode_src(self, texts: list[str]) -> list[list[int]]:
        """Source pieces followed by EOS (as fairseq, JoeyNMT and Marian do: a
        fixed key that attention can fall back on). A blank line is []."""
        return [ids + [self.eos_id] if ids else [] for ids in _encode(self.src, self.src_text.normalize(texts))]

    def encode_tgt(self, texts: list[str]) -> list[list[int]]:
        """Target pieces, without bos/eos (the batches add them)."""
        return _encode(self.tgt, self.tgt_text.normalize(texts))

    def decode_tgt(self, ids: list[list[int]]) -> list[str]:
        return self.tgt_text.restore(_decode(self.tgt, ids))

    def src_pieces(self, ids: list[int]) -> list[str]:
        return [self.src.id_to_piece(i) for i in ids]

    def tgt_pieces(self, ids: list[int]) -> list[str]:
        return [self.tgt.id_to_piece(i) for i in ids]


class MergeDropout:
    """BPE-dropout (Provilkov et al., 2020) on a sentencepiece BPE model.

    A word is segmented as BPE does it, from characters up, applying at each
    step the highest-ranked merge that yields a vocabulary piece, except that
    each candidate merge is skipped with probability ``p`` at that step (it
    may be applied at a later one). With ``p = 0`` this is exactly
    sentencepiece's segmentation. sentencepiece has a sampling mode of its
    own, but its random stream cannot be reproduced across processes, so a
    run could be neither repeated nor resumed; here ``rng`` drives every draw.
    """

    def __init__(self, proc: spm.SentencePieceProcessor):
        self.proc = proc
        self.rank = {
            proc.id_to_piece(i): proc.get_score(i)  # higher = merged earlier
            for i in range(proc.get_piece_size())
            if not (proc.is_control(i) or proc.is_unknown(i) or proc.is_unused(i))
        }

    def words(self, texts: list[str]) -> list[list[str]]:
        """Each line as sentencepiece's normalised words (``▁`` marks where a
        word starts), read off its deterministic segmentation."""
        out = []
        for pieces in self.proc.encode(texts, out_type=str):
            words: list[str] = []
            for piece in pieces:
                if piece.startswith("▁") or not words:
                    words.append(piece)
                else:
                    words[-1] += piece
            out.append(words)
        return out

    def segment(self, word: str, p: float, rng: random.Random) -> list[str]:
        symbols: list[str] = []
        for ch in word:  # characters; a run of unknown ones is one symbol (one <unk>), as in sentencepiece
            if ch not in self.rank and symbols and symbols[-1] not in self.rank:
                symbols[-1] += ch
            else:
                symbols.append(ch)
        while len(symbols) > 1:
            best, at = None, -1
            for i in range(len(symbols) - 1):
                score = self.rank.get(symbols[i] + symbols[i + 1])
                # A candidate that cannot beat the best kept one needs no draw.
                if score is not None and (best is None or score > best) and (p == 0 or rng.random() >= p):
                    best, at = score, i
            if at < 0:
                break
            symbols[at : at + 2] = [symbols[at] + symbols[at + 1]]
        return symbols

    def sample(self, words: list[str], p: float, rng: random.Random) -> list[int]:
        """The ids of one line (given as ``words``) under BPE-dropout ``p``."""
        return [self.proc.piece_to_id(piece) for word in words for piece in self.segment(word, p, rng)]
