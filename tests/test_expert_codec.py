"""Routed experts re-encoded by `deltafin convert --experts`: the store holds exactly what the
codec's quantizer gives, the model computes what the dequantized fp32 experts compute, the
trained model stays within a measured error budget, and what makes no sense is refused."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import deltafin
from conftest import KL_CODE_TINY
from deltafin.checkpoint.convert import convert
from deltafin.checkpoint.policy import PolicyError
from deltafin.checkpoint.source import HFSource, read_infos
from deltafin.checkpoint.store import MANIFEST, StoreError, StoreSource, verify
from deltafin.kernels import cpu_native
from deltafin.kernels.linear import QWeight, dequantize, quantize
from deltafin.sensitivity import kl_and_top1

CODECS = ("int8", "int4", "mxfp4")
GROUP = {"int8": 32, "int4": 32, "mxfp4": 32}
STORED = {"int8": "int8g", "int4": "int4", "mxfp4": "mxfp4"}  # --experts int8 stores grouped int8


def _load(path, **kw):
    return deltafin.load(path, device="cpu", stream="off", **kw)


@pytest.fixture(scope="module")
def kl_stores(tiny_kl_path, tmp_path_factory):
    """{codec: store of tiny-kimi-linear with int8 spine and experts in that codec}."""
    root = tmp_path_factory.mktemp("expert-stores")
    return {c: convert(tiny_kl_path, root / c, spine="int8", experts=c, progress=False) for c in CODECS}


@pytest.mark.parametrize("codec", CODECS)
def test_store_holds_the_quantizer_output_of_every_expert(tiny_kl_path, kl_stores, codec):
    hf, st = HFSource(tiny_kl_path), StoreSource(kl_stores[codec])
    assert st.expert_codec == STORED[codec]
    assert json.loads((kl_stores[codec] / MANIFEST).read_text())["experts"]["codec"] == STORED[codec]
    cfg = st.config
    layer = next(i for i in range(cfg.num_layers) if cfg.is_moe(i))
    for e in (0, cfg.num_experts - 1):
        published = read_infos(hf.expert_infos(layer, e), hf.fd)
        stored = st.read_expert(layer, e)
        for w, q in zip(("w1", "w3", "w2"), stored):
            want = quantize(published[f"block_sparse_moe.experts.{e}.{w}.weight"], codec, GROUP[codec])
            assert isinstance(q, QWeight) and q.codec == codec and q.group_size == want.group_size
            for name, t in want.tensors.items():
                assert torch.equal(q.tensors[name], t), (codec, w, name)
    assert verify(kl_stores[codec]) == []
    # a quarter (int4, mxfp4) to a half (int8) of the bf16 experts' bytes, scales included
    ratio = (sum(i.nbytes for i in st.expert_infos(layer, 0).values())
             / sum(i.nbytes for i in hf.expert_infos(layer, 0).values()))
    assert ratio < {"int8": 0.6, "int4": 0.4, "mxfp4": 0.4}[codec], ratio


# int8 products of at most 64 rows round x to int16 (2^-16 of a row's largest input): against the fp32
# dequantized experts that measured 1.2e-4 to 1.6e-4 of the largest logit on this model (summation order
# alone stays below 1e-4).
INT8_TOLERANCE = 4e-4


@pytest.mark.parametrize("codec", CODECS)
def test_quantized_experts_compute_what_their_fp32_dequantization_computes(kl_stores, codec):
    """The native decode kernels (and the torch path of longer prompts) against the same model
    whose experts are the fp32 dequantized weights: only float32 summation order differs, and for int8
    the decode kernels' rounding of x (INT8_TOLERANCE)."""
    store = kl_stores[codec]
    fast = _load(store)
    ref = _load(store)
    experts = ref.engine.provider._experts
    for layer in experts:
        for e, ws in list(layer.items()):
            layer[e] = tuple(dequantize(q) for q in ws)
    streamed = deltafin.load(store, device="cpu", stream="on")
    tolerance = INT8_TOLERANCE if codec == "int8" else 1e-4
    # one decode-sized pass, one longer than the gemvs take (the torch path)
    for ids in ([5, 17, 99, 3], list(range(40, 48 + cpu_native.GEMV_MAX_ROWS))):
        a, b = fast.logits(ids), ref.logits(ids)
        err = (a - b).abs().max().item() / b.abs().max().item()
        assert err < tolerance, (codec, len(ids), err)
        assert torch.equal(streamed.logits(ids), a)  # the streamer decodes the same bytes the same way
    state = fast.new_state()  # decode with the state: one row at a time through the gemvs
    fast.forward([5, 17, 99], state)
    step = fast.forward([3], state)[-1]
    whole = ref.logits([5, 17, 99, 3])
    assert (step - whole[-1]).abs().max().item() < tolerance * whole.abs().max().item()


# Measured on kl-code-tiny (trained), 4 prompts of its own Python text, every position (int8 spine
# in both): int8 experts mean KL 0.00009, top-1 1.000 against the bf16 experts; int4
# KL 0.0015, top-1 0.993; mxfp4 KL 0.0024, top-1 0.971. Budgets are ~4x those figures; a wrong scale or a
# misplaced tensor gives KL of several nats.
BUDGET = {"int8": (0.0005, 0.98), "int4": (0.006, 0.96), "mxfp4": (0.01, 0.93)}
TEXTS = ["def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
         "import os\n\nfor root, dirs, files in os.walk('.'):\n    for name in files:\n        print(name)\n",
         "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
         "with open(path) as f:\n    data = json.load(f)\nresult = {k: v for k, v in data.items() if v}\n"]


@pytest.fixture(scope="module")
def trained_stores(tmp_path_factory):
    if not (KL_CODE_TINY / "config.json").exists():
        pytest.skip(f"the trained model is not at {KL_CODE_TINY}")
    root = tmp_path_factory.mktemp("kl-code-tiny")
    base = convert(KL_CODE_TINY, root / "bf16-experts", spine="int8", progress=False)
    return base, {c: convert(KL_CODE_TINY, root / c, spine="int8", experts=c, progress=False) for c in CODECS}


@pytest.mark.parametrize("codec", CODECS)
def test_trained_model_stays_within_the_measured_budget(trained_stores, codec):
    base, stores = trained_stores
    a, b = _load(base), _load(stores[codec])
    ref, test = [], []
    for text in TEXTS:
        ids = a.encode(text)
        ref.append(a.logits(ids))
        test.append(b.logits(ids))
    kl, top1 = kl_and_top1(ref, test)
    print(f"kl-code-tiny, {codec} experts vs bf16: mean KL {kl:.5f}, top-1 {top1:.3f}")
    max_kl, min_top1 = BUDGET[codec]
    assert 0 < kl < max_kl and top1 >= min_top1


@pytest.mark.parametrize("experts", ["bf16", "int8"])
def test_trained_model_decodes_the_same_through_the_fused_native_paths(trained_stores, monkeypatch, experts):
    """A decode on kl-code-tiny (int8 spine; bf16 or int8 experts): a MoE layer's whole feed-forward half
    in one native call (where the shared expert is of the routed experts' kind: int8) gives the logits
    of its norm, router and experts called apart; all of a layer's routed experts and its shared expert
    in two native calls gives the logits of the shared expert apart and of the per-expert path bit for
    bit; MLA's kv_b applied on its stored bytes stays within float32 rounding of decoding it first, with
    the same greedy tokens."""
    from deltafin.kernels import cpu_native, experts_cpu
    from deltafin.model import mla
    from deltafin.model.moe import MoE
    base, stores = trained_stores
    m = _load(base if experts == "bf16" else stores["int8"], threads=2)
    ids = m.encode(TEXTS[0])[:24]

    def decode():
        st = m.new_state()
        m.forward(ids[:8], st)
        return torch.cat([m.forward(ids[t:t + 1], st) for t in range(8, len(ids))])
    calls = []
    for name in ("routed", "routed_and_shared", "moe_block_silu"):
        where = cpu_native if name == "moe_block_silu" else experts_cpu
        real = getattr(where, name)
        monkeypatch.setattr(where, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    whole = decode()
    assert ("moe_block_silu" in calls) == (experts == "int8")
    with monkeypatch.context() as p:
        p.setattr(MoE, "block", lambda *a: None)
        calls.clear()
        fused = decode()
        assert torch.equal(fused, whole)
    assert "routed_and_shared" in calls  # the fused path ran, the shared expert in its calls
    with monkeypatch.context() as p:
        p.setattr(MoE, "block", lambda *a: None)
        p.setattr(experts_cpu, "routed_and_shared", lambda *a, **k: None)
        assert torch.equal(decode(), fused)  # the shared expert apart
        p.setattr(experts_cpu, "applies", lambda z, e: False)
        assert torch.equal(decode(), fused)
        p.setattr(mla.KvB, "_native", lambda self, rows: None)
        decoded = decode()
    assert (fused - decoded).abs().max() < 1e-4 * decoded.abs().max()
    assert torch.equal(fused.argmax(-1), decoded.argmax(-1))


# -- what makes no sense is refused; what is there is kept ------------------------------------------

@pytest.mark.parametrize("codec", ["bf16", "int8", "int4"])
def test_mxfp4_experts_are_not_re_encoded(tiny_k3_path, tmp_path, codec, capsys):
    with pytest.raises(PolicyError, match=f"publishes its routed experts in MXFP4.*as {codec}"):
        convert(tiny_k3_path, tmp_path / "s", experts=codec, progress=False)
    assert not (tmp_path / "s").exists()
    from deltafin.cli import main
    assert main(["convert", str(tiny_k3_path), str(tmp_path / "s"), "--experts", codec]) == 2
    err = capsys.readouterr().err
    assert err.count("deltafin: error:") == 1 and "Leave --experts out" in err and "Traceback" not in err


def test_mxfp4_asked_for_mxfp4_experts_keeps_them(tiny_k3_path, tmp_path, capsys):
    from deltafin.cli import main
    kept = convert(tiny_k3_path, tmp_path / "keep", progress=False)
    assert main(["convert", str(tiny_k3_path), str(tmp_path / "asked"), "--experts", "mxfp4"]) == 0
    assert "experts: MXFP4" in capsys.readouterr().out
    for x in sorted((kept / "experts").iterdir()):
        assert x.read_bytes() == (tmp_path / "asked" / "experts" / x.name).read_bytes()


def test_a_store_keeps_its_experts_when_a_spine_is_added(tiny_kl_path, tmp_path):
    store = convert(tiny_kl_path, tmp_path / "s", experts="int8", progress=False)
    before = {x.name: x.read_bytes() for x in (store / "experts").iterdir()}
    convert(tiny_kl_path, store, spine="int8", progress=False)  # no --experts: the store's are kept
    assert StoreSource(store, spine="int8").expert_codec == "int8g"
    assert {x.name: x.read_bytes() for x in (store / "experts").iterdir()} == before
    with pytest.raises(StoreError, match="keeps its experts as int8g, not int4.*new folder"):
        convert(tiny_kl_path, store, spine="mixed", policy="moe4", experts="int4", progress=False)
    with pytest.raises(StoreError, match="keeps its experts as int8g, not plain"):
        convert(tiny_kl_path, store, spine="mixed", policy="moe4", experts="bf16", progress=False)


def test_a_store_of_per_row_int8_experts_stays_readable(tiny_kl_path, tmp_path):
    """Stores written before grouped int8 hold int8 experts with one float32 scale per row (store
    codec "int8", what --experts int8-row writes, beside the int8-row spine policy): they load, and
    compute what their dequantized experts compute."""
    old = convert(tiny_kl_path, tmp_path / "old", spine="mixed", policy="int8-row", experts="int8-row", progress=False)
    st = StoreSource(old)
    assert st.spine_codec == "mixed" and st.read_spine(1)["self_attn.o_proj"].group_size == 0
    assert st.expert_codec == "int8" and verify(old) == []
    layer = next(i for i in range(st.config.num_layers) if st.config.is_moe(i))
    w1 = st.read_expert(layer, 0)[0]
    assert w1.codec == "int8" and w1.group_size == 0 and w1.tensors["weight_scale"].shape[1] == 1
    fast, ref = _load(old), _load(old)
    for layer_experts in ref.engine.provider._experts:
        for e, ws in list(layer_experts.items()):
            layer_experts[e] = tuple(dequantize(q) for q in ws)
    a, b = fast.logits([5, 17, 99, 3]), ref.logits([5, 17, 99, 3])
    assert (a - b).abs().max().item() < INT8_TOLERANCE * b.abs().max().item()


def test_an_unfinished_conversion_resumes_only_with_the_same_experts(tiny_kl_path, tmp_path, monkeypatch):
    from deltafin.checkpoint import convert as conv
    dst = tmp_path / "s"
    real = conv._expert_job

    def failing(source, i, codec):
        job = real(source, i, codec)
        if i == 2:
            def write(out, tick):
                raise OSError(5, "Input/output error")
            job.write = write
        return job
    monkeypatch.setattr(conv, "_expert_job", failing)
    with pytest.raises(StoreError, match="failed while writing experts/layer-002.bin"):
        convert(tiny_kl_path, dst, experts="int4", progress=False)
    monkeypatch.undo()
    with pytest.raises(StoreError, match="experts are stored as int4, not plain"):
        convert(tiny_kl_path, dst, progress=False)
    assert not (dst / MANIFEST).exists()
    convert(tiny_kl_path, dst, experts="int4", progress=False)
    fresh = convert(tiny_kl_path, tmp_path / "fresh", experts="int4", progress=False)
    def files(store):
        return {str(p.relative_to(store)): p.read_bytes() for p in store.rglob("*.bin")}
    assert files(dst) == files(fresh)
    assert (dst / MANIFEST).read_bytes() == (fresh / MANIFEST).read_bytes()


def test_inspect_and_start_up_line_say_what_the_experts_are(kl_stores, tiny_kl_path, tiny_k3_path, capsys):
    from deltafin.cli import main
    from deltafin.startup import startup_message
    assert main(["inspect", str(kl_stores["int4"]), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["expert_codec"] == "int4"
    assert main(["inspect", str(kl_stores["int8"])]) == 0
    assert "experts int8)" in capsys.readouterr().out
    line = startup_message(_load(kl_stores["int8"]), kl_stores["int8"])
    assert "int8 experts: LOSSY (converted with --experts int8; the source's are bf16)" in line
    assert "bf16 experts (as published)" in startup_message(_load(tiny_kl_path), tiny_kl_path)
    assert "MXFP4 experts (as published)" in startup_message(_load(tiny_k3_path), tiny_k3_path)


# -- a damaged or hostile codec field is one clear error, before anything is read -------------------

def _edit(store: Path, change) -> None:
    m = json.loads((store / MANIFEST).read_text())
    change(m)
    (store / MANIFEST).write_text(json.dumps(m))


DAMAGE = {
    "unknown codec": (lambda m: m["experts"].__setitem__("codec", "int3"), "experts.codec"),
    "codec of the wrong type": (lambda m: m["experts"]["layers"]["2"].__setitem__("codec", 8),
                                "experts.layers.2.codec"),
    "layers disagree": (lambda m: m["experts"]["layers"]["3"].__setitem__("codec", "int4"), "experts.layers.3.codec"),
    "codec relabelled": (lambda m: (m["experts"].__setitem__("codec", "plain"),
                                    [x.__setitem__("codec", "plain") for x in m["experts"]["layers"].values()]),
                         "do not match the config"),
    "another int8 group": (lambda m: (m["experts"].__setitem__("codec", "int8g64"),
                                      [x.__setitem__("codec", "int8g64") for x in m["experts"]["layers"].values()]),
                           "stored as int8g64: tensor 'w1.weight_scale' is F16 [32, 2], "
                           "the config implies F16 [32, 1]"),
    "another codec's tensors": (lambda m: (m["experts"].__setitem__("codec", "mxfp4"),
                                           [x.__setitem__("codec", "mxfp4") for x in m["experts"]["layers"].values()]),
                                "do not match the config"),
    "scale dtype": (lambda m: [x["tensors"]["w1.weight_scale"].update(dtype="I8", shape=[x["tensors"]["w1.weight_scale"]
                                                                                        ["shape"][0], 4])
                               for x in m["experts"]["layers"].values()], "tensor 'w1.weight_scale' is I8"),
    "scale larger than its span": (lambda m: m["experts"]["layers"]["2"]["tensors"]["w2.weight_scale"]
                                   .update(shape=[1 << 20, 1], nbytes=2 << 20), "outside the expert span"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_expert_codec_is_one_error_line(kl_stores, tmp_path, capsys, damage):
    from deltafin.cli import main
    store = shutil.copytree(kl_stores["int8"], tmp_path / "store")
    change, needle = DAMAGE[damage]
    _edit(store, change)
    for args in (["inspect", store], ["run", "--model", store, "--max-new-tokens", "1", "hi"]):
        rc = main([str(a) for a in args])
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("deltafin: error:")]
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
        assert needle in lines[0] and "deltafin-store.json" in lines[0], lines[0]
    assert verify(store) and main(["verify", str(store)]) == 1


@pytest.mark.parametrize("group", [64, 128])
def test_int8_group_sets_the_spine_and_the_experts_scales(tmp_path, group):
    """`convert --spine int8 --experts int8 --int8-group N`: every int8 weight has one float16 scale per
    N inputs, the experts exactly the quantizer's output at that group, fewer bytes than group 32. Without
    the flag the spine takes 32 and the experts 128, which the messages call plain int8."""
    from deltafin.checkpoint import expert_codec
    from deltafin.checkpoint.synthetic import make_checkpoint
    src = make_checkpoint("tiny-kimi-linear", tmp_path / "src", seed=1, progress=False,
                          overrides={"hidden_size": 128, "moe_intermediate_size": 128})
    out = convert(src, tmp_path / "store", spine="int8", experts="int8", progress=False, int8_group=group)
    base = convert(src, tmp_path / "g32", spine="int8", experts="int8", progress=False, int8_group=32)
    hf, st = HFSource(src), StoreSource(out, spine="int8")
    assert st.expert_codec == f"int8g{group}" and verify(out) == []
    from deltafin.startup import experts_message
    said = "" if group == 128 else f" --int8-group {group}"
    assert expert_codec.describe(st.config, st.expert_codec) == "int8" + (f" (group {group})" if said else "")
    assert f"converted with --experts int8{said};" in experts_message(st)
    assert "--int8-group 32;" in experts_message(StoreSource(base, spine="int8"))
    default = StoreSource(convert(src, tmp_path / "default", spine="int8", experts="int8", progress=False), spine="int8")
    assert default.expert_codec == "int8g128"
    assert _load(default.path).layer_weights(0)["self_attn.q_proj"].group_size == 32
    cfg = st.config
    layer = next(i for i in range(cfg.num_layers) if cfg.is_moe(i))
    published = read_infos(hf.expert_infos(layer, 1), hf.fd)
    for w, q in zip(("w1", "w3", "w2"), st.read_expert(layer, 1)):
        want = quantize(published[f"block_sparse_moe.experts.1.{w}.weight"], "int8", group)
        assert q.group_size == group and all(torch.equal(q.tensors[k], t) for k, t in want.tensors.items())
    q = _load(out).layer_weights(layer)["self_attn.q_proj"]  # 128 inputs: a group of 128 fits
    assert isinstance(q, QWeight) and q.group_size == group
    assert q.tensors["weight_scale"].shape == (q.out_features, q.in_features // group)
    size = lambda p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file())  # noqa: E731
    assert size(out) < size(base)
    assert torch.isfinite(_load(out).logits(list(range(5, 25)))).all()  # the model loads and runs on it


def test_int8_group_is_refused_where_it_means_nothing(tiny_kl_path, tmp_path):
    with pytest.raises(PolicyError, match="--int8-group takes one of 32, 64, 128"):
        convert(tiny_kl_path, tmp_path / "a", spine="int8", progress=False, int8_group=48)
    with pytest.raises(PolicyError, match="--int8-group applies to --spine int8 and --experts int8"):
        convert(tiny_kl_path, tmp_path / "b", spine="bf16", experts="int4", progress=False, int8_group=64)
    with pytest.raises(PolicyError, match="needs expert widths divisible by 64"):  # tiny: 32 wide
        convert(tiny_kl_path, tmp_path / "c", experts="int8", progress=False, int8_group=64)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


WIDE_IDS = list(range(5, 29))


def _prompt_and_decode(m, prompt: int = 16) -> torch.Tensor:
    """Logits of a `prompt`-token prompt and the decode steps after it (WIDE_IDS in all)."""
    st = m.new_state()
    first = m.forward(WIDE_IDS[:prompt], st)
    return torch.cat([first] + [m.forward(WIDE_IDS[t:t + 1], st) for t in range(prompt, len(WIDE_IDS))])


def test_resident_int8_weights_are_interleaved_on_the_cpu_and_compute_what_the_plain_ones_do(wide_q8_path,
                                                                                            monkeypatch):
    """In RAM on the CPU, grouped int8 weights of 512 inputs or more (spine and experts; not MLA's kv_b,
    whose transposed products read columns) are held in the interleaved layout: the prompt's and the
    decode's logits stay within float32 summation order of the same store held plain, with the same greedy
    tokens, and a held weight gives back the stored layout (``to_tensors``, another device)."""
    from deltafin.io import ram

    def run():
        m = _load(wide_q8_path)
        return m, _prompt_and_decode(m)
    m, inter = run()
    _, spines, experts = m.engine.provider.held()
    held = [w for s in spines for k, w in s.items() if isinstance(w, QWeight) and not k.endswith("kv_b_proj")]
    held += [w for layer in experts for ws in layer.values() for w in ws]
    wide = [w for w in held if w.shape[1] >= 512]
    assert wide and all(w.tensors["weight_scale"].dim() == 3 for w in wide)
    assert all(w.tensors["weight_scale"].dim() == 2 for s in spines for k, w in s.items() if k.endswith("kv_b_proj"))
    with monkeypatch.context() as p:
        p.setattr(ram, "cpu_layout", lambda name, w: w)
        _, plain = run()
    # float32 summation order alone, through this random model: 2.5e-4 of the largest logit (as much as the
    # plain layout's AVX2 and AVX-512 products differ here)
    assert (inter - plain).abs().max() < 1e-3 * plain.abs().max()
    assert torch.equal(inter.argmax(-1), plain.argmax(-1))
    w = wide[0]
    assert torch.equal(dequantize(w), dequantize(QWeight(w.codec, w.shape, w.group_size, w.plain_tensors())))
    moved = w.to("meta")
    assert moved.tensors["weight_scale"].dim() == 2 and moved.tensors["weight"].shape == w.shape
    assert w.to_tensors()["weight_scale"].dim() == 2


def _interleaved(w) -> bool:
    return w.tensors["weight_scale"].dim() == 3


@pytest.mark.parametrize("prefetch", ["off", "early"])
def test_a_streamed_models_ram_cache_keeps_grouped_int8_interleaved(wide_q8_path, prefetch):
    """Streamed on the CPU with a RAM cache that holds the whole model, what stays in RAM for good (the
    globals, the spines the cache took, its experts, also those a prefetch read: a one-token prompt leaves
    experts for the decode's guesses) is laid out as in a resident model, and the logits are the resident
    model's."""
    from deltafin.runtime.pass_stats import PassObserver
    resident = _prompt_and_decode(_load(wide_q8_path), prompt=1)
    m = deltafin.load(wide_q8_path, device="cpu", stream="on", ram_budget="8", prefetch=prefetch)
    prefetched = []

    class Prefetched(PassObserver):
        def on_pass(self, stats):
            prefetched.append(stats.prefetch_used_bytes)
    with m.observe(Prefetched()):
        streamed = _prompt_and_decode(m, prompt=1)
    assert (sum(prefetched) > 0) == (prefetch == "early")
    assert (streamed - resident).abs().max() < 1e-5 * resident.abs().max()
    assert torch.equal(streamed.argmax(-1), resident.argmax(-1))
    provider, cfg = m.engine.provider, m.config
    assert _interleaved(provider.globals()["lm_head"])
    cache = provider.cache
    spines = [cache.spine(i) for i in range(cfg.num_layers)]
    assert all(s is not None for s in spines)
    wide = [w for s in spines for k, w in s.items() if isinstance(w, QWeight) and w.shape[1] >= 512]
    assert wide and all(_interleaved(w) != k.endswith("kv_b_proj")
                        for s in spines for k, w in s.items() if isinstance(w, QWeight) and w.shape[1] >= 512)
    experts = [cache.expert(i, e) for i in range(cfg.num_layers) if cfg.is_moe(i) for e in range(cfg.num_experts)]
    held = [ws for ws in experts if ws is not None]
    assert held and all(_interleaved(w) for ws in held for w in ws)


def test_the_cache_lays_out_experts_only_while_it_holds_all_of_a_layers():
    """Experts that replace each other in a cache holding some of a layer's keep the stored layout (their
    permutation would cost about what their read does); with every expert held, and for spines, the CPU's."""
    from deltafin.io.ram_cache import RamCache
    w = quantize(torch.randn(64, 512), "int8", 32)
    on_cpu = RamCache([10, 10], [0, 100], 4, cpu_layout=True)
    for target, laid_out in ((20 + 2 * 100, False), (20 + 4 * 100, True)):  # both spines, then 2 or 4 slots
        on_cpu.set_target(target)
        kept = on_cpu.expert_to_keep((quantize(torch.randn(64, 512), "int8", 32),))
        assert _interleaved(kept[0]) == laid_out
    assert _interleaved(on_cpu.spine_to_keep({"mlp.down_proj": w})["mlp.down_proj"])
    for_device = RamCache([10, 10], [0, 100], 4)
    for_device.set_target(10 ** 6)
    assert not _interleaved(for_device.expert_to_keep((quantize(torch.randn(64, 512), "int8", 32),))[0])
    assert not _interleaved(for_device.spine_to_keep({"w": quantize(torch.randn(64, 512), "int8", 32)})["w"])
