"""Write the project's own sentiment data set (train/validation) to a folder.

    .venv/bin/python scripts/tools/make_sentiment_data.py --out data/sentiment

Generates a few thousand short review sentences from five domains (restaurants, films,
phones, hotels, books), labelled 1 (positive) or 0 (negative). Negation flips a clause ("not
good" is negative, "not bad" positive), contrast follows the concessive clause ("X, but Y" and
"although X, Y" follow Y), and intensifiers are spread over both labels, so no single word
predicts the label (see `scripts/examples/sentiment_data.py` for the grammar and
`tests/unit/test_data.py` for the check). The output is deterministic for a seed:

    DIR/train.tsv        sentence<TAB>label, no header (the UCI "Sentiment Labelled Sentences" format)
    DIR/validation.tsv

These are demo data only: the scripts train on the real UCI review sentences by default and fall
back to this generated set (with a warning) only when those cannot be found or fetched.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

# the examples' data module, `scripts/examples/sentiment_data.py`
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from sentiment_data import write_sentiment_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write train/validation files into")
    parser.add_argument("--num-examples", type=int, default=3000, help="total sentences (default 3000)")
    parser.add_argument("--validation-fraction", type=float, default=0.2, help="held-out share (default 0.2)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    parser.add_argument("--format", choices=["tsv", "jsonl"], default="tsv", help="file format (default tsv)")
    args = parser.parse_args()

    paths = write_sentiment_data(
        args.out,
        num_examples=args.num_examples,
        validation_fraction=args.validation_fraction,
        seed=args.seed,
        fmt=args.format,
    )
    for split, path in paths.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        if args.format == "tsv":
            labels = collections.Counter(line.rsplit("\t", 1)[1] for line in lines)
        else:
            labels = collections.Counter(str(json.loads(line)["label"]) for line in lines)
        print(f"{split:<10} {len(lines):>5} sentences  labels {dict(sorted(labels.items()))}  -> {path}")
    first = paths["train"].read_text(encoding="utf-8").splitlines()[:3]
    print("examples:\n  " + "\n  ".join(first))


if __name__ == "__main__":
    main()
