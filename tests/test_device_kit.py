"""scripts/device_kit.py: the experiment's files packed into parts under a size limit, staged one
call at a time, checked, and put back together (small fake files; no network)."""

import hashlib
import importlib.util
import json
import os
import shutil

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def kit():
    spec = importlib.util.spec_from_file_location("device_kit", os.path.join(REPO, "scripts", "device_kit.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def files(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(bytes(range(256)) * 4)  # 1024 bytes
    data = tmp_path / "data"
    data.mkdir()
    (data / "mmlu_test.jsonl").write_bytes(b"m" * 150)
    (data / "sources.json").write_bytes(b"{}")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "w-1.0-py3-none-any.whl").write_bytes(b"w" * 100)
    return gguf, data, wheels


def test_pack_stage_one_part_a_call_and_join(kit, files, tmp_path):
    gguf, data, wheels = files
    m = kit.pack(str(tmp_path / "kit"), str(gguf), str(data), str(wheels), part_bytes=400, reserve=0)
    # 252 bytes of data and wheels fill p00 with 148 GGUF bytes; then 400, 400 and the last 76.
    assert m["parts"] == 4 and m["pieces"] == 4 and m["gguf_bytes"] == 1024
    sizes = {p: sum(e["bytes"] for e in m["files"].values() if e["part"] == p) for p in ("p00", "p01", "p02", "p03")}
    assert sizes == {"p00": 400, "p01": 400, "p02": 400, "p03": 76}
    stage = tmp_path / "stage"
    for i in range(4):  # each call brings one part; what an earlier call brought is gone from the tree
        call = tmp_path / f"call{i}"
        shutil.copytree(tmp_path / "kit" / f"p{i:02d}", call / ".kit" / f"p{i:02d}")
        missing = kit.stage(str(call / ".kit"), str(stage))
        assert missing == [f"p{j:02d}" for j in range(i + 1, 4)]
        assert os.path.exists(stage / kit.COMPLETE) == (i == 3)
    assert kit.stage(str(tmp_path / "nothing"), str(stage)) == []  # a call with no part: still complete
    joined = kit.join_gguf(str(stage), m)
    assert open(joined, "rb").read() == gguf.read_bytes()
    assert kit.stage(str(tmp_path / "nothing"), str(stage)) == []  # complete, the pieces joined

    model = tmp_path / "model"  # converted already (the marker): unpack copies the data only
    model.mkdir()
    (model / "sem_jax_source.json").write_text("{}")
    kit.unpack(str(stage), str(model), str(tmp_path / "out_data"), None)
    assert (tmp_path / "out_data" / "mmlu_test.jsonl").read_bytes() == b"m" * 150


def test_a_damaged_or_foreign_part_is_named(kit, files, tmp_path):
    gguf, data, wheels = files
    kit.pack(str(tmp_path / "kit"), str(gguf), str(data), None, part_bytes=400, reserve=0)
    piece = tmp_path / "kit" / "p01" / "model.gguf.001"
    piece.write_bytes(b"x" + piece.read_bytes()[1:])
    with pytest.raises(SystemExit, match=r"p01/model.gguf.001: 400 bytes, not the 400 bytes with sha256"):
        kit.stage(str(tmp_path / "kit"), str(tmp_path / "stage"))
    with pytest.raises(SystemExit, match="not every part is staged"):
        kit.unpack(str(tmp_path / "stage"), str(tmp_path / "m"), str(tmp_path / "d"), None)

    other = tmp_path / "other.gguf"
    other.write_bytes(b"y" * 1024)
    kit.pack(str(tmp_path / "kit2"), str(other), str(data), None, part_bytes=400, reserve=0)
    with pytest.raises(SystemExit, match="parts of two packs"):
        kit.stage(str(tmp_path / "kit2"), str(tmp_path / "stage"))
    with pytest.raises(SystemExit, match="exists"):
        kit.pack(str(tmp_path / "kit"), str(gguf), str(data), None, part_bytes=400, reserve=0)

    # Pieces that each pass but join into another file (a manifest edited by hand): refused, kept apart.
    stage = tmp_path / "stage3"
    kit.pack(str(tmp_path / "kit3"), str(gguf), str(data), None, part_bytes=400, reserve=0)
    kit.stage(str(tmp_path / "kit3"), str(stage))
    m = json.loads((stage / kit.MANIFEST).read_text())
    m["gguf_sha256"] = hashlib.sha256(b"another").hexdigest()
    with pytest.raises(SystemExit, match="the joined GGUF hashes to"):
        kit.join_gguf(str(stage), m)
    assert not (stage / "model.gguf").exists()


def test_unpack_checks_the_staged_data_against_the_manifest(kit, files, tmp_path):
    """A staged data file changed or lost after `stage` checked it is named, and nothing is
    copied; a damaged manifest is named too."""
    gguf, data, wheels = files
    m = kit.pack(str(tmp_path / "kit"), str(gguf), str(data), None, part_bytes=4096, reserve=0)
    stage = tmp_path / "stage"
    assert kit.stage(str(tmp_path / "kit"), str(stage)) == []
    model = tmp_path / "model"
    model.mkdir()
    (model / "sem_jax_source.json").write_text("{}")  # converted already: unpack copies the data only
    staged = stage / "data" / "mmlu_test.jsonl"
    staged.write_bytes(b"M" + staged.read_bytes()[1:])
    with pytest.raises(SystemExit, match=f"{staged}: 150 bytes, not the 150 bytes with sha256 "
                                         f"{m['files']['data/mmlu_test.jsonl']['sha256'][:12]}"):
        kit.unpack(str(stage), str(model), str(tmp_path / "out_data"), None)
    staged.unlink()
    with pytest.raises(SystemExit, match=f"{staged}: missing from the stage"):
        kit.unpack(str(stage), str(model), str(tmp_path / "out_data"), None)
    assert not (tmp_path / "out_data").exists()
    (stage / kit.MANIFEST).write_text('{"parts": 1, "fil')
    with pytest.raises(SystemExit, match=f"{stage / kit.MANIFEST}: damaged, not readable as JSON"):
        kit.unpack(str(stage), str(model), str(tmp_path / "out_data"), None)
