"""The tformer_arith task's documents, read from arith.jsonl beside this file (lm-eval's ``custom_dataset``)."""

import json
from pathlib import Path


def load(**kwargs):
    import datasets

    rows = [json.loads(line) for line in (Path(__file__).parent / "arith.jsonl").read_text().splitlines() if line]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
