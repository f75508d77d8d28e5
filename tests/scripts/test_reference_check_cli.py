"""scripts/reference_check.py without a reference checkout: every command the docs and its
docstring show parses, a bad value or a path that is not the reference is one line with exit
status 2, and metalearn's side of the MAML++ comparison (the network and the name mapping)
is what the reference's ``VGGReLUNormNetwork`` names and computes."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import ROOT
from tests.conftest import script as load_script

COMMAND = re.compile(r"scripts/reference_check\.py((?:[ \t]+--[\w-]+[ \t]+[\w./-]+)*)")


def documented() -> list[tuple[str, ...]]:
    """The flags of each ``scripts/reference_check.py --flag value ...`` command in
    docs/algorithms.md and the script's docstring (a bare mention of the script has none)."""
    found = set()
    for path in (ROOT / "docs" / "algorithms.md", ROOT / "scripts" / "reference_check.py"):
        for match in COMMAND.finditer(path.read_text()):
            if match.group(1):
                found.add(tuple(match.group(1).split()))
    return sorted(found)


COMMANDS = documented()


def test_the_commands_are_found() -> None:
    assert len(COMMANDS) == 14  # seven in the docstring, seven in the docs
    algorithms = {flags[flags.index("--algorithm") + 1] for flags in COMMANDS}
    assert algorithms == {"mamlpp", "maml", "protonet", "r2d2", "metaoptnet",
                          "r2d2-bertinetto", "imaml"}  # fmt: skip


@pytest.mark.parametrize("flags", COMMANDS)
def test_every_shown_command_parses(flags: tuple[str, ...]) -> None:
    args = load_script("reference_check").parse_args(list(flags))
    assert args.reference == flags[flags.index("--reference") + 1]
    assert args.algorithm == flags[flags.index("--algorithm") + 1]
    assert args.tolerance == 1e-10


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("--algorithm reptile", "invalid choice 'reptile' for argument"),
        ("--tolerance 0", "--tolerance must be > 0, got 0.0"),
        ("--threads 0", "--threads must be at least 1, got 0"),
        ("--algorithm maml", "--algorithm maml needs --reference PATH, a checkout of "
                             "https://github.com/AntreasAntoniou/HowToTrainYourMAMLPytorch"),
        ("--algorithm metaoptnet --reference .", "--reference . has no "
                                                 "models/classification_heads.py"),
    ],
)  # fmt: skip
def test_a_refused_value_is_one_line_and_exit_2(argv: str, message: str, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        load_script("reference_check").main(argv.split())
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_the_names_map_onto_the_metalearn_network() -> None:
    check = load_script("reference_check")
    net = check.VGGReLUNorm(1, 5, 64, 4, 28)
    names = dict(net.named_parameters())
    reference = [f"layer_dict.conv{i}.{layer}.{p}" for i in range(4)
                 for layer in ("conv", "norm_layer") for p in ("weight", "bias")]  # fmt: skip
    reference += ["layer_dict.linear.weights", "layer_dict.linear.bias"]
    assert sorted(check.metalearn_name(n) for n in reference) == sorted(names)
    assert names["head.weight"].shape == (5, 64)  # 28 -> 14 -> 7 -> 3 -> 1


def test_the_network_is_conv_norm_leaky_relu_max_pool() -> None:
    # written out with torch's own layers: conv (padding 1), batch statistics, slope 0.01
    check = load_script("reference_check")
    torch.manual_seed(0)
    net = check.VGGReLUNorm(1, 5, 8, 2, 12).double()
    x = torch.randn(6, 1, 12, 12, dtype=torch.float64)
    out = x
    for block in net.blocks:
        out = F.conv2d(out, block.conv.weight, block.conv.bias, padding=1)
        out = F.batch_norm(out, None, None, block.norm.weight, block.norm.bias, training=True)
        out = F.max_pool2d(F.leaky_relu(out, 0.01), 2)
    expected = out.flatten(1) @ net.head.weight.T + net.head.bias
    torch.testing.assert_close(net(x), expected, rtol=1e-12, atol=1e-12)


def test_a_rounding_level_reference_is_taken_against_the_whole() -> None:
    relative = load_script("reference_check").relative
    b = torch.tensor([3.0, 4.0])
    assert relative(torch.tensor([3.0, 4.5]), b) == pytest.approx(0.1)
    tiny = torch.tensor([1e-18, 0.0])
    assert relative(torch.tensor([-1e-18, 0.0]), tiny, whole=10.0) == pytest.approx(2e-19)
    assert relative(torch.tensor([-1e-18, 0.0]), tiny) == pytest.approx(2.0)
    assert relative(None, b) == 1.0
