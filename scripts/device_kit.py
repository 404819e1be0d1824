"""What the real experiment needs on a machine that reaches nothing, packed into parts that each
fit a transfer limit, and put back together there.

The lent GPU machines here reach no network, and each call to them carries at most 64 MiB,
working tree included: the real checkpoint (a 491 MB GGUF), the real data (8 MB) and the wheels
their image lacks cannot go in one call. So:

    python scripts/device_kit.py pack --out .kit                  # here: .kit/p00 .. .kit/pNN, each under --part-mib
    python scripts/device_kit.py stage --kit .kit --stage DIR     # there, once per call: the parts that came
    python scripts/device_kit.py unpack --stage DIR --model M --data D --site S   # there, every part staged

`pack` splits the GGUF that `scripts/fetch_real_model.py` keeps beside its model directory into
pieces and adds the data directory of `scripts/fetch_real_data.py` and the wheels of `WHEELS` for
the device's Python (downloaded here, `pip download`). Every part holds the manifest: each file's
bytes and SHA-256, and the whole GGUF's. `stage` checks each file of the parts found under --kit
against it and moves them into the stage directory (a bad file is an error that names it; the
parts still missing are listed). `unpack` installs the wheels into --site, joins the GGUF and
checks it, converts it into an HF model directory (`fetch_real_model.py --gguf`) and copies the
data: each step is skipped when its result is already there. `scripts/gpu_experiment.sh` runs
stage, unpack and the experiment in one command that every call repeats.
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

HERE = os.path.dirname(os.path.abspath(__file__))
MANIFEST = "manifest.json"
COMPLETE = "complete"  # written into the stage directory once every part is in
PIECE = "model.gguf.{:03d}"
# What sem_jax and the GGUF conversion import that the GPU image ("cuda", /work/.library/device/
# KINDS.md) does not hold, at the versions this project's tests run; their other requirements
# (numpy, pyarrow, pandas, absl-py, pyyaml, protobuf, requests, ...) are in the image.
WHEELS = ("bm25s==0.3.16", "PyStemmer==3.1.0", "ml-collections==1.1.0", "tensorboardX==2.6.5",
          "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19", "gguf==0.19.0")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


def log(msg: str) -> None:
    print(f"[device_kit] {msg}", flush=True)


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheels(dest: str, python_version: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", dest]
    cmd += [arg for p in PLATFORMS for arg in ("--platform", p)]
    result = subprocess.run(cmd + list(WHEELS), capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"pip download of the device's wheels failed ({result.returncode}): {' / '.join(tail)}")


def pack(out: str, gguf: str, data: str, wheels: str | None, part_bytes: int, reserve: int = 64 * 1024) -> dict:
    """Write the parts into out/p00, out/p01, ...: files of the data directory and the wheels
    first, then the GGUF in pieces that fill each part up to `part_bytes` less `reserve` (the
    manifest's share). Returns the manifest."""
    if os.path.exists(out):
        raise SystemExit(f"{out} exists: remove it or pick another --out")
    for path, what in ((gguf, "--gguf"), (data, "--data")):
        if not os.path.exists(path):
            raise SystemExit(f"{what} {path}: not found (scripts/fetch_real_model.py and fetch_real_data.py write them)")
    extras = [(os.path.join("data", name), os.path.join(data, name)) for name in sorted(os.listdir(data))]
    if wheels:
        extras += [(os.path.join("wheels", name), os.path.join(wheels, name)) for name in sorted(os.listdir(wheels))]
    room = part_bytes - reserve
    if room <= 0 or any(os.path.getsize(src) > room for _, src in extras):
        raise SystemExit(f"--part-mib is too small for {max(extras, key=lambda e: os.path.getsize(e[1]))[1]}")
    parts: list[list[tuple[str, str, int, int]]] = [[]]  # (name, source, offset, bytes)
    used = 0
    for name, src in extras:
        size = os.path.getsize(src)
        if used + size > room:
            parts.append([])
            used = 0
        parts[-1].append((name, src, 0, size))
        used += size
    total, offset, piece = os.path.getsize(gguf), 0, 0
    while offset < total:
        if used >= room:
            parts.append([])
            used = 0
        size = min(room - used, total - offset)
        parts[-1].append((PIECE.format(piece), gguf, offset, size))
        offset, used, piece = offset + size, used + size, piece + 1
    files = {}
    for i, members in enumerate(parts):
        directory = os.path.join(out, f"p{i:02d}")
        for name, src, start, size in members:
            dest = os.path.join(directory, name)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(src, "rb") as f, open(dest, "wb") as w:
                f.seek(start)
                w.write(f.read(size))
            files[name] = dict(part=f"p{i:02d}", bytes=size, sha256=sha256(dest))
    manifest = dict(parts=len(parts), pieces=piece, gguf_bytes=total, gguf_sha256=sha256(gguf), files=files)
    for i in range(len(parts)):
        with open(os.path.join(out, f"p{i:02d}", MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
    return manifest


def _manifest(directory: str) -> dict | None:
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        try:
            return json.load(f)
        except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
            raise SystemExit(f"{path}: damaged, not readable as JSON ({e}); stage the parts again") from None


def check_file(path: str, entry: dict, then: str = "") -> None:
    """`path` holds the bytes its manifest `entry` was packed with, else an error naming it (and `then`)."""
    if os.path.getsize(path) != entry["bytes"] or sha256(path) != entry["sha256"]:
        raise SystemExit(f"{path}: {os.path.getsize(path)} bytes, not the {entry['bytes']} bytes with sha256 "
                         f"{entry['sha256'][:12]}... it was packed as{then}")


def check_staged(stage_dir: str, manifest: dict, folder: str) -> None:
    """Every file the manifest lists under `folder` is in `stage_dir` with the bytes it was packed
    with (a file changed or lost between the calls is named before anything is installed or copied)."""
    for name, entry in manifest["files"].items():
        if not name.startswith(folder + os.sep):
            continue
        path = os.path.join(stage_dir, name)
        if not os.path.exists(path):
            raise SystemExit(f"{path}: missing from the stage (it was packed in {entry['part']}); stage it again")
        check_file(path, entry, f"; stage its part ({entry['part']}) again")


def stage(kit: str, stage_dir: str) -> list[str]:
    """Move every file of the parts under `kit` into `stage_dir`, each checked against the
    manifest. Returns the parts still missing there."""
    os.makedirs(stage_dir, exist_ok=True)
    manifest = _manifest(stage_dir)
    for part in sorted(glob.glob(os.path.join(kit, "p[0-9][0-9]"))):
        got = _manifest(part)
        if got is None:
            raise SystemExit(f"{part}: no {MANIFEST} (not a part of `device_kit.py pack`)")
        if manifest is not None and got != manifest:
            raise SystemExit(f"{part}: its {MANIFEST} differs from the one staged in {stage_dir} (parts of two packs)")
        manifest = got
        for name, entry in got["files"].items():
            if entry["part"] != os.path.basename(part):
                continue
            src, dest = os.path.join(part, name), os.path.join(stage_dir, name)
            if not os.path.exists(src):
                if os.path.exists(dest):
                    continue  # moved here by an earlier call
                raise SystemExit(f"{src}: missing from its part")
            check_file(src, entry)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.move(src, dest)
        with open(os.path.join(stage_dir, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        log(f"staged {part}")
    if manifest is None:
        raise SystemExit(f"nothing staged: no part under {kit} and none in {stage_dir}")
    done = os.path.exists(os.path.join(stage_dir, COMPLETE))  # (unpack then removes what it used)
    missing = [] if done else sorted({e["part"] for n, e in manifest["files"].items()
                                      if not os.path.exists(os.path.join(stage_dir, n))})
    log(f"{manifest['parts'] - len(missing)} of {manifest['parts']} parts staged in {stage_dir}"
        + (f"; still to come: {' '.join(missing)}" if missing else ""))
    if not missing:
        open(os.path.join(stage_dir, COMPLETE), "w").close()
    return missing


def join_gguf(stage_dir: str, manifest: dict) -> str:
    """The GGUF put back together from its pieces in `stage_dir`, checked against the manifest."""
    path = os.path.join(stage_dir, "model.gguf")
    if os.path.exists(path):  # written only once checked
        return path
    tmp, digest = path + ".tmp", hashlib.sha256()
    with open(tmp, "wb") as out:  # hashed as written: one pass over the 491 MB
        for i in range(manifest["pieces"]):
            with open(os.path.join(stage_dir, PIECE.format(i)), "rb") as f:
                while chunk := f.read(1 << 24):
                    out.write(chunk)
                    digest.update(chunk)
    got = digest.hexdigest()
    if got != manifest["gguf_sha256"]:
        raise SystemExit(f"{tmp}: the joined GGUF hashes to {got[:12]}..., not {manifest['gguf_sha256'][:12]}...")
    os.replace(tmp, path)
    for i in range(manifest["pieces"]):
        os.remove(os.path.join(stage_dir, PIECE.format(i)))
    return path


def unpack(stage_dir: str, model: str, data: str, site: str | None) -> None:
    """Every part staged: the wheels into `site`, the model converted into `model`, the data into
    `data`. Each is skipped when already done."""
    manifest = _manifest(stage_dir)
    if manifest is None:
        raise SystemExit(f"{stage_dir}: nothing staged")
    if not os.path.exists(os.path.join(stage_dir, COMPLETE)):
        raise SystemExit(f"{stage_dir}: not every part is staged yet (device_kit.py stage lists them)")
    wheels = sorted(glob.glob(os.path.join(stage_dir, "wheels", "*.whl")))
    if site and wheels and not os.path.exists(os.path.join(site, ".installed")):
        check_staged(stage_dir, manifest, "wheels")
        if subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                           "--upgrade", "--target", site] + wheels).returncode:
            raise SystemExit(f"installing the wheels of {stage_dir}/wheels into {site} failed (pip's output above)")
        open(os.path.join(site, ".installed"), "w").close()
        log(f"installed {len(wheels)} wheels into {site}")
    if not os.path.exists(os.path.join(model, "sem_jax_source.json")):
        gguf = join_gguf(stage_dir, manifest)
        env = dict(os.environ)
        if site:  # the conversion reads the GGUF with the `gguf` wheel
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
        if subprocess.run([sys.executable, os.path.join(HERE, "fetch_real_model.py"), "--gguf", gguf, "--out", model],
                          env=env).returncode:
            raise SystemExit(f"converting {gguf} into {model} failed (its output above)")
        os.remove(gguf)  # fetch_real_model.py keeps its own copy beside the model directory
    if not os.path.exists(os.path.join(data, "sources.json")):
        check_staged(stage_dir, manifest, "data")
        tmp = data.rstrip(os.sep) + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(os.path.join(stage_dir, "data"), tmp)
        os.replace(tmp, data)  # sources.json, written last by fetch_real_data.py, is in it
    log(f"ready: model {model}, data {data}" + (f", wheels in {site}" if site else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="here: write the parts")
    p.add_argument("--out", default=".kit")
    p.add_argument("--gguf", default="~/.cache/sem_jax/qwen2.5-coder-0.5b-instruct.gguf")
    p.add_argument("--data", default="~/.cache/sem_jax/data")
    p.add_argument("--part-mib", type=float, default=60.0,
                   help="each part at most (the call's 64 MiB holds the working tree too)")
    p.add_argument("--python-version", default="3.12", help="the device's Python, for the wheels")
    p.add_argument("--no-wheels", action="store_true", help="pack no wheels (a device that has them)")
    s = sub.add_parser("stage", help="there: move the parts that came into the stage directory")
    s.add_argument("--kit", default=".kit")
    s.add_argument("--stage", required=True)
    u = sub.add_parser("unpack", help="there: wheels, model and data from a complete stage directory")
    u.add_argument("--stage", required=True)
    u.add_argument("--model", required=True)
    u.add_argument("--data", required=True)
    u.add_argument("--site", help="install the wheels here (PYTHONPATH it)")
    args = ap.parse_args(argv)
    expand = lambda p: os.path.abspath(os.path.expanduser(p))
    if args.cmd == "pack":
        out = expand(args.out)
        wheels = None
        if not args.no_wheels:
            wheels = out + ".wheels"
            shutil.rmtree(wheels, ignore_errors=True)
            download_wheels(wheels, args.python_version)
        try:
            m = pack(out, expand(args.gguf), expand(args.data), wheels, int(args.part_mib * 2**20))
        finally:
            if wheels:
                shutil.rmtree(wheels, ignore_errors=True)
        log(f"{m['parts']} parts in {out} (p00 .. p{m['parts'] - 1:02d}, at most {args.part_mib:g} MiB each): "
            f"carry one per call, then the experiment (scripts/gpu_experiment.sh)")
    elif args.cmd == "stage":
        stage(expand(args.kit), expand(args.stage))
    else:
        unpack(expand(args.stage), expand(args.model), expand(args.data), args.site and expand(args.site))
    return 0


if __name__ == "__main__":
    sys.exit(main())
