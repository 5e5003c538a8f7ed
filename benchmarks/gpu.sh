#!/usr/bin/env bash
# One command measures a GPU, in one call of at most 9 minutes on a cold H100/H200:
#
#   benchmarks/gpu.sh --prepare            # here, once: .gpu/ (packed Wikipedia rows from ../shared, a few MB)
#                                          # and .whl/ (google-crc32c's cp312 wheel, which the GPU machine lacks)
#   benchmarks/gpu.sh OUT                  # there (carry .gpu and .whl): every stage, then OUT/summary.json
#   benchmarks/gpu.sh --dry-run OUT        # anywhere: the same stages at toy sizes on the CPU (CI runs it)
#
# Stages, in this order, each in its own time box (seconds, sized from the H200 runs of 3397f00 and
# fb4a0b0: /work/shared/GPU-NOTES.md; they add up to 540), each one's output in OUT/STAGE.out and .err
# (a stage that fails or runs out of its box is recorded in the summary and the next one runs). What
# gives a ratio comes first, ours before the peer's; the CUDA tests last:
#   phase1_ours          130  bench pretrain: BERT-large, bf16, 256 x 128, 20 predictions, compiled from an empty
#                             cache (the cold start: first_step_s; fb4a0b0 took over 170 s, transformers 83)
#   phase1_transformers   95  benchmarks/transformers_peer.py: the same batch, SDPA, bf16 autocast, fused AdamW,
#                             clip 1.0, compiled (83 s before)
#   modernbert_step       55  benchmarks/modernbert_step.py: a ModernBERT-base training step, bf16, ours on 16
#                             packed rows of 1024 with FlexAttention block masks against transformers'
#                             ModernBertForMaskedLM (SDPA, the same sequences padded; sparse_prediction off
#                             and on; each side's MFU) (48 s before)
#   phase2_packed         65  bench pretrain on .gpu/wiki-512-packed.bfrec (32 rows a step; synthetic 512/76
#                             rows when .gpu is absent) (80 s before, the whole model compiled again)
#   pretrain_profiled     80  bertforge pretrain --config pretrain_large_128_phase1 at 256, synthetic, steps
#                             0..7, profiled over 5..6: the GPU's busy and idle time per step, the optimizer's,
#                             top kernels (92 s before; phase 1's graphs are in the cache by then)
#   cuda_tests           115  pytest -m cuda (kernels against math, no host syncs, bf16/fp16 against fp32, ...)
#                             (114 s before, 108 of them tests)
# OUT/summary.json gathers them: seq/s, MFU, first_step_s and compile counts of both sides and their ratio,
# pretrain's seq/s against bench's, the profile's numbers, ModernBERT's seq/s of the three and the ratios,
# each stage's exit status, seconds and time box.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
python="${PYTHON:-python3}"

if [[ "${1:-}" == "--prepare" ]]; then
    # Phase 2's rows as benchmarks/packing.py makes them (data create --mode fast at 512/76, dupe factor 5,
    # seed 12345, packed 3 a row), the first 1024 kept: 32 steps of 32 rows.
    PYTHONPATH="$PWD/benchmarks:$PWD:${PYTHONPATH:-}" "$python" - <<'PYTHON' || exit
import tempfile
from pathlib import Path

import numpy as np
from data_prep import DUMP, wiki_sample_text
from packing import make_records

from bertforge.data.record_reader import open_records
from bertforge.data.record_writer import write_records

with tempfile.TemporaryDirectory() as tmp:
    text = Path(tmp) / "wiki.txt"
    text.write_text(wiki_sample_text(DUMP), encoding="utf-8")
    _, packed, stats = make_records(text, Path(tmp), 512, 76, 3)
    with open_records(packed, verify=False) as records:
        rows = records.take(np.arange(min(1024, len(records))))
    path = write_records(Path(".gpu") / "wiki-512-packed.bfrec", rows, fmt="native", vocab_size=30522)
print(f"{path}: {len(rows)} packed rows of 512 tokens (packing factor {stats['packing_factor']})")
PYTHON
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d .whl google-crc32c || exit
    echo ".whl: $(ls .whl)"
    exit 0
fi

dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then
    dry_run=1
    shift
fi
out="${1:?usage: benchmarks/gpu.sh [--prepare | --dry-run] OUT_DIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

# What the GPU machine lacks travels as wheels in .whl (--prepare); installed beside torch.
if compgen -G ".whl/*.whl" > /dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target /tmp/bertforge-site .whl/*.whl \
        && export PYTHONPATH="/tmp/bertforge-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/bertforge-inductor}"

if (( dry_run )); then  # toy sizes on the CPU: every stage runs its code, in seconds
    model=(--config tiny --execution.device cpu --execution.precision fp32 --execution.compile false)
    phase1=(--seq-len 32 --batch-size 4 --steps 2 --warmup 1)
    peer=(--preset tiny --seq-len 32 --batch-size 4 --steps 2 --warmup 1 --precision fp32 --device cpu)
    phase2=(--seq-len 64 --max-predictions 10 --batch-size 2 --steps 2 --warmup 1)
    pretrain=(--config pretrain_tiny --execution.device cpu --execution.compile false --train.micro_batch_size 4
              --train.global_batch_size 4 --data.seq_len 32 --data.max_predictions 5 --train.steps 4
              --log.profile 2:3)
    modernbert=(--device cpu --precision fp32 --attention sdpa --layers 1 --hidden 64 --heads 2 --intermediate 96
                --vocab 1000 --seq-len 256 --steps 1 --warmup 0)
    limit=300
else
    model=(--config large --execution.precision bf16)
    phase1=(--seq-len 128 --batch-size 256 --steps 10 --warmup 3)
    peer=(--preset large --seq-len 128 --batch-size 256 --steps 10 --warmup 3 --precision bf16 --compile)
    phase2=(--batch-size 32 --steps 10 --warmup 3)
    if [[ -f .gpu/wiki-512-packed.bfrec ]]; then
        phase2+=(--data .gpu/wiki-512-packed.bfrec)
    else
        phase2+=(--seq-len 512 --max-predictions 76)
    fi
    pretrain=(--config pretrain_large_128_phase1 --train.micro_batch_size 256 --train.global_batch_size 256
              --train.steps 8 --log.profile 5:7)
    modernbert=(--device cuda --precision bf16 --attention flex --layers 22 --hidden 768 --heads 12 --intermediate 1152
                --rows 16 --seq-len 1024 --steps 10 --warmup 3)
fi

printf 'stage\texit\tseconds\tbox\n' > "$out/stages.tsv"
stage() {  # stage NAME SECONDS COMMAND...: run it in its time box (the dry run's: $limit), record its exit and time
    local name="$1" box="$2" started=$SECONDS
    shift 2
    local applied=$(( dry_run ? limit : box ))
    echo "== $name (at most ${applied} s)"
    timeout "$applied" "$@" > "$out/$name.out" 2> "$out/$name.err"
    local status=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - started))" "$box" >> "$out/stages.tsv"
    echo "   exit $status after $((SECONDS - started)) s"
}

# Empty compile caches for phase 1, ours and the peer's: the cold start a fresh machine sees (our later
# stages reuse ours).
cache="$out/compile-cache"
rm -rf "$cache" "$out/peer-cache"
stage phase1_ours 130 "$python" -m bertforge bench pretrain "${model[@]}" "${phase1[@]}" \
    --execution.compile_cache "$cache" --json
stage phase1_transformers 95 env TORCHINDUCTOR_CACHE_DIR="$out/peer-cache" \
    "$python" benchmarks/transformers_peer.py "${peer[@]}" --json
stage modernbert_step 55 "$python" benchmarks/modernbert_step.py "${modernbert[@]}" --json
stage phase2_packed 65 "$python" -m bertforge bench pretrain "${model[@]}" "${phase2[@]}" \
    --execution.compile_cache "$cache" --json
rm -rf "$out/runs"
stage pretrain_profiled 80 "$python" -m bertforge pretrain "${pretrain[@]}" --data.synthetic true \
    --train.eval_at_start false --train.eval_every 0 --checkpoint.every 0 --log.every 1 --log.tensorboard false \
    --log.run_dir "$out/runs" --log.name profiled --execution.compile_cache "$cache" --no-progress
mapfile -t cuda_files < <(grep -rl --include="test_*.py" "mark.cuda" tests | sort)  # (collecting only these saves half a minute)
stage cuda_tests 115 "$python" -m pytest -q -m cuda "${cuda_files[@]}" -p no:cacheprovider \
    --junitxml="$out/cuda_tests.xml"

"$python" - "$out" <<'PYTHON'
"""OUT/summary.json from the stages' outputs (a missing or failed stage's part is null)."""
import json
import statistics
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

out = Path(sys.argv[1])


def last_json(name):
    path = out / f"{name}.out"
    lines = [line for line in path.read_text().splitlines() if line.startswith("{")] if path.exists() else []
    return json.loads(lines[-1]) if lines else None


def cuda_tests():
    path = out / "cuda_tests.xml"
    if not path.exists():
        return None
    suite = ElementTree.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failed = [case.get("name") for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": failed}


def side(result):
    keys = ("seq_per_s", "rows_per_s", "step_ms", "mfu", "peak_mem_mb", "device_name", "compile", "first_step_s",
            "compiled")
    return None if result is None else {key: result.get(key) for key in keys}


def pretrain():
    run = out / "runs" / "profiled"
    rows = ([json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            if (run / "metrics.jsonl").exists() else [])
    rates = [row["seq_per_s"] for row in rows if "split" not in row and 2 <= row["step"] <= 5]
    profile = run / "profile" / "gpu_summary.json"
    return (statistics.median(rates) if rates else None,
            json.loads(profile.read_text()) if profile.exists() else None)


def modernbert():
    result = last_json("modernbert_step")
    if result is None:
        return None
    keys = ("device", "precision", "sequences", "ours_attention", "their_attention",
            "ratio_vs_transformers", "ratio_vs_transformers_sparse")
    sides = ("bertforge", "transformers", "transformers_sparse")
    return {**{key: result[key] for key in keys}, **{side: result[side]["seq_per_s"] for side in sides},
            "mfu": {side: result[side].get("mfu") for side in sides}}


ours, theirs = last_json("phase1_ours"), last_json("phase1_transformers")
pretrain_rate, profile = pretrain()
stages = [dict(zip(("stage", "exit", "seconds", "box"), line.split("\t")))
          for line in (out / "stages.tsv").read_text().splitlines()[1:]]
summary = {
    "stages": [{**s, "exit": int(s["exit"]), "seconds": int(s["seconds"]), "box": int(s["box"])} for s in stages],
    "cuda_tests": cuda_tests(),
    "phase1": {"ours": side(ours), "transformers": side(theirs),
               "ratio": ours["seq_per_s"] / theirs["seq_per_s"] if ours and theirs else None},
    "phase2_packed": side(last_json("phase2_packed")),
    "pretrain": {"seq_per_s": pretrain_rate,
                 "of_bench": pretrain_rate / ours["seq_per_s"] if pretrain_rate and ours else None},
    "profile": profile,
    "modernbert_step": modernbert(),
}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary))
PYTHON
