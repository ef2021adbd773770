"""Model zoo: per-layer gradient sizes and compute costs for the communication planners.

Every model is built layer by layer from its architecture's definition (kernel sizes, channels,
strides, padding, hidden sizes); no totals are typed in.  Tests check the totals against the
reference implementations.

Layers.  A :class:`Layer` is one module that owns trainable parameters (a convolution, batch norm,
dense layer, embedding table or layer norm), i.e. one producer of a gradient tensor (weight and
bias together).  ``Model.layers`` is in forward order; the planners take everything in backward
order (:meth:`Model.backward_order`, :meth:`Model.comm_bytes`, :meth:`Model.compute_times`), the
order in which gradients become ready.

Parameter-free ops (activations, pooling, residual adds, attention scores/softmax) produce no
gradient, so they are not layers: their FLOPs are added to the nearest *preceding* parametrised
layer in forward order, which is the *next* one in backward order.  That is where their backward
work happens: after the later layer's gradient is ready and before this layer's is.  (Ops before
the first parametrised layer, if any, go to the first layer.)  Every layer has ``params > 0``.

Parameter counts.  ``Layer.params`` counts trainable parameters, the elements of the gradient.
``Layer.non_trainable`` counts weights the reference framework reports but that get no gradient:
Keras's batch-norm moving mean and variance (Xception only).  torchvision keeps BN running
statistics as buffers, not parameters, so they are not counted for ResNet (its BN layers count
weight + bias only), exactly as ``sum(p.numel() for p in model.parameters())``.
``Model.total_params`` = params + non_trainable, the framework's published total (Keras
``count_params()`` for Xception, which includes the BN statistics); ``Model.trainable_params``
is what gets communicated.

FLOPs convention.  ``Layer.flops`` is forward FLOPs for ONE sample (an image, or one sequence of
``seq_len`` tokens) with a multiply-add counted as 2 FLOPs; bias adds are not counted.  Cheap
elementwise ops are counted roughly per element (ReLU 1, residual add 1, batch norm 2 (the folded
affine), layer norm 5, softmax 5, GELU 8, tanh 4, max/avg pooling one per window element, an
embedding lookup 1); they are about 1% of the convolution/matmul FLOPs.

Inputs: 224x224x3 (ResNet, VGG), 299x299x3 (Xception), ``seq_len=128`` tokens (BERT).

Compute time.  ``compute_times(throughput_flops, backward_factor=2.0, batch=1)`` is
``flops * batch * backward_factor / throughput_flops`` per layer: backward costs about twice the
forward (one product for the input gradient, one for the weight gradient).  ``throughput_flops``
is the sustained FLOP/s you assume for the device (e.g. 60e12 for an A100 in mixed precision at
~20% of peak); results are only as good as that figure.  Measured times are better: see
:meth:`Model.from_profile` for the file format.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass, replace
from pathlib import Path

MODELS = ("resnet50", "resnet152", "vgg16", "vgg19", "bert-base", "xception")

# rough FLOPs per element of the elementwise ops (see module docstring)
RELU, ADD, BN, LN, SOFTMAX, GELU, TANH, LOOKUP = 1, 1, 2, 5, 5, 8, 4, 1


@dataclass(frozen=True)
class Layer:
    """One gradient-producing layer: trainable ``params``, forward ``flops`` per sample."""
    name: str
    params: int
    flops: float = 0.0
    non_trainable: int = 0

    def bytes(self, dtype_size: int = 4) -> int:
        """Size of this layer's gradient in bytes."""
        return self.params * dtype_size


@dataclass(frozen=True)
class Model:
    """A model as the planners see it: layers in forward order, optionally profiled times.

    ``backward_seconds`` (forward order, like ``layers``) and ``profile_batch`` are set by
    :meth:`from_profile`.
    """
    name: str
    layers: tuple[Layer, ...]
    input: str = ""
    backward_seconds: tuple[float, ...] | None = None
    profile_batch: int | None = None

    def backward_order(self) -> list[Layer]:
        return list(self.layers[::-1])

    @property
    def total_params(self) -> int:
        """All weights the reference framework counts (including Keras BN statistics)."""
        return sum(l.params + l.non_trainable for l in self.layers)

    @property
    def trainable_params(self) -> int:
        return sum(l.params for l in self.layers)

    @property
    def total_flops(self) -> float:
        """Forward FLOPs for one sample."""
        return sum(l.flops for l in self.layers)

    def comm_bytes(self, dtype_size: int = 4) -> list[int]:
        """Gradient bytes per layer, in backward order."""
        if dtype_size <= 0:
            raise ValueError(f"dtype_size must be positive, got {dtype_size}")
        return [l.bytes(dtype_size) for l in self.backward_order()]

    def compute_times(self, throughput_flops: float | None = None, backward_factor: float = 2.0,
                      batch: int | None = None) -> list[float]:
        """Backward compute seconds per layer, in backward order.

        With ``throughput_flops`` (FLOP/s): ``flops * batch * backward_factor / throughput``,
        ``batch`` defaulting to 1.  Without it, the profiled times; a ``batch`` different from
        the profile's scales them linearly (an approximation: small batches use the GPU worse).
        """
        if batch is not None and batch <= 0:
            raise ValueError(f"batch must be positive, got {batch}")
        if throughput_flops is None:
            if self.backward_seconds is None:
                raise ValueError(f"{self.name}: no profiled times; give throughput_flops")
            scale = 1.0
            if batch is not None and batch != self.profile_batch:
                if self.profile_batch is None:
                    raise ValueError(f"{self.name}: the profile does not say its batch size")
                scale = batch / self.profile_batch
            return [s * scale for s in self.backward_seconds[::-1]]
        if throughput_flops <= 0:
            raise ValueError(f"throughput_flops must be positive, got {throughput_flops}")
        if self.total_flops <= 0:
            raise ValueError(f"{self.name}: no FLOPs known for its layers")
        k = backward_factor * (1 if batch is None else batch) / throughput_flops
        return [l.flops * k for l in self.backward_order()]

    # -- profiles ----------------------------------------------------------------------------
    @classmethod
    def from_profile(cls, path: str | Path, name: str | None = None,
                     batch: int | None = None) -> Model:
        """Load measured per-layer backward times.

        Rows are layers in BACKWARD order (the order a backward-hook profiler sees them) with
        ``name``, ``params`` (trainable, gradient elements) and ``backward_seconds`` (backward
        time of that layer plus the parameter-free ops merged into it, at the profiled batch
        size), optionally ``flops`` (forward, per sample) and ``non_trainable``.

        * ``.json``: ``{"model": str, "batch": int, "layers": [{"name": ..., "params": ...,
          "backward_seconds": ...}, ...]}`` (``model`` and ``batch`` optional).
        * ``.csv``: a header row ``name,params,backward_seconds[,flops][,non_trainable]`` then
          one row per layer; pass ``batch`` here since CSV does not carry it.

        ``name`` and ``batch`` given here override the file's.
        """
        path = Path(path)
        if path.suffix == ".json":
            doc = json.loads(path.read_text())
            rows, name, batch = doc["layers"], name or doc.get("model"), batch or doc.get("batch")
        elif path.suffix == ".csv":
            with path.open(newline="") as f:
                rows = list(csv.DictReader(f))
        else:
            raise ValueError(f"profile must be .json or .csv: {path}")
        if not rows:
            raise ValueError(f"{path}: no layers")
        layers = tuple(Layer(str(r["name"]), int(r["params"]), float(r.get("flops") or 0),
                             int(r.get("non_trainable") or 0)) for r in rows[::-1])
        secs = tuple(float(r["backward_seconds"]) for r in rows[::-1])
        if any(s < 0 for s in secs) or any(l.params < 0 for l in layers):
            raise ValueError(f"{path}: negative params or backward_seconds")
        return cls(name or path.stem, layers, f"profile {path.name}", secs,
                   None if batch is None else int(batch))

    def to_profile(self, path: str | Path, backward_seconds: list[float] | None = None,
                   batch: int | None = None) -> None:
        """Write a profile file (format of :meth:`from_profile`); ``backward_seconds`` in
        backward order (as :meth:`compute_times` returns them), default the model's own."""
        path = Path(path)
        if backward_seconds is None:
            backward_seconds = self.compute_times()
            batch = self.profile_batch if batch is None else batch
        if len(backward_seconds) != len(self.layers):
            raise ValueError(f"{len(backward_seconds)} times for {len(self.layers)} layers")
        rows = [dict(name=l.name, params=l.params, backward_seconds=s, flops=l.flops,
                     non_trainable=l.non_trainable)
                for l, s in zip(self.backward_order(), backward_seconds)]
        if path.suffix == ".json":
            path.write_text(json.dumps(dict(model=self.name, batch=batch, layers=rows), indent=1))
        elif path.suffix == ".csv":
            with path.open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
        else:
            raise ValueError(f"profile must be .json or .csv: {path}")


# -- builder -----------------------------------------------------------------------------------
class _Net:
    """Tracks the activation shape (h, w, c) of one sample and collects layers in forward order.

    Sequences use h = tokens, w = 1, c = hidden.  ``keras`` counts BN moving statistics as
    non-trainable weights.
    """

    def __init__(self, h: int, w: int, c: int, keras: bool = False):
        self.shape = (h, w, c)
        self.keras = keras
        self.layers: list[Layer] = []
        self._pending = 0.0

    @property
    def numel(self) -> int:
        h, w, c = self.shape
        return h * w * c

    def add(self, name, params, flops, non_trainable=0):
        self.layers.append(Layer(name, params, flops + self._pending, non_trainable))
        self._pending = 0.0

    def op(self, flops):
        """A parameter-free op: its FLOPs go to the preceding parametrised layer."""
        if self.layers:
            self.layers[-1] = replace(self.layers[-1], flops=self.layers[-1].flops + flops)
        else:
            self._pending += flops

    def _out(self, k, stride, pad):
        """Output (h, w): ``pad`` an int, or "same" (Keras: ceil(in / stride))."""
        h, w, _ = self.shape
        if pad == "same":
            return -(-h // stride), -(-w // stride)
        return (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1

    def conv(self, name, cout, k, stride=1, pad=None, bias=False):
        h, w = self._out(k, stride, k // 2 if pad is None else pad)
        cin = self.shape[2]
        self.shape = (h, w, cout)
        self.add(name, k * k * cin * cout + (cout if bias else 0), 2 * k * k * cin * h * w * cout)

    def sepconv(self, name, cout, k=3):
        """Keras SeparableConv2D, padding "same", no bias: depthwise k x k, then pointwise 1x1."""
        h, w = self._out(k, 1, "same")
        cin = self.shape[2]
        self.shape = (h, w, cout)
        self.add(name, k * k * cin + cin * cout, 2 * h * w * (k * k * cin + cin * cout))

    def bn(self, name):
        c = self.shape[2]
        self.add(name, 2 * c, BN * self.numel, 2 * c if self.keras else 0)

    def layernorm(self, name):
        self.add(name, 2 * self.shape[2], LN * self.numel)

    def linear(self, name, cout, bias=True):
        h, w, cin = self.shape
        self.shape = (h, w, cout)
        self.add(name, cin * cout + (cout if bias else 0), 2 * h * w * cin * cout)

    def embedding(self, name, rows):
        self.add(name, rows * self.shape[2], LOOKUP * self.numel)

    def relu(self):
        self.op(RELU * self.numel)

    def residual_add(self):
        self.op(ADD * self.numel)

    def pool(self, k, stride, pad=0):
        self.shape = (*self._out(k, stride, pad), self.shape[2])
        self.op(k * k * self.numel)

    def global_pool(self, size=1):
        """Adaptive average pooling to size x size (reads every input element once)."""
        self.op(self.numel)
        self.shape = (size, size, self.shape[2])

    def flatten(self):
        self.shape = (1, 1, self.numel)

    def model(self, name, desc):
        if self._pending:
            raise ValueError(f"{name}: parameter-free ops with no layer to merge into")
        return Model(name, tuple(self.layers), desc)


# -- architectures -----------------------------------------------------------------------------
def resnet(blocks: tuple[int, int, int, int], name: str, image_size: int = 224) -> Model:
    """torchvision ResNet with Bottleneck blocks (v1.5: stride on the 3x3 conv)."""
    n = _Net(image_size, image_size, 3)
    n.conv("conv1", 64, 7, 2)
    n.bn("bn1")
    n.relu()
    n.pool(3, 2, 1)
    for stage, (count, width) in enumerate(zip(blocks, (64, 128, 256, 512))):
        for j in range(count):
            p, stride, x = f"layer{stage + 1}.{j}", (2 if stage and not j else 1), n.shape
            n.conv(f"{p}.conv1", width, 1)
            n.bn(f"{p}.bn1")
            n.relu()
            n.conv(f"{p}.conv2", width, 3, stride)
            n.bn(f"{p}.bn2")
            n.relu()
            n.conv(f"{p}.conv3", 4 * width, 1)
            n.bn(f"{p}.bn3")
            if j == 0:  # channels (and, after stage 1, resolution) change: project the input
                n.shape = x
                n.conv(f"{p}.downsample.0", 4 * width, 1, stride)
                n.bn(f"{p}.downsample.1")
            n.residual_add()
            n.relu()
    n.global_pool()
    n.linear("fc", 1000)
    return n.model(name, f"{image_size}x{image_size}x3")


def vgg(convs: tuple[int, ...], name: str, image_size: int = 224) -> Model:
    """torchvision VGG without batch norm; names are torchvision's module indices."""
    n, i = _Net(image_size, image_size, 3), 0
    for count, ch in zip(convs, (64, 128, 256, 512, 512)):
        for _ in range(count):
            n.conv(f"features.{i}", ch, 3, bias=True)
            n.relu()
            i += 2  # Conv2d, ReLU
        n.pool(2, 2)
        i += 1
    n.global_pool(7)  # AdaptiveAvgPool2d((7, 7)): already 7x7 at 224
    n.flatten()
    n.linear("classifier.0", 4096)
    n.relu()
    n.linear("classifier.3", 4096)  # (dropout between: no FLOPs counted)
    n.relu()
    n.linear("classifier.6", 1000)
    return n.model(name, f"{image_size}x{image_size}x3")


def bert_base(seq_len: int = 128, vocab: int = 30522, positions: int = 512, types: int = 2,
              hidden: int = 768, layers: int = 12, heads: int = 12,
              intermediate: int = 3072) -> Model:
    """Hugging Face BertModel (bert-base-uncased) with the pooler; names are HF's."""
    if not 0 < seq_len <= positions:
        raise ValueError(f"seq_len must be in 1..{positions}, got {seq_len}")
    n = _Net(seq_len, 1, hidden)
    for table, rows in (("word", vocab), ("position", positions), ("token_type", types)):
        n.embedding(f"embeddings.{table}_embeddings", rows)
    n.op(2 * n.numel)  # summing the three embeddings
    n.layernorm("embeddings.LayerNorm")
    for i in range(layers):
        p = f"encoder.layer.{i}"
        for proj in ("query", "key", "value"):
            n.linear(f"{p}.attention.self.{proj}", hidden)
        scores = heads * seq_len * seq_len
        # Q K^T and softmax(.) V: 2 * seq^2 * hidden multiply-adds; scaling + softmax
        n.op(2 * 2 * seq_len * seq_len * hidden + scores * (1 + SOFTMAX))
        n.linear(f"{p}.attention.output.dense", hidden)
        n.residual_add()
        n.layernorm(f"{p}.attention.output.LayerNorm")
        n.linear(f"{p}.intermediate.dense", intermediate)
        n.op(GELU * n.numel)
        n.linear(f"{p}.output.dense", hidden)
        n.residual_add()
        n.layernorm(f"{p}.output.LayerNorm")
    n.shape = (1, 1, hidden)  # the pooler reads the [CLS] token only
    n.linear("pooler.dense", hidden)
    n.op(TANH * hidden)
    return n.model("bert-base", f"sequence of {seq_len} tokens")


def xception(image_size: int = 299, classes: int = 1000) -> Model:
    """Keras ``applications.Xception(include_top=True)``; Keras layer names, except the four
    residual-branch convs / BNs, unnamed in Keras, here ``block{N}_res_conv`` / ``_res_bn``."""
    n = _Net(image_size, image_size, 3, keras=True)
    for name, ch, stride in (("block1_conv1", 32, 2), ("block1_conv2", 64, 1)):
        n.conv(name, ch, 3, stride, pad=0)
        n.bn(f"{name}_bn")
        n.relu()

    def sep(name, ch, act=True):
        if act:
            n.relu()
        n.sepconv(name, ch)
        n.bn(f"{name}_bn")

    def downsampling_block(b, ch1, ch2):
        x = n.shape
        n.conv(f"block{b}_res_conv", ch2, 1, 2, pad="same")
        n.bn(f"block{b}_res_bn")
        n.shape = x
        sep(f"block{b}_sepconv1", ch1, act=b != 2)  # block 2 follows block1_conv2's ReLU
        sep(f"block{b}_sepconv2", ch2)
        n.pool(3, 2, "same")
        n.residual_add()

    for b, ch in ((2, 128), (3, 256), (4, 728)):  # entry flow
        downsampling_block(b, ch, ch)
    for b in range(5, 13):  # middle flow
        for k in (1, 2, 3):
            sep(f"block{b}_sepconv{k}", 728)
        n.residual_add()
    downsampling_block(13, 728, 1024)  # exit flow
    for k, ch in ((1, 1536), (2, 2048)):
        sep(f"block14_sepconv{k}", ch, act=False)
        n.relu()
    n.global_pool()
    n.linear("predictions", classes)
    n.op(SOFTMAX * classes)
    return n.model("xception", f"{image_size}x{image_size}x3")


_BUILDERS = {
    "resnet50": lambda **kw: resnet((3, 4, 6, 3), "resnet50", **kw),
    "resnet152": lambda **kw: resnet((3, 8, 36, 3), "resnet152", **kw),
    "vgg16": lambda **kw: vgg((2, 2, 3, 3, 3), "vgg16", **kw),
    "vgg19": lambda **kw: vgg((2, 2, 4, 4, 4), "vgg19", **kw),
    "bert-base": bert_base,
    "xception": xception,
}


def get_model(name: str, **kwargs) -> Model:
    """Build a model of :data:`MODELS`; ``kwargs`` go to its builder (``image_size=`` for the
    CNNs, ``seq_len=`` for BERT)."""
    try:
        build = _BUILDERS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None
    return build(**kwargs)
