"""A fully connected network (MAML's sine regressor is one)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor, nn

__all__ = ["MLP"]


class MLP(nn.Module):
    """A fully connected network: ``Linear -> activation`` per hidden layer, then ``head``.

    Args:
        in_features: input size ``D``.
        hidden: sizes of the hidden layers, e.g. ``[40, 40]`` for MAML's sine regressor;
            empty for a linear model.
        out_features: output size ``K``.
        activation: module class applied after each hidden layer (``nn.ReLU`` by default).

    Shape:
        ``[B, D] -> [B, K]`` (any leading dimensions ``[*, D] -> [*, K]``).
    """

    def __init__(
        self,
        in_features: int,
        hidden: Sequence[int],
        out_features: int,
        activation: type[nn.Module] | Callable[[], nn.Module] = nn.ReLU,
    ) -> None:
        super().__init__()
        sizes = [in_features, *hidden]
        for size in [*sizes, out_features]:
            if size < 1:
                raise ValueError(
                    f"layer sizes must be >= 1, got in_features={in_features}, "
                    f"hidden={list(hidden)}, out_features={out_features}"
                )
        layers: list[nn.Module] = []
        for n_in, n_out in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(n_in, n_out), activation()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(sizes[-1], out_features)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))
