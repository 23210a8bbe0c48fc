"""Models the profiler can build: built-in names or a user's ``module:factory``.

A model is a :class:`Workload`: the module, the positional/keyword inputs of one
call, and how to reduce the call's output to a scalar loss for ``--train``.

A user factory is called with no arguments and returns either a ``Workload`` or
a tuple ``(module, args)`` / ``(module, args, kwargs)``.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class ModelError(Exception):
    """The requested model cannot be built; the message says why."""


@dataclasses.dataclass
class Workload:
    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    loss: Callable[[Any], torch.Tensor] | None = None

    def loss_of(self, output: Any) -> torch.Tensor:
        if self.loss is not None:
            return self.loss(output)
        return _default_loss(output)


def _default_loss(output: Any) -> torch.Tensor:
    """Sum of the floating-point tensors found in the output (first level of tuples/dicts)."""
    if isinstance(output, torch.Tensor):
        output = (output,)
    if hasattr(output, "to_tuple"):  # transformers ModelOutput
        output = output.to_tuple()
    values = output.values() if isinstance(output, dict) else output
    tensors = [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if not tensors:
        raise ModelError("--train needs a loss: the model's output holds no floating-point tensor "
                         f"(got {type(output).__name__}); return one, or give the Workload a loss")
    return sum(t.float().pow(2).mean() for t in tensors)  # type: ignore[return-value]


# --------------------------------------------------------------------------- Qwen2


def tiny_qwen2_config(layers: int = 2) -> Any:
    import transformers

    return transformers.Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def qwen2(seed: int = 0, seq_len: int = 16, layers: int = 2) -> Workload:
    """Tiny Hugging Face Qwen2ForCausalLM with random weights (no download)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(tiny_qwen2_config(layers))
    input_ids = torch.randint(0, 128, (1, seq_len))
    return Workload(
        model,
        (input_ids,),
        {"use_cache": False},
        loss=lambda out: out.logits.float().pow(2).mean(),
    )


def _graph_break_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
    torch._dynamo.graph_break()


def qwen2_graph_break(seed: int = 0) -> Workload:
    """Tiny Qwen2 with a forced graph break inside each decoder layer (before its MLP)."""
    workload = qwen2(seed)
    for layer in workload.model.model.layers:
        layer.mlp.register_forward_pre_hook(_graph_break_hook)
    return workload


def qwen2_regional(seed: int = 0) -> Workload:
    """Tiny Qwen2 with regional compilation: ``torch.compiler.nested_compile_region`` on each decoder layer."""
    import types

    workload = qwen2(seed)
    layers = workload.model.model.layers
    forward = torch.compiler.nested_compile_region(type(layers[0]).forward)
    for layer in layers:
        layer.forward = types.MethodType(forward, layer)
    return workload


def _no_float_output() -> Workload:
    """A model whose output holds no floating-point tensor (for the --train error)."""
    torch.manual_seed(0)
    return Workload(_ArgMax(), (torch.randn(4, 8),))


class _ArgMax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).argmax(-1)


# --------------------------------------------------------------------------- synthetic


def scaled_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2.0


def gate(x: torch.Tensor) -> torch.Tensor:
    return scaled_tanh(x) * torch.sigmoid(x)


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(gate(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, graph_break: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim)
        self.graph_break = graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = scaled_tanh(self.norm(x))
        if self.graph_break:
            torch._dynamo.graph_break()
        return x + self.mlp(h)


class Nested(nn.Module):
    def __init__(self, dim: int = 32, layers: int = 2, graph_break: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.layers = nn.ModuleList(Block(dim, graph_break) for _ in range(layers))
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def nested(seed: int = 0, graph_break: bool = False) -> Workload:
    """Synthetic nested model: modules, a ModuleList and helper functions called twice."""
    torch.manual_seed(seed)
    return Workload(Nested(graph_break=graph_break), (torch.randn(4, 8),))


def nested_graph_break(seed: int = 0) -> Workload:
    """The synthetic nested model with ``torch._dynamo.graph_break()`` inside each layer."""
    return nested(seed, graph_break=True)


BUILTIN: dict[str, Callable[[], Workload]] = {
    "qwen2": qwen2,
    "qwen2-graph-break": qwen2_graph_break,
    "qwen2-regional": qwen2_regional,
    "nested": nested,
    "nested-graph-break": nested_graph_break,
}
DEFAULT_MODEL = "qwen2"


def describe_builtins() -> str:
    return ", ".join(BUILTIN)


def build(spec: str) -> Workload:
    """Build a built-in model by name, or call the factory named by ``module:factory``."""
    if spec in BUILTIN:
        return BUILTIN[spec]()
    if ":" not in spec:
        raise ModelError(
            f"unknown model {spec!r}: use one of {describe_builtins()} or 'module:factory'"
        )
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ModelError(f"cannot import module {module_name!r} for --model {spec!r}: {e}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelError(f"{module_name!r} has no callable {attr!r} (--model {spec!r})")
    try:
        result = factory()
    except Exception as e:
        raise ModelError(f"model factory {spec!r} failed: {type(e).__name__}: {e}") from e
    return _as_workload(result, spec)


def _as_workload(result: Any, spec: str) -> Workload:
    if isinstance(result, Workload):
        return result
    if isinstance(result, tuple) and len(result) in (2, 3) and isinstance(result[0], nn.Module):
        args = result[1] if isinstance(result[1], tuple) else (result[1],)
        kwargs = dict(result[2]) if len(result) == 3 else {}
        return Workload(result[0], args, kwargs)
    raise ModelError(
        f"model factory {spec!r} returned {type(result).__name__}; expected a Workload "
        "or a tuple (module, args) / (module, args, kwargs)"
    )
