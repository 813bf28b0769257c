import functools
import gzip
import hashlib
import http.server
import random
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import write_corpus

from mt.cli.main import main
from mt.config import ConfigError, DataConfig
from mt.data.batches import Split, TokenBatchSampler, TranslationDataModule, padding_waste
from mt.data.prepare import prepare
from mt.data.tokenizer import MergeDropout, TextNormalizer, Tokenizer
from mt.errors import DataError


@pytest.mark.parametrize("gz", [False, True])
def test_prepare_and_batches(tmp_path, data_cfg, corpus_splits, gz):
    if gz:
        write_corpus(tmp_path / "rawgz", corpus_splits, gz=True)
        data_cfg.local_dir = str(tmp_path / "rawgz")
    summary = prepare(data_cfg, verbose=False)
    assert set(summary["splits"]) == {"train", "val", "test_2016_flickr"}
    assert summary["splits"]["val"]["kept"] == 40
    assert 0 <= summary["train_batches"]["padding_waste"] < 0.1
    tok = Tokenizer.load(data_cfg.prepared_path())
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
    assert tok.joint

    dm = TranslationDataModule(data_cfg, seed=5)
    dm.setup()
    train = dm.split("train")
    assert train.src_text == corpus_splits["train"][0]
    assert tok.decode_tgt(train.tgt[:3]) == corpus_splits["train"][1][:3]
    seen = []
    for batch in dm.train_dataloader():
        b, t_s = batch.src.shape
        assert batch.tgt_in.shape == batch.tgt_out.shape and batch.tgt_in.size(0) == b
        assert b * max(t_s, batch.tgt_in.size(1)) <= data_cfg.max_tokens
        assert torch.all(batch.tgt_in[:, 0] == tok.bos_id)
        for row, i in enumerate(batch.index.tolist()):
            # teacher forcing: tgt_in = bos y, tgt_out = y eos, then padding
            y = train.tgt[i]
            assert batch.tgt_in[row][batch.tgt_mask[row]].tolist() == [tok.bos_id, *y]
            assert batch.tgt_out[row][batch.tgt_mask[row]].tolist() == [*y, tok.eos_id]
            assert batch.src[row][batch.src_mask[row]].tolist() == train.src[i]
            assert not batch.src_mask[row, len(train.src[i]) :].any()
        seen.extend(batch.index.tolist())
    assert sorted(seen) == list(range(len(train)))  # no pair lost or repeated


def lengths(n=500, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 40, (n,), generator=g).tolist(), torch.randint(1, 40, (n,), generator=g).tolist()


def test_sampler_is_deterministic_per_seed_and_epoch():
    src, tgt = lengths()
    a, b = TokenBatchSampler(src, tgt, 400, seed=1), TokenBatchSampler(src, tgt, 400, seed=1)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first and sorted(sum(list(a), [])) == sorted(sum(first, []))
    assert list(TokenBatchSampler(src, tgt, 400, seed=2)) != first
    ordered = TokenBatchSampler(src, tgt, 400, shuffle=False)
    assert list(ordered) == list(TokenBatchSampler(src, tgt, 400, shuffle=False, seed=9))
    # correlated lengths, as in real parallel text: little padding
    tgt_like = [max(1, n + d) for n, d in zip(src, torch.randint(-2, 3, (len(src),)).tolist())]
    assert padding_waste(TokenBatchSampler(src, tgt_like, 400).all_batches(), src, tgt_like) < 0.1


def test_two_rank_sharding():
    src, tgt = lengths(777)
    full = TokenBatchSampler(src, tgt, 300, seed=4).all_batches()
    shards = [list(TokenBatchSampler(src, tgt, 300, seed=4, rank=r, world_size=2)) for r in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == len(full) // 2
    assert len(TokenBatchSampler(src, tgt, 300, seed=4, rank=1, world_size=2)) == len(shards[1])
    flat = [i for shard in shards for b in shard for i in b]
    assert len(flat) == len(set(flat))  # distinct shares
    assert set(map(tuple, shards[0] + shards[1])) <= set(map(tuple, full))


def test_misaligned_split_names_both_files_and_counts(data_cfg, tmp_path):
    (tmp_path / "raw" / "val.de").write_text("one line\n")
    with pytest.raises(DataError, match=r"val\.en has 40 lines.*val\.de has 1"):
        prepare(data_cfg, verbose=False)


@pytest.mark.parametrize("gz", [False, True])
def test_invalid_utf8_names_file_and_line(data_cfg, tmp_path, gz):
    data = b"fine\nalso fine\nbad \xff byte\n" + b"x\n" * 37
    if gz:
        (tmp_path / "raw" / "val.de").unlink()
        (tmp_path / "raw" / "val.de.gz").write_bytes(gzip.compress(data))
    else:
        (tmp_path / "raw" / "val.de").write_bytes(data)
    with pytest.raises(DataError, match=r"val\.de(\.gz)?:3: invalid UTF-8"):
        prepare(data_cfg, verbose=False)


def test_filters_apply_to_training_only(data_cfg, tmp_path, corpus_splits):
    src, tgt = (list(x) for x in corpus_splits["train"])
    src[0], tgt[1] = "", ""  # empty pairs
    src[2] = " ".join(["cat"] * 70)  # over-long
    src[3], tgt[3] = "cat", " ".join(["taco dog"] * 6)  # extreme ratio
    vsrc, vtgt = (list(x) for x in corpus_splits["val"])
    vsrc[0] = ""
    write_corpus(tmp_path / "raw", {"train": (src, tgt), "val": (vsrc, vtgt)})
    summary = prepare(data_cfg, verbose=False)
    train = summary["splits"]["train"]
    assert train["dropped_by_reason"] == {"empty": 2, "too long": 1, "length ratio": 1}
    assert train["kept"] == len(src) - 4
    assert summary["splits"]["val"]["kept"] == len(vsrc)  # references stay aligned
    assert Split(data_cfg.prepared_path() / "val").src_text[0] == ""


def test_second_prepare_reuses_and_says_so(data_cfg, capsys):
    prepare(data_cfg)
    model = data_cfg.prepared_path() / "spm.model"
    stamp = model.stat().st_mtime_ns
    capsys.readouterr()
    prepare(data_cfg)
    assert "up to date" in capsys.readouterr().out
    assert model.stat().st_mtime_ns == stamp
    # another max_tokens reuses the data, and the batch figures it prints are for that max_tokens
    first = prepare(data_cfg, verbose=False)["train_batches"]
    data_cfg.max_tokens = first["max_tokens"] // 4
    again = prepare(data_cfg)["train_batches"]
    assert "up to date" in capsys.readouterr().out and model.stat().st_mtime_ns == stamp
    assert again["max_tokens"] == data_cfg.max_tokens and again["batches"] > first["batches"]
    data_cfg.vocab_size = 50  # a config change invalidates it
    prepare(data_cfg)
    assert "prepared" in capsys.readouterr().out
    assert not Path(str(data_cfg.prepared_path()) + ".partial").exists()


def test_separate_vocabularies_and_reverse_pair(data_cfg):
    data_cfg.joint_vocab = False
    data_cfg.src_lang, data_cfg.tgt_lang = "de", "en"
    data_cfg.spm_model_type = "unigram"
    prepare(data_cfg, verbose=False)
    tok = Tokenizer.load(data_cfg.prepared_path())
    assert not tok.joint
    dm = TranslationDataModule(data_cfg)
    assert dm.split("train").src_text[0].endswith("o")  # German-side toy words


@pytest.fixture
def http_dir(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_download_verifies_checksums(tmp_path, monkeypatch, http_dir, corpus_splits):
    monkeypatch.chdir(tmp_path)
    root, base = http_dir
    write_corpus(root, corpus_splits, gz=True)
    sums = tmp_path / "sums.sha256"
    sums.write_text("".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in root.iterdir()))
    cfg = DataConfig(
        corpus="synth", source="download", url=base + "/{split}.{lang}.gz", checksums=str(sums),
        download_splits=["train", "val"], vocab_size=60, max_tokens=512, max_len=60,
    )  # fmt: skip
    summary = prepare(cfg, verbose=False)
    assert set(summary["splits"]) == {"train", "val"}
    assert (tmp_path / "data/raw/synth/train.en.gz").read_bytes() == (root / "train.en.gz").read_bytes()

    # a file that changed upstream: rejected, nothing left that looks complete
    (root / "val.de.gz").write_bytes(gzip.compress(b"tampered\n" * 40))
    (tmp_path / "data/raw/synth/val.de.gz").unlink()
    with pytest.raises(DataError, match="checksum mismatch"):
        prepare(cfg, verbose=False)
    assert sorted(p.name for p in (tmp_path / "data/raw/synth").iterdir()) == sorted(
        ["train.en.gz", "train.de.gz", "val.en.gz"]
    )

    cfg.url = base + "/missing/{split}.{lang}.gz"
    with pytest.raises(DataError, match="--data-dir"):
        prepare(cfg, verbose=False)


def test_download_fetches_the_tokenized_references_for_paper_bleu(
    tmp_path, monkeypatch, http_dir, corpus_splits, capsys
):
    """The downloaded corpus brings the tokenized test references that `mt evaluate --paper`
    needs; a reference that cannot be fetched is a warning, not a failed prepare."""
    from mt.evaluate.scoring import find_paper_reference

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MT_DATA_DIR", raising=False)
    root, base = http_dir
    write_corpus(root, corpus_splits, gz=True)
    (root / "tok").mkdir()
    (root / "tok" / "test_2016_flickr.lc.norm.tok.de").write_text("a tokenized reference .\n" * 30)
    sums = tmp_path / "sums.sha256"
    files = [p for p in root.rglob("*") if p.is_file()]
    sums.write_text("".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in files))
    cfg = DataConfig(
        corpus="synth", source="download", url=base + "/{split}.{lang}.gz", checksums=str(sums),
        paper_ref_url=base + "/tok/{split}.lc.norm.tok.{lang}", paper_ref_splits=["test_2016_flickr", "val"],
        vocab_size=60, max_tokens=512, max_len=60,
    )  # fmt: skip
    prepare(cfg, verbose=False)
    fetched = tmp_path / "data/raw/synth/tok/test_2016_flickr.lc.norm.tok.de"
    assert fetched.read_bytes() == (root / "tok" / "test_2016_flickr.lc.norm.tok.de").read_bytes()
    assert not (tmp_path / "data/raw/synth/tok/val.lc.norm.tok.de").exists()  # no sha256 known: skipped
    assert find_paper_reference({"corpus": "synth", "tgt_lang": "de"}, "test_2016_flickr") == Path(
        "data/raw/synth/tok/test_2016_flickr.lc.norm.tok.de"
    )
    fetched.unlink()
    cfg.paper_ref_url = base + "/missing/{split}.lc.norm.tok.{lang}"
    prepare(cfg, verbose=False)  # the corpus itself is all there: it goes on
    assert "warning: no paper-style BLEU for test_2016_flickr" in capsys.readouterr().err
    assert find_paper_reference({"corpus": "synth", "tgt_lang": "de"}, "test_2016_flickr") is None


def test_hf_dataset_saved_to_disk(tmp_path, monkeypatch, corpus_splits):
    import datasets

    monkeypatch.chdir(tmp_path)
    dd = datasets.DatasetDict(
        {
            name: datasets.Dataset.from_dict({"translation": [{"en": s, "de": t} for s, t in zip(*sides)]})
            for name, sides in corpus_splits.items()
        }
    )
    dd.save_to_disk(str(tmp_path / "hf"))
    cfg = DataConfig(corpus="synth-hf", hf_name=str(tmp_path / "hf"), vocab_size=60, max_tokens=512, max_len=60)
    summary = prepare(cfg, verbose=False)
    assert summary["splits"]["val"]["kept"] == 40
    assert Split(cfg.prepared_path() / "train").tgt_text == corpus_splits["train"][1]


def test_cli_prepare_reports_errors_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("data:\n  corpus: x\n")
    assert main(["prepare", "--config", "c.yaml", "--data-dir", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err
    assert "nowhere: corpus directory does not exist" in err and "Traceback" not in err
    assert main(["prepare", "--config", "c.yaml", "data.vocab_sise=5"]) == 1
    assert "unknown key data.vocab_sise" in capsys.readouterr().err


def test_unreachable_hf_dataset_is_one_line(tmp_path, monkeypatch, capsys):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hub")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets, "load_dataset", offline)
    (tmp_path / "c.yaml").write_text("data:\n  corpus: x\n  source: hf\n  hf_name: someone/corpus\n")
    assert main(["prepare", "--config", "c.yaml"]) == 1
    err = capsys.readouterr().err
    assert "data.hf_name: cannot load Hugging Face dataset 'someone/corpus': Couldn't reach the Hub" in err
    assert main(["prepare", "--config", "c.yaml", "data.hf_config=de-en"]) == 1
    assert "'someone/corpus', subset 'de-en': Couldn't" in capsys.readouterr().err


def test_counts_in_summary_match_batches(data_cfg):
    prepare(data_cfg, verbose=False)
    dm = TranslationDataModule(data_cfg)
    val = [i for b in dm.val_dataloader() for i in b.index.tolist()]
    assert Counter(val) == Counter(range(40))


def test_paper_text_normalizer_round_trips():
    norm = TextNormalizer("paper", "de")
    raw = ['Ein Mann, der "Hallo!" ruft.', "Zwei Hunde spielen im Schnee (draußen)."]
    tokenized = norm.normalize(raw)
    assert tokenized == ['ein mann , der " hallo ! " ruft .', "zwei hunde spielen im schnee ( draußen ) ."]
    assert norm.restore(tokenized) == [line.lower() for line in raw]
    plain = TextNormalizer("raw", "de")
    assert plain.normalize(raw) == raw and plain.restore(raw) == raw


def test_paper_text_mode_travels_with_the_tokenizer(data_cfg, corpus_splits, tmp_path):
    """data.text=paper: sentencepiece sees lowercased tokenized text, the raw
    text is kept for references, and the mode is stored beside the model."""
    cased = {
        name: tuple([f"{s[0].upper()}{s[1:]}." for s in side] for side in sides)
        for name, sides in corpus_splits.items()
    }
    write_corpus(tmp_path / "cased", cased)
    data_cfg.local_dir, data_cfg.text = str(tmp_path / "cased"), "paper"
    prepare(data_cfg, verbose=False)
    tok = Tokenizer.load(data_cfg.prepared_path())
    assert tok.lowercase and tok.src_text.lang == "en" and tok.tgt_text.lang == "de"
    assert [f.name for f in Tokenizer.files(data_cfg.prepared_path())] == ["spm.model", "text.json"]
    pieces = tok.src_pieces(tok.encode_src([cased["train"][0][0]])[0])
    assert "".join(pieces).lower() == "".join(pieces)  # no uppercase piece
    assert pieces[-2:] == ["▁.", "</s>"]  # the full stop is split off, as Moses does
    train = Split(data_cfg.prepared_path() / "train")
    assert train.tgt_text[:3] == cased["train"][1][:3]  # references stay raw
    assert tok.decode_tgt(train.tgt[:3]) == [t.lower() for t in cased["train"][1][:3]]

    data_cfg.text = "raw"  # a change of text mode is a change of inputs: prepared again
    prepare(data_cfg, verbose=False)
    assert not Tokenizer.load(data_cfg.prepared_path()).lowercase
    assert not (data_cfg.prepared_path() / "text.json").exists()


def test_unknown_text_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="data.text"):
        DataConfig(text="lower")


def test_packing_into_a_fixed_number_of_batches():
    """BPE-dropout changes lengths every epoch; the batch count must not change."""
    src, tgt = lengths(600, seed=3)
    sampler = TokenBatchSampler(src, tgt, 400, shuffle=False)
    order, longer = sampler._sorted(sampler.src_lens, sampler.tgt_lens, torch.Generator())
    greedy = sampler._pack(order, longer, 400)
    length_of = dict(zip(order.tolist(), longer.tolist()))

    def cost(batch):
        return len(batch) * max(length_of[i] for i in batch)

    for n in (len(greedy) - 5, len(greedy), len(greedy) + 7):
        batches = sampler._pack_into(order, longer, n)
        assert len(batches) == n
        assert np.concatenate(batches).tolist() == order.tolist()  # consecutive runs of the sorted pairs, none lost
        if n >= len(greedy):  # at least as many batches as max_tokens needs: none costs more
            assert max(map(cost, batches)) <= 400
        else:
            assert max(map(cost, batches)) > 400
    assert len(sampler._pack_into(order[:3], longer[:3], 10)) == 3  # never an empty batch


def walk_and_cut(lengths, cap):
    """Greedy packing the plain way, one pair at a time: the reference."""
    batches, current, longest = [], [], 0
    for i, length in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, length) > cap:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    return batches + ([current] if current else [])


@pytest.mark.parametrize("cap", [1, 7, 40, 400, 4096])
def test_packing_by_binary_search_equals_the_walk_over_every_pair(cap):
    g = torch.Generator().manual_seed(cap)
    lengths = torch.sort(torch.randint(1, 60, (3000,), generator=g)).values.numpy()
    lengths[:5] = 80  # pairs over a small cap go alone, as in the walk
    lengths.sort()
    order = np.arange(len(lengths))
    packed = [b.tolist() for b in TokenBatchSampler._pack(order, lengths, cap)]
    assert packed == walk_and_cut(lengths.tolist(), cap)


def test_merge_dropout_at_zero_is_sentencepiece_and_at_one_is_characters(data_cfg, corpus_splits):
    prepare(data_cfg, verbose=False)
    tok = Tokenizer.load(data_cfg.prepared_path())
    merges, rng = MergeDropout(tok.src), random.Random(0)
    lines = corpus_splits["train"][0] + corpus_splits["train"][1] + ["Ünseen wörds, ÇAPS & 123!"]
    for line, words in zip(lines, merges.words(lines)):
        assert merges.sample(words, 0.0, rng) == tok.src.encode(line)
        for word in words:  # every merge skipped: characters (a run of unknown ones stays one <unk>)
            pieces = merges.segment(word, 1.0, rng)
            assert "".join(pieces) == word and all(len(x) == 1 for x in pieces if x in merges.rank)
        assert tok.src.decode(merges.sample(words, 0.5, rng)) == tok.src.decode(tok.src.encode(line))


def test_bpe_dropout_resegments_each_epoch(data_cfg):
    data_cfg.bpe_dropout = 0.3
    prepare(data_cfg, verbose=False)
    tok = Tokenizer.load(data_cfg.prepared_path())

    def epochs(seed):
        dm = TranslationDataModule(data_cfg, seed=seed)
        dm.setup()
        loader = dm.train_dataloader()
        out = []
        for epoch in (0, 1):
            loader.sampler.set_epoch(epoch)
            out.append(list(loader))
            assert len(out[-1]) == len(loader)  # the count Lightning was given holds every epoch
        return dm.split("train"), out

    train, (first, second) = epochs(seed=5)
    assert [b.src.tolist() for b in epochs(seed=5)[1][0]] == [b.src.tolist() for b in first]  # reproducible
    rows = {}
    for epoch, batches in enumerate((first, second)):
        seen = []
        for batch in batches:
            for row, i in enumerate(batch.index.tolist()):
                src = batch.src[row][batch.src_mask[row]].tolist()
                tgt = batch.tgt_out[row][batch.tgt_mask[row]].tolist()
                assert src[-1] == tok.eos_id and tgt[-1] == tok.eos_id
                # another segmentation of the same text: it decodes back losslessly
                assert tok.src.decode(src[:-1]) == train.src_text[i]
                assert tok.decode_tgt([tgt[:-1]]) == [train.tgt_text[i]]
                assert len(tgt) - 1 >= len(train.tgt[i])  # never fewer pieces than the merges give
                rows[epoch, i] = src, tgt
                seen.append(i)
        assert sorted(seen) == list(range(len(train)))
    split_up = sum(rows[0, i][1] != [*train.tgt[i], tok.eos_id] for i in range(len(train)))
    redrawn = sum(rows[0, i] != rows[1, i] for i in range(len(train)))
    assert split_up > len(train) // 4 and redrawn > len(train) // 4
    dm = TranslationDataModule(data_cfg, seed=5)
    dm.setup()
    for batch in dm.val_dataloader():  # evaluation keeps the deterministic segmentation
        for row, i in enumerate(batch.index.tolist()):
            assert batch.src[row][batch.src_mask[row]].tolist() == dm.split("val").src[i]


def test_bpe_dropout_config_errors():
    with pytest.raises(ConfigError, match="data.bpe_dropout: needs data.spm_model_type=bpe"):
        DataConfig(spm_model_type="unigram", bpe_dropout=0.1)
    with pytest.raises(ConfigError, match=r"data.bpe_dropout: must be in \[0, 1\)"):
        DataConfig(bpe_dropout=1.0)
