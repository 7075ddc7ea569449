"""The converted store: logits match the source, int8 stays within its measured budget, a killed
conversion resumes to the same bytes, and damaged stores or destinations are refused clearly."""
from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deltafin
from deltafin.checkpoint import convert as conv
from deltafin.checkpoint.convert import convert
from deltafin.checkpoint.policy import is_spine_projection
from deltafin.checkpoint.source import HFSource
from deltafin.checkpoint.store import MANIFEST, PAGE, StoreError, StoreSource, verify, verify_command
from deltafin.kernels.linear import QWeight, quantize

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b",
    "Once upon a time there was a small village by the sea.",
    "import numpy as np\nx = np.zeros(3)",
]
# int8 spine vs bf16 over PROMPTS (98 positions), measured: tiny-k3 mean KL 0.154, top-1 0.851;
# tiny-kimi-linear mean KL 0.178, top-1 0.830. The synthetic models are chaotic: independent
# weight noise of 0.2% rms (below int8's ~0.6%) already gives KL ~0.35 on a 37-token prompt, because
# routing flips compound over depth. A wrong codec or misplaced scale gives KL of several nats.
INT8_MAX_MEAN_KL = 0.35
INT8_MIN_TOP1 = 0.7


def _load(path, **kw):
    return deltafin.load(path, device="cpu", stream="off", **kw)


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def stores(tiny_k3_path, tiny_kl_path, tmp_path_factory):
    """{model: (source, bf16-only store, store with bf16 + int8 spines)}."""
    root = tmp_path_factory.mktemp("stores")
    out = {}
    for name, src in (("k3", tiny_k3_path), ("kl", tiny_kl_path)):
        bf16 = convert(src, root / f"{name}-bf16", progress=False)
        both = convert(src, root / f"{name}-both", progress=False)
        convert(src, both, spine="int8", progress=False)  # adds a second spine to a finished store
        out[name] = (Path(src), bf16, both)
    return out


@pytest.mark.parametrize("name", ["k3", "kl"])
def test_bf16_store_gives_bit_identical_logits(stores, name):
    src, bf16, _ = stores[name]
    a, b = _load(src), _load(bf16)
    assert b.source.kind == "store" and b.source.spine_codec == "bf16"
    for text in PROMPTS[:2]:
        ids = a.encode(text)
        assert b.encode(text) == ids  # the tokenizer files came along
        assert torch.equal(a.logits(ids), b.logits(ids))


@pytest.mark.parametrize("name", ["k3", "kl"])
def test_int8_spine_stays_within_measured_budget(stores, name):
    src, _, both = stores[name]
    a, b = _load(src), _load(both, spine="int8")
    assert b.source.spine_codec == "int8"
    kls, agree = [], []
    for text in PROMPTS:
        ids = a.encode(text)
        la, lb = a.logits(ids), b.logits(ids)
        kls.append(torch.sum(la.softmax(-1) * (la.log_softmax(-1) - lb.log_softmax(-1)), -1))
        agree.append(la.argmax(-1) == lb.argmax(-1))
    kl, top1 = torch.cat(kls).mean().item(), torch.cat(agree).float().mean().item()
    print(f"{name}: int8 spine vs bf16: mean KL {kl:.4f}, top-1 agreement {top1:.3f}")
    assert 0 < kl < INT8_MAX_MEAN_KL and top1 >= INT8_MIN_TOP1


@pytest.mark.parametrize("name", ["k3", "kl"])
def test_int8_spine_holds_quantize_of_projections_and_source_bytes_otherwise(stores, name):
    src, _, both = stores[name]
    hf, st = HFSource(src), StoreSource(both, spine="int8")
    n = hf.config.num_layers
    pairs = [(hf.global_infos(), st.global_infos())] + [(hf.spine_infos(i), st.spine_infos(i)) for i in range(n)]
    quantized = 0
    for hf_infos, st_infos in pairs:
        stored = _raw(st, st_infos)
        for rel, t in _raw(hf, hf_infos).items():
            quantized += _check_one(rel, t, stored)
    assert quantized > 10
    g = st.read_globals()
    assert isinstance(g["lm_head"], QWeight) and isinstance(g["embed"], torch.Tensor)
    spine = st.read_spine(n - 1)  # decoded into template slots: QWeights for projections only
    assert isinstance(spine["self_attn.o_proj"], QWeight) and spine["self_attn.o_proj"].codec == "int8"
    assert isinstance(spine["mlp.gate"], torch.Tensor) and isinstance(spine["input_layernorm"], torch.Tensor)


def _raw(source, infos) -> dict:
    from deltafin.checkpoint.source import read_infos
    return read_infos(infos, source.fd)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _check_one(rel: str, t: torch.Tensor, stored: dict) -> int:
    if is_spine_projection(rel):  # a float16 scale per 32 inputs where 32 divides the width, else one per row
        q = quantize(t, "int8", 32 if t.shape[1] % 32 == 0 else 0)
        assert torch.equal(stored[rel], q.tensors["weight"]), rel
        assert torch.equal(stored[rel + "_scale"], q.tensors["weight_scale"]), rel
        return 1
    assert stored[rel].dtype == t.dtype and torch.equal(stored[rel], t), rel
    return 0


def test_extents_are_one_page_aligned_read(stores):
    _, _, both = stores["k3"]
    st = StoreSource(both)
    for i in range(st.config.num_layers):
        file, off, n = st.spine_extent(i)
        assert off % PAGE == 0 and n % PAGE == 0
        region = Path(file).read_bytes()[off: off + n]
        direct = _raw(st, st.spine_infos(i))
        for name, info in st.spine_infos(i).items():
            assert info.file == file and off <= info.offset and info.offset + info.nbytes <= off + n
            assert region[info.offset - off: info.offset - off + info.nbytes] == _bytes(direct[name])
    i = next(i for i in range(st.config.num_layers) if st.config.is_moe(i))
    span = st.expert_span(i)
    assert span % PAGE == 0
    for e in (0, st.config.num_experts - 1):
        file, off, n = st.expert_extent(i, e)
        assert (off, n) == (e * span, span)
        region = Path(file).read_bytes()[off: off + n]
        direct = _raw(st, st.expert_infos(i, e))
        for name, info in st.expert_infos(i, e).items():
            assert region[info.offset - off: info.offset - off + info.nbytes] == _bytes(direct[name])
    w1, w3, w2 = st.read_expert(i, 3)
    assert isinstance(w1, QWeight) and w1.codec == "mxfp4"  # K3 experts stay MXFP4


def test_spine_choice(stores):
    _, bf16, both = stores["k3"]
    assert StoreSource(both).spine_codec == "int8"  # auto prefers int8
    assert StoreSource(both, spine="bf16").spine_codec == "bf16"
    with pytest.raises(StoreError, match=r"no int8 spine \(it has: bf16\)"):
        StoreSource(bf16, spine="int8")
    assert sorted(p.name for p in both.iterdir() if p.is_dir()) == ["experts", "spine", "spine-int8"]
    # the bf16 spine of the two-spine store is the bf16-only store's, byte for byte
    assert {k: v for k, v in _tree(both).items() if k.startswith("spine/")} == \
        {k: v for k, v in _tree(bf16).items() if k.startswith("spine/")}
    before = _tree(both)
    convert(stores["k3"][0], both, spine="int8", progress=False)  # already there: nothing changes
    assert _tree(both) == before


_KILLER = """
import os, signal, sys
from deltafin.checkpoint import convert as c
n, calls, write_at = int(sys.argv[3]), [0], c.AtomicFile.write_at
def dying(self, data, offset):
    calls[0] += 1
    if calls[0] == n:  # write half, then die without any cleanup
        write_at(self, memoryview(data).cast("B")[: len(data) // 2], offset)
        os.kill(os.getpid(), signal.SIGKILL)
    write_at(self, data, offset)
c.AtomicFile.write_at = dying
c.convert(sys.argv[1], sys.argv[2], progress=False)
"""


def _count_writes(monkeypatch, src, dst) -> list[str]:
    """The file each write of a full conversion goes to, in order."""
    files, write_at = [], conv.AtomicFile.write_at

    def counting(self, data, offset):
        files.append(self.final.parent.name + "/" + self.final.name)
        write_at(self, data, offset)
    monkeypatch.setattr(conv.AtomicFile, "write_at", counting)
    convert(src, dst, progress=False)
    monkeypatch.undo()
    return files


@pytest.mark.parametrize("where", ["spine", "experts"])
def test_killed_conversion_resumes_to_identical_bytes(stores, tmp_path, monkeypatch, where):
    src, bf16, _ = stores["k3"]
    writes = _count_writes(monkeypatch, src, tmp_path / "count")
    picks = [k for k, f in enumerate(writes, 1) if f.startswith(where + "/")]
    n = picks[len(picks) // 2]
    dst = tmp_path / "store"
    r = subprocess.run([sys.executable, "-c", _KILLER, str(src), str(dst), str(n)], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert not (dst / MANIFEST).exists() and (dst / ".progress").exists()
    assert list(dst.rglob("*.tmp")), "the kill should leave a half-written file behind"
    with pytest.raises(StoreError, match="not a finished deltafin store"):
        StoreSource(dst)
    _, finished = conv.read_journal(dst)
    assert finished
    inodes = {rel: (dst / rel).stat().st_ino for rel in finished}
    convert(src, dst, progress=False)
    assert _tree(dst) == _tree(bf16)
    assert {rel: (dst / rel).stat().st_ino for rel in finished} == inodes  # finished files were kept, not redone


def test_verify_names_the_corrupted_tensor(stores, tmp_path):
    _, bf16, _ = stores["k3"]
    assert verify(bf16) == []
    store = shutil.copytree(bf16, tmp_path / "store")
    m = json.loads((store / MANIFEST).read_text())
    t = m["spines"]["bf16"]["layers"][2]["tensors"]["self_attn.q_proj.weight"]
    _flip(store / t["file"], t["offset"] + 7)
    layer, x = next(iter(m["experts"]["layers"].items()))
    _flip(store / x["file"], 5 * x["span"] + x["tensors"]["w2.weight_packed"]["offset"] + 3)
    problems = verify(store)
    assert len(problems) == 2
    assert "spine/layer-002.bin" in problems[0] and "'self_attn.q_proj.weight' (layer 2, bf16 spine)" in problems[0]
    assert x["file"] in problems[1] and "'block_sparse_moe.experts.5.w2.weight_packed'" in problems[1]
    out = io.StringIO()
    assert verify_command(store, progress=False, out=out) == 1
    assert "self_attn.q_proj.weight" in out.getvalue() and "experts.5" not in out.getvalue()  # the first only
    from deltafin.cli import main
    assert main(["verify", str(bf16)]) == 0


def _flip(file: Path, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_truncated_expert_file_and_wrong_version_are_clear_errors(stores, tmp_path):
    _, bf16, _ = stores["kl"]
    store = shutil.copytree(bf16, tmp_path / "store")
    expert = sorted((store / "experts").iterdir())[1]
    os.truncate(expert, expert.stat().st_size - 100)
    with pytest.raises(StoreError, match=f"{expert}: truncated: .* bytes, the store manifest says"):
        _load(store)
    assert "truncated" in verify(store)[0]
    shutil.copy(bf16 / expert.relative_to(store), expert)
    m = json.loads((store / MANIFEST).read_text())
    (store / MANIFEST).write_text(json.dumps({**m, "version": 99}))
    with pytest.raises(StoreError, match=f"{store / MANIFEST}: store format version 99 is not supported"):
        StoreSource(store)


def test_refuses_a_destination_that_is_not_its_own(stores, tmp_path):
    src, bf16, _ = stores["k3"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(StoreError, match=f"{other}: is not empty"):
        convert(src, other, progress=False)
    assert [p.name for p in other.iterdir()] == ["notes.txt"]
    before = _tree(bf16)
    with pytest.raises(StoreError, match="a store of a different model"):
        convert(stores["kl"][0], bf16, progress=False)
    assert _tree(bf16) == before
    with pytest.raises(StoreError, match="already a deltafin store"):
        convert(bf16, tmp_path / "x", progress=False)


def test_injected_disk_full_fails_cleanly_and_resumes(stores, tmp_path, monkeypatch):
    src, bf16, _ = stores["k3"]
    dst, calls, pwrite = tmp_path / "store", [0], conv._pwrite_all

    def full_after_40(fd, data, offset):
        calls[0] += 1
        if calls[0] > 40:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        pwrite(fd, data, offset)
    monkeypatch.setattr(conv, "_pwrite_all", full_after_40)
    with pytest.raises(StoreError, match=f"{dst}: disk full while writing .*run the same command again"):
        convert(src, dst, progress=False)
    assert not list(dst.rglob("*.tmp")) and not (dst / MANIFEST).exists()
    monkeypatch.undo()
    convert(src, dst, progress=False)
    assert _tree(dst) == _tree(bf16)


@contextlib.contextmanager
def _tmpfs(path: Path, size: str):
    path.mkdir()
    if os.name != "posix" or os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_small_disk_is_refused_before_writing(stores, tmp_path):
    src = stores["k3"][0]
    with _tmpfs(tmp_path / "mnt", "1M") as mnt:
        with pytest.raises(StoreError, match=f"{mnt / 'store'}: not enough free disk space"):
            convert(src, mnt / "store", progress=False)
        assert not (mnt / "store").exists()


def test_disk_filling_up_mid_write_fails_cleanly_on_tmpfs(stores, tmp_path, monkeypatch):
    src, bf16, _ = stores["k3"]
    check = conv.check_free_space

    def another_writer_fills_the_disk(dst, need):
        check(dst, need)  # enough room when the conversion starts...
        free = shutil.disk_usage(dst.parent).free
        with open(dst.parent / "filler", "wb") as f:  # ...until something else takes most of it
            f.write(bytes(free - 300 * 1024))
    with _tmpfs(tmp_path / "mnt", "4M") as mnt:
        monkeypatch.setattr(conv, "check_free_space", another_writer_fills_the_disk)
        dst = mnt / "store"
        with pytest.raises(StoreError, match=f"{dst}: disk full while writing"):
            convert(src, dst, progress=False)
        assert not list(dst.rglob("*.tmp")) and not (dst / MANIFEST).exists()
        (mnt / "filler").unlink()
        monkeypatch.undo()
        convert(src, dst, progress=False)
        assert _tree(dst) == _tree(bf16) and verify(dst) == []


def test_start_up_line_says_when_the_spine_or_the_products_are_lossy(stores):
    from deltafin.startup import startup_message
    _, bf16, both = stores["k3"]
    line = startup_message(_load(both), both)  # auto picks the int8 spine
    assert "int8 spine: LOSSY, chosen by --spine auto" in line and "for the exact spine: --spine bf16" in line
    assert "float32 products (reference)" in line
    assert "int8 spine: LOSSY, outputs differ" in startup_message(_load(both, spine="int8"), both)
    assert "bf16 spine (exact);" in startup_message(_load(both, spine="bf16"), both)
    line = startup_message(_load(bf16, dtype="bfloat16"), bf16)
    assert "bf16 spine (exact; faster:" in line and "bfloat16 products (lossy; --dtype float32 is the reference)" in line


def test_inspect_shows_the_spine_asked_for(stores, capsys, monkeypatch):
    from deltafin.cli import main
    _, bf16, both = stores["k3"]

    def inspect(*args) -> dict:
        assert main(["inspect", *map(str, args), "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    auto, exact = inspect(both), inspect(both, "--spine", "bf16")
    assert auto["spine_codec"] == "int8" and exact["spine_codec"] == "bf16"
    assert auto["spines"] == exact["spines"] == ["bf16", "int8"]
    assert exact["spine_bytes"] > auto["spine_bytes"] and exact["expert_bytes"] == auto["expert_bytes"]
    assert exact == inspect(bf16, "--spine", "bf16") | {"path": exact["path"], "spines": ["bf16", "int8"]}
    monkeypatch.setenv("DELTAFIN_SPINE", "bf16")
    assert inspect(both)["spine_codec"] == "bf16"
    assert inspect(both, "--spine", "int8")["spine_codec"] == "int8"  # the flag wins over the environment
    assert main(["inspect", str(both)]) == 0
    assert "spine bf16 of bf16, int8" in capsys.readouterr().out
    monkeypatch.delenv("DELTAFIN_SPINE")
    # bad input: a spine the store lacks, an unknown spine, a Hugging Face folder asked for int8
    assert main(["inspect", str(bf16), "--spine", "int8"]) == 2
    assert "no int8 spine (it has: bf16)" in capsys.readouterr().err
    assert main(["inspect", str(both), "--spine", "int3"]) == 2
    assert "allowed: auto, bf16, int8, mixed" in capsys.readouterr().err
    assert main(["inspect", str(stores["k3"][0]), "--spine", "int8"]) == 2
    assert "needs a converted store" in capsys.readouterr().err
