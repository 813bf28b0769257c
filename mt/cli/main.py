"""The ``mt`` command line: one entry point, one subcommand per job.

Each subcommand's module is imported only when it runs, so ``mt --help``
stays fast. Expected failures (bad config, missing files, bad input) are
raised as :class:`mt.errors.MTError` subclasses and printed as one line.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from mt import __version__
from mt.config import DECODING
from mt.errors import MTError, Stopped


def _add_prepare(sub) -> None:
    p = sub.add_parser("prepare", help="tokenize a parallel corpus with sentencepiece")
    p.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    p.add_argument("--data-dir", help="local directory of <split>.<lang>[.gz] files (overrides data.local_dir)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")


def _run_prepare(args) -> None:
    from mt.config import load_config
    from mt.data.prepare import prepare

    cfg = load_config(args.config, args.overrides)
    if args.data_dir:
        cfg.data.local_dir = args.data_dir
        cfg.data.source = "local"
    prepare(cfg.data)


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a model (Lightning) into a run directory")
    p.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.max_steps=100")


def _run_train(args) -> None:
    from mt.config import load_config
    from mt.train.run import train

    train(load_config(args.config, args.overrides))


def _add_average(sub) -> None:
    p = sub.add_parser("average", help="average the last N checkpoints of a run into its inference model")
    p.add_argument("--model", required=True, help="run directory")
    p.add_argument("--last", type=int, help="how many of the kept step checkpoints; 0 = the best one")
    p.add_argument(
        "--ema",
        action="store_true",
        help="instead, the moving average of the weights in the newest checkpoint (a run with train.ema_decay > 0)",
    )
    p.add_argument(
        "--choose",
        action="store_true",
        help="average the last k <= N instead, the k of lowest validation loss (reads the run's prepared data)",
    )


def _run_average(args) -> None:
    from pathlib import Path

    from mt.config import load_config
    from mt.train.checkpoints import export_from_checkpoints

    if (args.last is None) == (not args.ema):
        raise MTError("give one of --last N (checkpoints to average) and --ema (the moving average)")
    if args.last is not None and args.last < 0:
        raise MTError(f"--last must be >= 0 (0 = the best checkpoint), got {args.last}")
    if args.choose and not args.last:
        raise MTError("--choose picks how many of the last --last N checkpoints to average: give N >= 1")
    run_dir = Path(args.model)
    cfg = load_config(run_dir / "config.yaml")
    val = None
    if args.choose:
        from mt.data.batches import TranslationDataModule

        val = list(TranslationDataModule(cfg.data).val_dataloader())
    source = export_from_checkpoints(cfg, run_dir, args.last or 0, val, ema=args.ema)
    print(f"inference model written: {source}")


def _add_choose_alpha(sub) -> None:
    p = sub.add_parser(
        "choose-alpha",
        help="choose a run's length penalty on validation: the alpha of highest beam-search BLEU becomes its default",
    )
    p.add_argument("--model", required=True, help="run directory")
    p.add_argument("--split", default="val", help="the split decoded for each alpha (default val)")
    p.add_argument("--beam", type=int, default=DECODING.beam, help=f"beam size (default {DECODING.beam})")
    p.add_argument(
        "--alphas",
        type=float,
        nargs="+",
        default=list(DECODING.choose_alphas),
        help="the length penalties tried (default " + " ".join(f"{a:g}" for a in DECODING.choose_alphas) + ")",
    )


def _run_choose_alpha(args) -> None:
    from pathlib import Path

    from mt.evaluate.alpha import choose_alpha

    if not 1 <= args.beam <= DECODING.max_beam:
        raise MTError(f"--beam must be between 1 and {DECODING.max_beam}, got {args.beam}")
    best = choose_alpha(Path(args.model), args.alphas, args.split, args.beam)
    print(f"length penalty {best:g} written to {Path(args.model) / 'model.json'}: the run's default from now on")


def _add_decoding_options(p, serve: bool = False) -> None:
    """The options of every command that decodes; ``serve``: mt serve's, whose batches are
    made by its continuous search (no --batch-size) and whose workers are processes."""
    p.add_argument(
        "--model",
        required=True,
        nargs="+",
        metavar="RUN_DIR",
        help="run directory (model.safetensors, model.json, spm*.model); several = an ensemble that averages "
        "their probabilities (they must share one tokenizer)",
    )
    d = DECODING
    p.add_argument(
        "--beam", type=int, default=d.beam, help=f"beam size, 1 to {d.max_beam}; 1 = greedy (default {d.beam})"
    )
    p.add_argument(
        "--alpha",
        type=float,
        default=None,
        help=f"length penalty, 0 to {d.max_alpha:g}: score / length**alpha; larger values favour longer output "
        f"(default: the model's, chosen on validation by mt choose-alpha, else {d.alpha})",
    )
    if not serve:
        p.add_argument(
            "--batch-size", type=int, default=d.batch_size, help=f"sentences per batch (default {d.batch_size})"
        )
    p.add_argument(
        "--max-len-a",
        type=float,
        default=d.max_len_a,
        help=f"output length limit a*source_len+b (default {d.max_len_a})",
    )
    p.add_argument("--max-len-b", type=int, default=d.max_len_b, help=f"(default {d.max_len_b})")
    p.add_argument(
        "--loop-margin",
        type=_loop_margin,
        default=d.loop_margin,
        metavar="K",
        help=f"loop guard: no output repeats a run of up to {d.loop_ngram} subword pieces more than K times in a row "
        "beyond the most its source repeats one: the search takes another token instead, or ends the output "
        "once it is as long as its source; 'off' for none. "
        f"mt's own searches only: a CTranslate2 export has no such guard (default {d.loop_margin})",
    )
    p.add_argument("--device", default="auto", help="auto (GPU if there is one), cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="decoding processes, each running a search that sentences join and leave, with a share of the CPU "
        "threads (default: 2 on a CPU with two or more threads; 1 on a GPU)"
        if serve
        else "batches decoded at once, each in its own thread with a share of the CPU threads, so that one "
        "batch's Python overlaps the other's products (default: 2 on a CPU with two or more threads; 1 on a GPU)",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "int8"],
        default=d.dtype,
        help="weights and activations while decoding: auto (default) = bfloat16 on GPUs that support it, "
        "else float32. On CPUs with native bfloat16 it pays for wide models only; on AVX2-only CPUs it is "
        "hundreds of times slower (a warning says so). int8 (CPU): products with int8 weights, made from "
        "the float32 ones (no second model file): every linear layer where the CPU has VNNI, else the output "
        "projection alone, the one that gains there (mt/decode/int8.py). Attention and search scores stay float32.",
    )


def _loop_margin(text: str) -> int | None:
    """--loop-margin: a count >= 0, or off."""
    if text == "off":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a count >= 0 or 'off', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a count >= 0 or 'off', got {value}")
    return value


def _translator(args):
    """The translator that ``mt translate`` and ``mt evaluate`` decode with (``mt.decode.inference``)."""
    from mt.decode.inference import DecodingOptions, open_translator

    return open_translator(args.model, DecodingOptions.from_args(args))


def _add_translate(sub) -> None:
    p = sub.add_parser(
        "translate",
        help="translate text, one line in, one line out",
        description="Translate stdin (or -i) to stdout (or -o), one output line per input line, in order. "
        "A line longer than the model's maximum positions is translated in parts (cut at punctuation, else "
        "between words), with a warning; with --n-best or --prefix-file it is truncated. "
        "With --n-best K, each input gives K lines 'INDEX ||| TRANSLATION ||| SCORE' (Moses n-best format).",
    )
    _add_decoding_options(p)
    p.add_argument("-i", "--input", help="input file, or - (default: stdin; a prompt when stdin is a terminal)")
    p.add_argument("-o", "--output", help="output file, written atomically, or - (default: stdout)")
    p.add_argument("--n-best", type=int, default=1, help="hypotheses per input (<= beam)")
    p.add_argument("--scores", action="store_true", help="append a tab and the hypothesis score")
    p.add_argument(
        "--prefix-file",
        help="the start of each translation, one line per input line (empty = none): the search "
        "continues from it, and the output starts with it as given",
    )
    p.add_argument(
        "--format",
        choices=["auto", "text", "srt"],
        default="auto",
        help="text: one line in, one line out; srt: SubRip subtitles, numbers and timings kept, each cue's text "
        "translated and wrapped again; auto (default): srt when -i ends in .srt",
    )
    p.add_argument(
        "--split-sentences",
        action="store_true",
        help="cut each line into sentences (rules of the model's source language), translate each, and join "
        "them back with the line's own spacing: for paragraphs. Off by default: corpora are one sentence a line",
    )


def _prefix_errors(translations, prefix_file: str | None):
    """The translations, with a prefix file that does not fit the input named in the error."""
    try:
        yield from translations
    except ValueError as e:
        if prefix_file is None:
            raise
        raise MTError(f"--prefix-file {prefix_file}: {e}") from None


def _run_translate(args) -> None:
    import contextlib

    from mt.textio import atomic_output, utf8_lines

    stdin = args.input in (None, "-")  # -i - is standard input, as with most tools
    split_lang = None
    if args.split_sentences:
        from mt.decode.inference import source_language

        for option, given in (("--n-best", args.n_best > 1), ("--prefix-file", args.prefix_file)):
            if given:
                raise MTError(f"--split-sentences and {option}: a split line gets one translation, with no prefix")
        split_lang = source_language(args.model[0])
    subtitles = args.format == "srt" or (args.format == "auto" and str(args.input or "").lower().endswith(".srt"))
    if subtitles:
        for option, given in (("--n-best", args.n_best > 1), ("--prefix-file", args.prefix_file),
                              ("--scores", args.scores)):  # fmt: skip
            if given:
                raise MTError(f"subtitles (--format srt) and {option}: a cue gets its translation, nothing more")
    translator, _ = _translator(args)
    if subtitles:
        _translate_subtitles(args, translator, split_lang)
        return
    if args.input is None and sys.stdin.isatty():
        _interactive(translator, split_lang)
        return
    with contextlib.ExitStack() as stack:
        if not stdin:
            try:
                source = stack.enter_context(open(args.input, "rb"))
            except OSError as e:
                raise MTError(f"{args.input}: {e.strerror}") from None
        else:
            source = sys.stdin.buffer
        lines = utf8_lines(source, "<stdin>" if stdin else args.input)
        prefixes = None
        if args.prefix_file:
            try:
                prefixes = utf8_lines(stack.enter_context(open(args.prefix_file, "rb")), args.prefix_file)
            except OSError as e:
                raise MTError(f"--prefix-file {args.prefix_file}: {e.strerror}") from None
        out = stack.enter_context(atomic_output(args.output)) if args.output not in (None, "-") else sys.stdout
        progress = None
        if out is not sys.stdout and sys.stdout.isatty() and sys.stderr.isatty():  # a file written from a terminal
            from mt.cli.progress import Progress, count_lines

            progress = Progress(None if stdin else count_lines(args.input))
            stack.callback(progress.close)
        translations = translator.stream(lines, chunk=1000, n_best=args.n_best, prefixes=prefixes,
                                         split_lang=split_lang)  # fmt: skip
        for n, nbest in enumerate(_prefix_errors(translations, args.prefix_file)):
            if progress:
                progress.update(n + 1)
            for text, score in nbest:
                if args.n_best > 1:
                    out.write(f"{n} ||| {text} ||| {score:.4f}\n")
                else:
                    out.write(f"{text}\t{score:.4f}\n" if args.scores else text + "\n")
            if out is sys.stdout and n % 100 == 99:
                out.flush()


def _translate_subtitles(args, translator, split_lang: str | None) -> None:
    """A SubRip file in, a SubRip file out: each cue's text translated, in the input's line endings."""
    from mt.decode.subtitles import parse_srt, write_srt
    from mt.textio import atomic_output

    stdin = args.input in (None, "-")
    name = "<stdin>" if stdin else args.input
    try:
        raw = sys.stdin.buffer.read() if stdin else Path(args.input).read_bytes()  # subtitles are small: read whole
    except OSError as e:
        raise MTError(f"{args.input}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise MTError(f"{name}, line {line}: not UTF-8 (byte {e.start})") from None
    cues = parse_srt(text, name)
    translations = [nbest[0][0] for nbest in translator.stream([c.text for c in cues], split_lang=split_lang)]
    newline = "\r\n" if "\r\n" in text else "\n"
    if args.output in (None, "-"):
        sys.stdout.write(write_srt(cues, translations, newline))
        return
    with atomic_output(args.output, binary=True) as out:
        out.write(write_srt(cues, translations, newline).encode("utf-8"))


def _interactive(translator, split_lang: str | None = None) -> None:
    print("Type a sentence and press Enter to translate it; Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return
        print(next(translator.stream([line], split_lang=split_lang))[0][0])


def _add_evaluate(sub) -> None:
    p = sub.add_parser("evaluate", help="translate a test set and report sacreBLEU BLEU and chrF")
    _add_decoding_options(p)
    p.add_argument("--split", help="a split of the run's corpus, e.g. test_2016_flickr")
    p.add_argument("--src", help="source file (instead of --split)")
    p.add_argument("--ref", help="reference file (with --src)")
    p.add_argument("--paper", action="store_true", help="add Multi30k papers' BLEU (lowercased, Moses-tokenized)")
    p.add_argument("--paper-ref", help="tokenized reference file for --paper (default: the corpus's tok/ file)")
    p.add_argument("--json", action="store_true", help="print the scores as JSON")


def _run_evaluate(args) -> None:
    from mt.evaluate.scoring import run

    translator, _ = _translator(args)
    run(args, translator)


def _add_attention(sub) -> None:
    p = sub.add_parser(
        "attention",
        help="draw a trained model's attention for a sentence",
        description="Translate SRC greedily (or force-decode --tgt), capture every layer's attention "
        "weights and draw them as heatmaps. Cross-attention: target tokens as rows, source tokens as "
        "columns. --temperature T divides the scaled scores by T: T > 1 flattens the weights, T < 1 "
        "sharpens them. --explain instead walks through one head step by step (Q, K, V, scores, "
        "scaling, mask, softmax, weights·V, W_O) on the model's real weights and checks every step "
        "against the model's own forward pass.",
    )
    p.add_argument("--model", required=True, help="run directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--src", help="source sentence")
    src.add_argument("--src-file", help="file of source sentences: one image per line (OUT-<n>.png)")
    p.add_argument("--tgt", help="target sentence to force-decode (default: the model's greedy translation)")
    p.add_argument("--kind", choices=["cross", "encoder", "decoder", "all"], default="cross")
    p.add_argument("--layer", default="all", help="layer index or 'all' (default all; --explain: 0)")
    p.add_argument("--head", default="all", help="head index, 'all' or 'mean' (default all; --explain: 0)")
    p.add_argument(
        "--out",
        help="image file: .png, .svg or .pdf; with --explain the flow of one head: .png, .svg, or .html "
        "(a page where hovering a cell shows its value and the cells it came from)",
    )
    p.add_argument("--stats", action="store_true", help="print per-head statistics (entropy, max, ...)")
    p.add_argument(
        "--temperature",
        type=float,
        nargs="+",
        default=[1.0],
        metavar="T",
        help="attention temperature, 0.01 to 100 (default 1); with --explain several, compared side by side",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="one head step by step, each step checked against the model (with --kind, --layer, --head, --query)",
    )
    p.add_argument("--query", type=int, default=0, help="--explain: the query position to follow (default 0)")
    p.add_argument("--npz", help="--explain: save the head's inputs, weights and mask for NumPy (FILE.npz)")
    p.add_argument("--align", action="store_true", help="print source-target piece alignments (Pharaoh i-j)")
    p.add_argument("--align-layer", type=int, help="decoder layer for --align (default: second to last)")
    p.add_argument("--html", help="also write a self-contained HTML page to browse all maps")


def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve translation and attention over HTTP, with a web page",
        description="Serve the model: a page at /, the API under /v1 (docs at /docs), /healthz. Requests that "
        "arrive together are decoded together, and continuously: sentences join a beam search under way and are "
        "answered when finished (up to --max-batch at once per worker process). "
        "SIGINT or SIGTERM stops it gracefully. Needs the serve extra: pip install -e '.[serve]'.",
    )
    _add_decoding_options(p, serve=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-batch", type=int, default=64, help="most sentences a worker decodes together (default 64)")
    p.add_argument(
        "--max-wait-ms",
        type=float,
        default=10.0,
        help="an idle worker waits this long for the sentences sent together to arrive; one "
        "under way lets a sentence join after at most 5x this (default 10)",
    )
    p.add_argument("--max-lines", type=int, default=64, help="most sentences per request (default 64)")
    p.add_argument(
        "--max-chars",
        type=int,
        default=1000,
        help="most characters per sentence (default 1000); a body larger than these two limits could need "
        "is refused (413) unread",
    )
    p.add_argument(
        "--max-beam",
        type=int,
        default=16,
        help=f"the widest beam (and n-best) a request may ask for, at most {DECODING.max_beam} (default 16)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=1024,
        help="most sentences waiting or decoding at once; past it a request is refused at once, 503 with "
        "Retry-After (default 1024)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds a request may take; past it, 504 with Retry-After and its sentences are dropped "
        "(default 60). A stop waits this long for the requests in flight",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=30.0,
        help="a decoding process that has sentences and reports no progress for this many seconds is "
        "killed and replaced; only its sentences fail, 503 (default 30)",
    )
    p.add_argument(
        "--allowed-hosts",
        help="comma-separated host names the Host header may give, * for any (default: localhost, 127.0.0.1, "
        "::1 and --host; any when --host is 0.0.0.0 or ::). A page that DNS rebinding points at this "
        "machine names its own host, and is refused",
    )


def _run_serve(args) -> None:
    try:
        from mt.serve.app import run
    except ImportError as e:
        raise MTError(f"mt serve needs the serve extra ({e.name} is missing): pip install -e '.[serve]'") from None
    run(args)


def _run_attention(args) -> None:
    from mt.inspect.command import run

    run(args)


def _add_export(sub) -> None:
    from mt.export.ct2 import QUANTIZATIONS

    p = sub.add_parser(
        "export",
        help="export a trained model to CTranslate2, Argos Translate / LibreTranslate or transformers",
        description="Write the model in another toolkit's format, exactly (an option the format cannot hold is "
        "refused by name), then translate a few sentences greedily with both engines and report whether they "
        "agree. ct2: a CTranslate2 model directory; argos: an Argos Translate package (OUT.argosmodel) that "
        "LibreTranslate installs; hf: a transformers model directory (Blenderbot for pre-LN, Marian for post-LN). "
        "Needs pip install -e '.[export]' (ct2, argos) or '.[hf]' (hf).",
    )
    p.add_argument("--model", required=True, metavar="RUN_DIR", help="run directory to export")
    p.add_argument("--to", required=True, choices=["ct2", "argos", "hf"], help="the format (above)")
    p.add_argument("out", help="output directory, or package file for argos (complete or not written at all)")
    p.add_argument(
        "--quantization",
        default="none",
        choices=QUANTIZATIONS,
        help="ct2 and argos: the weights' type (default none: float32, exact); int8 also makes the file a quarter "
        "of the size",
    )
    p.add_argument("--name", help="argos: the package's name (default mt-SRC_TGT)")
    p.add_argument("--package-version", default="1.0", help="argos: the package's version (default 1.0)")
    p.add_argument("--force", action="store_true", help="replace OUT if it is an earlier mt export")


def _run_export(args) -> None:
    out = Path(args.out)
    if args.to != "argos" and (args.name or args.package_version != "1.0"):
        raise MTError("--name and --package-version are for --to argos")
    if args.to == "hf" and args.quantization != "none":
        raise MTError("--quantization is for --to ct2 and argos (a transformers export keeps float32)")
    if args.to == "ct2":
        from mt.export.ct2 import export_ct2

        check, engine, what = export_ct2(Path(args.model), out, args.quantization, args.force), "CTranslate2", "CT2"
    elif args.to == "argos":
        from mt.export.argos import export_argos

        check = export_argos(Path(args.model), out, args.quantization, args.name, args.package_version, args.force)
        engine, what = "CTranslate2", "Argos Translate package"
    else:
        from mt.export.hf import export_hf

        check, engine, what = export_hf(Path(args.model), out, args.force), "transformers", "transformers"
    quantized = args.quantization != "none"
    print(f"exported {args.model} to {out} ({what}" + (f", quantization {args.quantization})" if quantized else ")"))
    expected = "quantized weights: some may differ" if quantized else "float32 weights: they should all be"
    print(f"check: {check['same']} of {check['sentences']} greedy translations the same as mt's ({expected})")
    if check["first_difference"]:
        source, ours, theirs = check["first_difference"]
        print(f"  first difference, {source!r}:\n    mt:{' ' * (len(engine) - 1)}{ours}\n    {engine}: {theirs}")
    if args.to == "argos":
        print(f"install: python -c \"import argostranslate.package as p; p.install_from_path('{out}')\"; "
              "translate with ARGOS_CHUNK_TYPE=SPACY to split sentences offline (docs/export.md)")  # fmt: skip


COMMANDS = {
    "prepare": (_add_prepare, _run_prepare),
    "train": (_add_train, _run_train),
    "average": (_add_average, _run_average),
    "choose-alpha": (_add_choose_alpha, _run_choose_alpha),
    "translate": (_add_translate, _run_translate),
    "evaluate": (_add_evaluate, _run_evaluate),
    "attention": (_add_attention, _run_attention),
    "serve": (_add_serve, _run_serve),
    "export": (_add_export, _run_export),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mt", description="Train, run and inspect Transformer translation models.")
    parser.add_argument("--version", action="version", version=f"mt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add, _ in COMMANDS.values():
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        COMMANDS[args.command][1](args)
    except MTError as e:
        print(f"mt {args.command}: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # stdout closed early, as by `mt translate ... | head`
        # Python flushes stdout once more at exit; point it at /dev/null so that fails quietly too
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    except OSError as e:  # what the machine refused: a full disk, a file that vanished, ...
        where = f"{e.filename}: " if e.filename else ""
        print(f"mt {args.command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except Stopped as e:
        print(f"mt {args.command}: {e}", file=sys.stderr)
        return e.status
    except KeyboardInterrupt:
        if argv is None:  # a program on its way out: a second Ctrl-C must not interrupt the exit
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"mt {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
