"""``import bertforge`` and the ``bertforge data`` commands do not import torch (~230 MB, seconds).

Each check runs in a fresh interpreter: in this one, other tests have imported torch already.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import shared_data

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def test_importing_the_package_and_the_command_line_does_not_import_torch():
    done = run_python("""
        import sys
        import bertforge, bertforge.cli, bertforge.data, bertforge.data.create
        assert "torch" not in sys.modules, "torch was imported"
        assert bertforge.load_config("tiny").model.num_hidden_layers > 0  # config names stay eager
        assert "torch" not in sys.modules, "load_config imported torch"
        # The torch-backed names load on first use and are the modules' own.
        import bertforge.models.bert, bertforge.data.dataset
        assert bertforge.BertModel is bertforge.models.bert.BertModel
        assert bertforge.data.build_datasets is bertforge.data.dataset.build_datasets
        try:
            bertforge.no_such_name
        except AttributeError as err:
            print(err)
    """)
    assert done.stdout.strip() == "module 'bertforge' has no attribute 'no_such_name'"


def test_data_commands_do_not_import_torch(tmp_path):
    text = shared_data("text/sample_text.txt")
    vocab = shared_data("vocab/bert-base-uncased-vocab.txt")
    out = tmp_path / "sample.tfrecord"
    done = run_python(f"""
        import sys
        from bertforge.cli import main
        create = ["data", "create", "--input", {str(text)!r}, "--vocab", {str(vocab)!r},
                  "--output", {str(out)!r}, "--mode", "fast", "--dupe-factor", "1"]
        statuses = [main(create), main(["data", "index", {str(out)!r}]),
                    main(["data", "inspect", {str(out)!r}, "--num", "1"]),
                    main(create[:5] + [{str(tmp_path / "missing.txt")!r}] + create[6:])]
        assert "torch" not in sys.modules, "torch was imported"
        print("statuses", statuses)
    """)
    assert done.stdout.strip().splitlines()[-1] == "statuses [0, 0, 0, 2]"
    assert "error: vocab not found" in done.stderr
    assert out.with_suffix(".index").stat().st_size > 0
