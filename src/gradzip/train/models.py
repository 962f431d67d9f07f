"""Model zoo for gradzip experiments (pure PyTorch, no torchvision).

Includes CIFAR-style ResNets and VGGs, a small digits network, an LSTM
language model and logistic regression, plus a name-based registry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from gradzip._validate import check_int
from gradzip.train.transformer import TransformerLanguageModel

logger = logging.getLogger(__name__)

Hidden = tuple[Tensor, Tensor]

VGG_CONFIGS: dict[str, list[int | str]] = {
    "vgg-tiny": [32, "M", 64, "M", 128, 128, "M"],
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
              512, 512, 512, "M", 512, 512, 512, "M"],
    "vgg19": [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
              512, 512, 512, 512, "M", 512, 512, 512, 512, "M"],
}
RESNET_DEPTHS = (8, 14, 20, 18)


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with a residual connection.

    The shortcut is the identity, or a strided 1x1 conv + BN projection when
    the resolution or channel count changes.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        """Build the block.

        Args:
            in_channels: Input channels.
            out_channels: Output channels.
            stride: Stride of the first conv (1 or 2).
        """
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels))

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block to ``x`` [B, C, H, W]."""
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNetCifar(nn.Module):
    """ResNet for 32x32 inputs.

    Depths 8/14/20 are the classic CIFAR ResNets (3 stages of (depth-2)/6
    basic blocks, widths w, 2w, 4w). Depth 18 is ResNet-18 adapted to CIFAR
    (3x3 stem, no max-pool, 4 stages of 2 blocks, widths w, 2w, 4w, 8w);
    with ``width=64`` and 10 classes it has 11,173,962 parameters.
    """

    def __init__(self, depth: int = 20, width: int = 16, num_classes: int = 10,
                 in_channels: int = 3) -> None:
        """Build the network.

        Args:
            depth: One of 8, 14, 20, 18.
            width: Channels of the first stage.
            num_classes: Output classes.
            in_channels: Input image channels.

        Raises:
            TypeError: If an argument is not an integer.
            ValueError: If ``depth`` is unknown or a size is < 1.
        """
        super().__init__()
        check_int("depth", depth, minimum=1)
        if depth not in RESNET_DEPTHS:
            choices = ", ".join(map(str, RESNET_DEPTHS))
            raise ValueError(f"`depth` must be one of {choices}, got {depth!r}")
        check_int("width", width, minimum=1)
        check_int("num_classes", num_classes, minimum=1)
        check_int("in_channels", in_channels, minimum=1)
        if depth == 18:
            blocks, widths = [2, 2, 2, 2], [width, 2 * width, 4 * width, 8 * width]
        else:
            n = (depth - 2) // 6
            blocks, widths = [n, n, n], [width, 2 * width, 4 * width]
        self.depth = depth
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, 1, 1, bias=False),
            nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        stages: list[nn.Module] = []
        channels = width
        for i, (count, out) in enumerate(zip(blocks, widths, strict=True)):
            layers = []
            for j in range(count):
                stride = 2 if (i > 0 and j == 0) else 1
                layers.append(BasicBlock(channels, out, stride))
                channels = out
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        """Return class logits [B, num_classes] for images [B, C, H, W]."""
        out = self.pool(self.stages(self.stem(x)))
        return self.fc(torch.flatten(out, 1))


class VGGCifar(nn.Module):
    """VGG for 32x32 inputs with global average pooling and a linear head."""

    def __init__(self, cfg: str = "vgg16", batch_norm: bool = True,
                 width_multiplier: float = 1.0, num_classes: int = 10,
                 in_channels: int = 3) -> None:
        """Build the network.

        Args:
            cfg: One of ``'vgg-tiny'``, ``'vgg11'``, ``'vgg16'``, ``'vgg19'``.
            batch_norm: Insert BatchNorm after every conv.
            width_multiplier: Scales every conv's channel count (> 0).
            num_classes: Output classes.
            in_channels: Input image channels.

        Raises:
            TypeError: If an argument has the wrong type.
            ValueError: If ``cfg`` is unknown or a size is out of range.
        """
        super().__init__()
        if cfg not in VGG_CONFIGS:
            raise ValueError(f"`cfg` must be one of {', '.join(VGG_CONFIGS)}, got {cfg!r}")
        if not isinstance(batch_norm, bool):
            raise TypeError(f"`batch_norm` must be a bool, got {batch_norm!r}")
        if isinstance(width_multiplier, bool) or not isinstance(width_multiplier, (int, float)):
            raise TypeError(f"`width_multiplier` must be a number, got {width_multiplier!r}")
        if not width_multiplier > 0:
            raise ValueError(f"`width_multiplier` must be > 0, got {width_multiplier!r}")
        check_int("num_classes", num_classes, minimum=1)
        check_int("in_channels", in_channels, minimum=1)
        layers: list[nn.Module] = []
        channels = in_channels
        for item in VGG_CONFIGS[cfg]:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
                continue
            out = max(1, round(int(item) * width_multiplier))
            layers.append(nn.Conv2d(channels, out, 3, padding=1, bias=not batch_norm))
            if batch_norm:
                layers.append(nn.BatchNorm2d(out))
            layers.append(nn.ReLU(inplace=True))
            channels = out
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Return class logits [B, num_classes] for images [B, C, H, W]."""
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


class DigitsNet(nn.Module):
    """Small conv net for 1x8x8 digit images."""

    def __init__(self, hidden: int = 64, num_classes: int = 10) -> None:
        """Build the network.

        Args:
            hidden: Width of the fully connected hidden layer.
            num_classes: Output classes.

        Raises:
            TypeError: If an argument is not an integer.
            ValueError: If an argument is < 1.
        """
        super().__init__()
        check_int("hidden", hidden, minimum=1)
        check_int("num_classes", num_classes, minimum=1)
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 2 * 2, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        """Return class logits [B, num_classes] for images [B, 1, 8, 8]."""
        return self.classifier(self.features(x))


class LSTMLanguageModel(nn.Module):
    """Embedding -> multi-layer LSTM -> linear decoder over the vocabulary."""

    def __init__(self, vocab_size: int, embed: int = 200, hidden: int = 200, layers: int = 2,
                 dropout: float = 0.2, tie_weights: bool = False) -> None:
        """Build the model.

        Args:
            vocab_size: Number of tokens.
            embed: Embedding size.
            hidden: LSTM hidden size.
            layers: Number of LSTM layers.
            dropout: Dropout on embeddings, between layers and on outputs.
            tie_weights: Share embedding and decoder weights (needs
                ``embed == hidden``).

        Raises:
            TypeError: If an argument has the wrong type.
            ValueError: If a size is out of range or tying is impossible.
        """
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("embed", embed),
                            ("hidden", hidden), ("layers", layers)):
            check_int(name, value, minimum=1)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
            raise TypeError(f"`dropout` must be a number in [0, 1), got {dropout!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"`dropout` must be a number in [0, 1), got {dropout!r}")
        if not isinstance(tie_weights, bool):
            raise TypeError(f"`tie_weights` must be a bool, got {tie_weights!r}")
        if tie_weights and embed != hidden:
            raise ValueError(f"`embed` must equal hidden={hidden} when tying weights, got {embed}")
        self.vocab_size, self.hidden_size, self.num_layers = vocab_size, hidden, layers
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(vocab_size, embed)
        self.rnn = nn.LSTM(embed, hidden, layers, dropout=dropout if layers > 1 else 0.0)
        self.decoder = nn.Linear(hidden, vocab_size)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        if tie_weights:
            self.decoder.weight = self.encoder.weight
        else:
            nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def init_hidden(self, batch_size: int) -> Hidden:
        """Zero (h, c) state, each [layers, batch_size, hidden].

        Args:
            batch_size: Number of parallel sequences.

        Returns:
            Tuple of zero tensors on the model's device and dtype.

        Raises:
            TypeError: If ``batch_size`` is not an integer.
            ValueError: If ``batch_size`` < 1.
        """
        check_int("batch_size", batch_size, minimum=1)
        weight = self.decoder.weight
        shape = (self.num_layers, batch_size, self.hidden_size)
        return (weight.new_zeros(shape), weight.new_zeros(shape))

    @staticmethod
    def detach_hidden(hidden: Hidden) -> Hidden:
        """Cut the autograd history of a hidden state (truncated BPTT)."""
        return (hidden[0].detach(), hidden[1].detach())

    def forward(self, input: Tensor, hidden: Hidden | None = None) -> tuple[Tensor, Hidden]:
        """Run the model.

        Args:
            input: Token ids [T, B].
            hidden: State from :meth:`init_hidden` or a previous call;
                zeros when None.

        Returns:
            (logits [T, B, vocab_size], new hidden state).

        Raises:
            ValueError: If ``input`` is not 2-D.
        """
        if input.dim() != 2:
            raise ValueError(f"`input` must be a 2-D tensor [T, B], got shape {tuple(input.shape)}")
        if hidden is None:
            hidden = self.init_hidden(input.shape[1])
        out, hidden = self.rnn(self.drop(self.encoder(input)), hidden)
        return self.decoder(self.drop(out)), hidden


class LogisticRegression(nn.Module):
    """Linear model returning ``num_classes`` logits (use cross-entropy)."""

    def __init__(self, num_features: int, num_classes: int = 2) -> None:
        """Build the model.

        Args:
            num_features: Input features (inputs are flattened from dim 1).
            num_classes: Output classes (>= 2).

        Raises:
            TypeError: If an argument is not an integer.
            ValueError: If an argument is out of range.
        """
        super().__init__()
        check_int("num_features", num_features, minimum=1)
        check_int("num_classes", num_classes, minimum=2)
        self.linear = nn.Linear(num_features, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Return logits [B, num_classes] for inputs [B, ...]."""
        return self.linear(torch.flatten(x, 1))


def _lstm(num_classes: int, **kw: Any) -> nn.Module:
    return LSTMLanguageModel(num_classes, **kw)


def _resnet(depth: int) -> Callable[..., nn.Module]:
    def build(num_classes: int, **kw: Any) -> nn.Module:
        # ResNet-18 is conventionally 64 channels wide; the small ones 16.
        kw.setdefault("width", 64 if depth == 18 else 16)
        return ResNetCifar(depth, num_classes=num_classes, **kw)

    return build


_REGISTRY: dict[str, Callable[..., nn.Module]] = {
    **{f"resnet{d}": _resnet(d) for d in RESNET_DEPTHS},
    **{name: (lambda c, name=name, **kw: VGGCifar(name, num_classes=c, **kw))
       for name in VGG_CONFIGS},
    "digitsnet": lambda c, **kw: DigitsNet(num_classes=c, **kw),
    "logreg": lambda c, **kw: LogisticRegression(num_classes=c, **kw),
    "lstm": _lstm,
    "transformer": lambda c, **kw: TransformerLanguageModel(c, **kw),
}


def available_models() -> list[str]:
    """Return the sorted names accepted by :func:`build_model`."""
    return sorted(_REGISTRY)


def build_model(name: str, num_classes: int, **kwargs: Any) -> nn.Module:
    """Build a model by registry name.

    Args:
        name: Case-insensitive model name (see :func:`available_models`).
        num_classes: Output classes; for ``'lstm'`` the vocabulary size.
            ``'resnet18'`` defaults to ``width=64``, the other ResNets to 16.
        **kwargs: Passed to the model constructor (``'logreg'`` needs
            ``num_features``).

    Returns:
        The freshly initialised model.

    Raises:
        TypeError: If ``name`` is not a string or a kwarg is invalid.
        ValueError: If ``name`` is unknown or a value is out of range.
    """
    if not isinstance(name, str):
        raise TypeError(f"`name` must be a str, got {name!r}")
    key = name.strip().lower()
    if key not in _REGISTRY:
        raise ValueError(f"`name` must be one of {', '.join(available_models())}, got {name!r}")
    check_int("num_classes", num_classes, minimum=1)
    model = _REGISTRY[key](num_classes, **kwargs)
    count = sum(p.numel() for p in model.parameters())
    logger.debug("built %s with %d parameters", key, count)
    return model
