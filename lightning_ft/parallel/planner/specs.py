"""What the planner plans for: the shape of a GPT-style model and a cluster's devices, with named presets.

:class:`ModelSpec` counts parameters as Megatron-LM's GPT has them; :class:`ClusterSpec` adds to a
:class:`~lightning_ft.parallel.ClusterShape` what one device can hold and compute. :data:`MODEL_PRESETS` and
:data:`DEVICE_PRESETS` are the names ``lightning-ft plan --model`` and ``--device`` accept.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_ft.parallel.cluster_shape import ClusterShape

__all__ = ["DEVICE_PRESETS", "GIB", "MODEL_PRESETS", "ClusterSpec", "ModelSpec"]

GIB = 2**30
"""Bytes in a GiB."""


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    """The shape of a GPT-style decoder: what the planner needs to count parameters, activations and FLOPs.

    Parameters are counted as Megatron-LM's GPT has them: per layer ``4h^2 + 2hf`` weights plus biases and two layer
    norms, a word embedding of ``vocab_size x h`` tied with the output layer, a final layer norm; no learned position
    embedding.

    Example::

        model = ModelSpec(num_layers=24, hidden_size=2048, num_heads=16, vocab_size=50257)
        model.num_parameters  # about 1.31e9
    """

    name: str = "custom"
    """Label shown in tables."""
    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width h."""
    num_heads: int
    """Attention heads a; must divide ``hidden_size``."""
    vocab_size: int = 50257
    """Vocabulary size v."""
    ffn_hidden_size: int | None = None
    """Width of the MLP's inner layer f. None: ``4 * hidden_size``."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelSpec({name}={value!r}): must be a positive int")
        if self.ffn_hidden_size is not None and (not isinstance(self.ffn_hidden_size, int) or self.ffn_hidden_size < 1):
            raise ValueError(f"ModelSpec(ffn_hidden_size={self.ffn_hidden_size!r}): must be a positive int or None")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"ModelSpec(hidden_size={self.hidden_size}, num_heads={self.num_heads}): "
                f"{self.num_heads} heads do not divide the hidden size {self.hidden_size}"
            )

    @property
    def ffn_size(self) -> int:
        """The MLP's inner width f."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    def layer_parameters(self, tensor_parallel_size: int = 1) -> float:
        """Parameters of one transformer layer held by one of ``tensor_parallel_size`` devices.

        The QKV, attention-output and MLP weights and the column-parallel biases are split; the row-parallel biases
        and layer norms (6h) are replicated, as in Megatron-LM.
        """
        h, f = self.hidden_size, self.ffn_size
        split = 4 * h * h + 2 * h * f + 3 * h + f
        return split / tensor_parallel_size + 6 * h

    def embedding_parameters(self, tensor_parallel_size: int = 1) -> float:
        """Word-embedding parameters on one device of a vocabulary-parallel embedding."""
        return self.vocab_size * self.hidden_size / tensor_parallel_size

    @property
    def num_parameters(self) -> int:
        """Total parameters: layers, tied word embedding and final layer norm."""
        return round(self.num_layers * self.layer_parameters() + self.embedding_parameters() + 2 * self.hidden_size)


MODEL_PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # GPT-3 family shapes (Brown et al. 2020, Table 2.1) with the GPT-2 vocabulary.
        ModelSpec(name="gpt-125m", num_layers=12, hidden_size=768, num_heads=12),
        ModelSpec(name="gpt-350m", num_layers=24, hidden_size=1024, num_heads=16),
        ModelSpec(name="gpt-1.3b", num_layers=24, hidden_size=2048, num_heads=16),
        ModelSpec(name="gpt-2.7b", num_layers=32, hidden_size=2560, num_heads=32),
        ModelSpec(name="gpt-7b", num_layers=32, hidden_size=4096, num_heads=32),
        ModelSpec(name="gpt-13b", num_layers=40, hidden_size=5120, num_heads=40),
        ModelSpec(name="gpt-175b", num_layers=96, hidden_size=12288, num_heads=96, vocab_size=51200),
        # Megatron-LM's weak-scaling models (Narayanan et al. 2021, Table 1), vocabulary 51200.
        ModelSpec(name="megatron-1.7b", num_layers=24, hidden_size=2304, num_heads=24, vocab_size=51200),
        ModelSpec(name="megatron-18b", num_layers=40, hidden_size=6144, num_heads=48, vocab_size=51200),
        ModelSpec(name="megatron-39b", num_layers=48, hidden_size=8192, num_heads=64, vocab_size=51200),
        ModelSpec(name="megatron-146b", num_layers=80, hidden_size=12288, num_heads=96, vocab_size=51200),
    )
}
"""Model shapes by name, for ``lightning-ft plan --model``."""


@dataclass(kw_only=True, frozen=True)
class ClusterSpec(ClusterShape):
    """A cluster for planning: its shape and links plus what one device can hold and compute.

    Defaults describe H100 SXM 80 GB nodes with NVLink inside a node and one 400 Gb/s InfiniBand adapter per GPU.

    Example::

        cluster = ClusterSpec(num_nodes=4, devices_per_node=8)
        a100 = ClusterSpec(num_nodes=4, devices_per_node=8, **DEVICE_PRESETS["a100-80gb"])
    """

    device_memory_bytes: float = 80 * GIB
    """Memory of one device, bytes."""
    reserved_memory_bytes: float = 4 * GIB
    """Memory the model cannot use (CUDA context, communication buffers, allocator fragmentation), bytes."""
    peak_flops: float = 989e12
    """Peak dense bf16 throughput of one device, FLOP/s."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("device_memory_bytes", "peak_flops"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ClusterSpec({name}={value!r}): must be a positive number")
        if not 0 <= self.reserved_memory_bytes < self.device_memory_bytes:
            raise ValueError(
                f"ClusterSpec(reserved_memory_bytes={self.reserved_memory_bytes!r}): must be at least 0 and below "
                f"device_memory_bytes={self.device_memory_bytes!r}"
            )

    @property
    def usable_memory_bytes(self) -> float:
        """Memory per device the model may use: ``device_memory_bytes - reserved_memory_bytes``."""
        return self.device_memory_bytes - self.reserved_memory_bytes


DEVICE_PRESETS: dict[str, dict[str, float]] = {
    "h100-80gb": dict(
        device_memory_bytes=80 * GIB,
        peak_flops=989e12,
        intra_node_bandwidth_bytes_per_s=450e9,
        inter_node_bandwidth_bytes_per_s=50e9,
    ),
    # DGX A100 as in Megatron-LM's runs: NVSwitch 300 GB/s per direction, one 200 Gb/s HDR adapter per GPU.
    "a100-80gb": dict(
        device_memory_bytes=80 * GIB,
        peak_flops=312e12,
        intra_node_bandwidth_bytes_per_s=300e9,
        inter_node_bandwidth_bytes_per_s=25e9,
    ),
    "a100-40gb": dict(
        device_memory_bytes=40 * GIB,
        peak_flops=312e12,
        intra_node_bandwidth_bytes_per_s=300e9,
        inter_node_bandwidth_bytes_per_s=25e9,
    ),
}
"""Per-device figures by name, for ``ClusterSpec(**DEVICE_PRESETS[name], ...)`` and ``lightning-ft plan --device``."""
