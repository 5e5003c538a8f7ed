"""What ``benchmarks/gpu.sh`` carries to a GPU machine that has no network and no ``../shared``.

    python benchmarks/gpu_data.py            # writes .gpu/ (ignored by git; a few MB)

Phase 2's packed rows: the shared Wikipedia sample made into records at 512 tokens and 76
predictions and packed (``benchmarks/packing.py``'s recipe: ``data create --mode fast``, dupe
factor 5, seed 12345, uncased vocab, at most 3 sequences a row), of which the first ``--rows``
are kept in ``.gpu/wiki-512-packed.bfrec``. Then, from PyPI, the cp312 wheel of google-crc32c,
which the GPU machine lacks, in ``.whl/`` (``--no-wheel`` leaves it out). Run it here, then name
``.gpu`` and ``.whl`` in the device tool's ``carry``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from data_prep import DUMP, wiki_sample_text  # noqa: E402
from packing import make_records  # noqa: E402

from bertforge.data.record_reader import open_records  # noqa: E402
from bertforge.data.record_writer import write_records  # noqa: E402

PACKED = "wiki-512-packed.bfrec"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu")
    parser.add_argument("--rows", type=int, default=1024, help="packed rows kept (32 a step: 32 steps)")
    parser.add_argument("--no-wheel", action="store_true", help="do not download google-crc32c's wheel")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "wiki.txt"
        text.write_text(wiki_sample_text(DUMP), encoding="utf-8")
        _, packed, stats = make_records(text, Path(tmp), 512, 76, 3)
        with open_records(packed, verify=False) as records:
            rows = records.take(np.arange(min(args.rows, len(records))))
        write_records(args.out / PACKED, rows, fmt="native", vocab_size=30522)
    print(f"{args.out / PACKED}: {len(rows)} packed rows of 512 (packing factor {stats['packing_factor']})")
    if not args.no_wheel:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux2014_x86_64",
                        "-d", str(ROOT / ".whl"), "google-crc32c"], check=True)
        print(f"{ROOT / '.whl'}: {', '.join(p.name for p in (ROOT / '.whl').glob('*.whl'))}")


if __name__ == "__main__":
    main()
