"""Model zoo: parameter totals against the reference implementations, FLOPs, orders, profiles."""
import json

import pytest

from aluminum_py.planning.models import MODELS, Layer, Model, get_model

# torchvision / Hugging Face: sum(p.numel() for p in model.parameters());
# Keras Xception: count_params() (total, with BN moving statistics) and trainable weights.
TOTALS = {
    "resnet50": 25_557_032,
    "resnet152": 60_192_808,
    "vgg16": 138_357_544,
    "vgg19": 143_667_240,
    "bert-base": 109_482_240,
    "xception": 22_910_480,
}
XCEPTION_TRAINABLE = 22_855_952  # Keras: 54,528 non-trainable (BN moving mean + variance)

# forward multiply-adds per sample, GMACs: commonly cited figures (fvcore / ptflops) for the
# CNNs; BERT-Base at 128 tokens: 85M encoder weights x 128 tokens + attention ~ 11.2
GMACS = {"resnet50": 4.1, "resnet152": 11.5, "vgg16": 15.5, "vgg19": 19.6, "xception": 8.4,
         "bert-base": 11.2}


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    return get_model(request.param)


def test_models_listed():
    assert set(MODELS) == set(TOTALS)


def test_known_totals(model):
    assert model.total_params == TOTALS[model.name]
    assert sum(l.params + l.non_trainable for l in model.layers) == model.total_params


def test_trainable_counts(model):
    assert sum(l.params for l in model.layers) == model.trainable_params
    if model.name == "xception":
        assert model.trainable_params == XCEPTION_TRAINABLE
        assert all(l.non_trainable == l.params for l in model.layers if l.name.endswith("_bn"))
    else:  # torchvision / HF: BN running stats are buffers, not parameters
        assert model.trainable_params == model.total_params


def test_layers_produce_gradients(model):
    names = [l.name for l in model.layers]
    assert len(set(names)) == len(names)
    assert all(l.params > 0 and l.flops > 0 for l in model.layers)


def test_flops_sanity(model):
    gmacs = model.total_flops / 2e9
    assert gmacs == pytest.approx(GMACS[model.name], rel=0.05)


def test_known_layers():
    r = {l.name: l for l in get_model("resnet50").layers}
    assert r["conv1"].params == 7 * 7 * 3 * 64 and r["bn1"].params == 128
    assert r["layer2.0.downsample.0"].params == 256 * 512
    assert r["fc"].params == 2048 * 1000 + 1000
    assert r["conv1"].flops == 2 * 7 * 7 * 3 * 64 * 112 * 112  # + no merged ops before it
    v = {l.name: l for l in get_model("vgg16").layers}
    assert v["classifier.0"].params == 25088 * 4096 + 4096
    assert v["features.28"].params == 3 * 3 * 512 * 512 + 512
    x = {l.name: l for l in get_model("xception").layers}
    assert x["block4_sepconv1"].params == 9 * 256 + 256 * 728
    assert x["predictions"].params == 2048 * 1000 + 1000


def test_bert_seq_len():
    short, long = get_model("bert-base", seq_len=64), get_model("bert-base", seq_len=256)
    assert short.total_params == long.total_params == TOTALS["bert-base"]
    assert 2 < long.total_flops / short.total_flops < 5  # linear parts x4, attention x16
    with pytest.raises(ValueError):
        get_model("bert-base", seq_len=513)


def test_backward_order(model):
    fwd, bwd = list(model.layers), model.backward_order()
    assert bwd == fwd[::-1]
    assert model.comm_bytes() == [4 * l.params for l in bwd]


def test_comm_bytes_dtype():
    m = get_model("resnet50")
    assert sum(m.comm_bytes()) == 4 * m.trainable_params
    assert m.comm_bytes(2) == [b // 2 for b in m.comm_bytes(4)]
    assert Layer("x", 10).bytes() == 40 and Layer("x", 10).bytes(8) == 80
    x = get_model("xception")  # BN statistics are not communicated
    assert sum(x.comm_bytes(1)) == XCEPTION_TRAINABLE
    with pytest.raises(ValueError):
        m.comm_bytes(0)


def test_compute_times_scaling():
    m = get_model("resnet50")
    base = m.compute_times(1e13)
    assert len(base) == len(m.layers)
    assert sum(base) == pytest.approx(2 * m.total_flops / 1e13)
    assert base[0] == pytest.approx(2 * m.layers[-1].flops / 1e13)  # backward order
    assert m.compute_times(1e13, batch=8) == pytest.approx([8 * t for t in base])
    assert m.compute_times(2e13) == pytest.approx([t / 2 for t in base])
    assert m.compute_times(1e13, backward_factor=3.0) == pytest.approx([1.5 * t for t in base])
    with pytest.raises(ValueError):
        m.compute_times(0)
    with pytest.raises(ValueError):
        m.compute_times()  # no profile and no throughput


@pytest.mark.parametrize("suffix", [".json", ".csv"])
def test_profile_round_trip(tmp_path, suffix):
    m = get_model("xception")
    times = m.compute_times(5e12, batch=16)
    path = tmp_path / f"xception{suffix}"
    m.to_profile(path, times, batch=16)
    p = Model.from_profile(path, batch=None if suffix == ".json" else 16)
    assert [l.name for l in p.layers] == [l.name for l in m.layers]
    assert p.layers == m.layers
    assert p.total_params == m.total_params
    assert p.comm_bytes() == m.comm_bytes()
    assert p.compute_times() == pytest.approx(times)
    assert p.compute_times(batch=32) == pytest.approx([2 * t for t in times])
    assert p.compute_times(5e12, batch=16) == pytest.approx(times)  # FLOPs kept too
    p.to_profile(tmp_path / f"again{suffix}")  # defaults to its own times
    again = Model.from_profile(tmp_path / f"again{suffix}", batch=16)
    assert again.compute_times() == pytest.approx(times)


def test_profile_minimal_json(tmp_path):
    path = tmp_path / "p.json"
    rows = [{"name": "fc", "params": 10, "backward_seconds": 0.5},  # backward order: fc first
            {"name": "conv", "params": 4, "backward_seconds": 0.25}]
    path.write_text(json.dumps({"layers": rows}))
    p = Model.from_profile(path, name="toy")
    assert p.name == "toy" and [l.name for l in p.layers] == ["conv", "fc"]
    assert p.compute_times() == [0.5, 0.25] and p.comm_bytes(2) == [20, 8]
    with pytest.raises(ValueError):
        p.compute_times(batch=4)  # the profile's batch is unknown
    with pytest.raises(ValueError):
        p.compute_times(1e12)  # no FLOPs in the profile
    with pytest.raises(ValueError):
        Model.from_profile(tmp_path / "p.txt")


def test_unknown_model():
    with pytest.raises(ValueError, match="resnet50.*xception"):
        get_model("alexnet")
    assert get_model("ResNet50").name == "resnet50"
