"""sentencepiece is the vocabulary: one joint model, or one per language.

Special ids are fixed when the model is trained (pad 0, unk 1, bos 2, eos 3)
and read back from the model file everywhere else.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm
import torch

from mt.errors import ModelDirError

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

JOINT, SRC, TGT = "spm.model", "spm.src.model", "spm.tgt.model"


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

    def __init__(self, src: spm.SentencePieceProcessor, tgt: spm.SentencePieceProcessor):
        self.src, self.tgt = src, tgt
        ids = {(p.pad_id(), p.unk_id(), p.bos_id(), p.eos_id()) for p in (src, tgt)}
        if len(ids) != 1:
            raise ModelDirError("source and target sentencepiece models disagree on special ids")
        self.pad_id, self.unk_id, self.bos_id, self.eos_id = ids.pop()
        if self.pad_id < 0:
            raise ModelDirError("the sentencepiece model has no pad id (train it with mt prepare)")

    @property
    def joint(self) -> bool:
        return self.src is self.tgt

    @staticmethod
    def files(directory: Path) -> list[Path]:
        """The model files that make up a tokenizer stored in ``directory``."""
        directory = Path(directory)
        if (directory / JOINT).exists():
            return [directory / JOINT]
        return [directory / SRC, directory / TGT]

    @classmethod
    def load(cls, directory: Path) -> Tokenizer:
        files = cls.files(directory)
        for f in files:
            if not f.exists():
                raise ModelDirError(f"{f}: tokenizer model missing")
        procs = [spm.SentencePieceProcessor(model_file=str(f)) for f in files]
        return cls(procs[0], procs[-1])

    def encode_src(self, texts: list[str]) -> list[list[int]]:
        """Source pieces followed by EOS (as fairseq, JoeyNMT and Marian do: a
        fixed key that attention can fall back on). A blank line is []."""
        return [ids + [self.eos_id] if ids else [] for ids in self.src.encode(texts)]

    def encode_tgt(self, texts: list[str]) -> list[list[int]]:
        """Target pieces, without bos/eos (the batches add them)."""
        return self.tgt.encode(texts)

    def decode_tgt(self, ids: list[list[int]]) -> list[str]:
        return self.tgt.decode(ids)

    def src_pieces(self, ids: list[int]) -> list[str]:
        return [self.src.id_to_piece(i) for i in ids]

    def tgt_pieces(self, ids: list[int]) -> list[str]:
        return [self.tgt.id_to_piece(i) for i in ids]
