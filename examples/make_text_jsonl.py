"""Write a text corpus as jsonl (one {"text": ...} record per document) for trying data.blend and data.streaming
without a download: the running Python's standard-library sources, one record per file.

    python examples/make_text_jsonl.py data/                 # data/stdlib.jsonl, about 4 MB
    python examples/make_text_jsonl.py data/ --mb 40          # the sources repeated to about 40 MB
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moeflow.data.stream import stdlib_files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="folder to write stdlib.jsonl into")
    ap.add_argument("--mb", type=float, default=4.0, help="about this many MB (default 4)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path, written, records = args.out / "stdlib.jsonl", 0, 0
    with open(path, "w") as fh:
        while written < args.mb * 1e6:
            for source in stdlib_files():
                line = json.dumps({"text": source.read_text(encoding="utf-8", errors="replace")}) + "\n"
                fh.write(line)
                written, records = written + len(line), records + 1
                if written >= args.mb * 1e6:
                    break
    print(f"wrote {path} ({records:,} records, {written / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
