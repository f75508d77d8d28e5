"""metalearn.deploy: an experiment-format checkpoint, adapted on a folder of real Omniglot
PNGs (read by metalearn.data.folders), written as a package (and as a torch.export program)
and reloaded, must give the eager adapted model's outputs; bad inputs fail with messages
that name the fix. (metalearn-export is tested in test_export_script.py; hostile and mutated
packages in test_package.py and test_hostile_files.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import metalearn.data
from metalearn.algorithms import ANIL, FOMAML, IMAML, MAML, MAMLpp, MetaSGD, Reptile
from metalearn.checkpoint import save_checkpoint
from metalearn.deploy import (
    FrozenBatchNorm,
    UntrustedProgramError,
    adapt_to_support,
    adapted_model,
    export_program,
    is_run_checkpoint,
    load_learner,
    load_package,
    load_program,
    load_support_folder,
    package_document,
    predict,
    write_package,
)
from metalearn.models import MetaBatchNorm
from metalearn.runs.recipe import build_learner
from tests.conftest import NO_OMNIGLOT, OMNIGLOT
from tests.helpers.run_helpers import checkpoint_of, learner_of, make, om, recipe_of

DATA = OMNIGLOT
needs_data = pytest.mark.skipif(
    not (DATA / "images_evaluation").is_dir(),
    reason=NO_OMNIGLOT,
)
CHARACTERS = DATA / "images_evaluation" / "Angelic"


def _args(**overrides) -> om.Args:
    """The experiment's arguments, resolved as it records them in a checkpoint."""
    return om.resolve_args(make(om, hidden=8, device="cpu", **overrides))


def experiment_checkpoint(path: Path, args: om.Args, best: bool = True) -> Path:
    """A checkpoint in the experiment's format, weights from its own learner."""
    return checkpoint_of(path, om, args, best=best)


def make_support_folder(path: Path, shots: int = 2, ways: int = 5, offset: int = 0) -> Path:
    """``ways`` class folders of ``shots`` real Omniglot PNGs each."""
    folder = path / f"support-{offset}"
    for c in range(ways):
        source = CHARACTERS / f"character{c + 1:02d}"
        (folder / f"class{c}").mkdir(parents=True)
        for png in sorted(source.glob("*.png"))[offset : offset + shots]:
            shutil.copy(png, folder / f"class{c}" / png.name)
    return folder


@pytest.mark.parametrize(
    ("algorithm", "cls", "steps", "lr"),
    [("maml", MAML, 1, 2.0), ("fomaml", FOMAML, 1, 2.0), ("anil", ANIL, 1, 0.4),
     ("metasgd", MetaSGD, 1, 0.4), ("mamlpp", MAMLpp, 5, 0.1), ("imaml", IMAML, 16, 0.1),
     ("reptile", Reptile, 5, 1e-3)],
)  # fmt: skip
def test_build_learner_builds_what_the_experiment_trains(algorithm, cls, steps, lr) -> None:
    args = _args(algorithm=algorithm)
    learner = build_learner(recipe_of(om, args))
    assert type(learner) is cls
    assert (learner.inner_lr, learner.inner_steps) == (lr, steps)  # their references' steps
    if cls is IMAML:
        assert learner.cg_damping == 11.0
    # A state the experiment trained (its learner, seeded) loads strictly.
    learner.load_state_dict(learner_of(om, args).state_dict())


def test_load_learner_restores_the_chosen_weights(tmp_path) -> None:
    args = _args(algorithm="mamlpp", inner_steps=2)  # learned rates and BN copies in its state
    path = experiment_checkpoint(tmp_path, args)
    saved = torch.load(path, weights_only=True)
    saved["learner"] = {k: v + 1 for k, v in saved["learner"].items()}
    save_checkpoint(path, saved)
    for which in ("best", "last"):
        learner, recipe = load_learner(path, which=which)
        assert recipe == recipe_of(om, args)
        for key, value in learner.state_dict().items():
            assert torch.equal(
                value, saved[f"{which}_learner" if which == "best" else "learner"][key]
            )


def test_load_learner_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_learner(tmp_path / "missing.pt")
    path = experiment_checkpoint(tmp_path, _args(), best=False)
    with pytest.raises(ValueError, match="no best-validation weights yet.*which='last'"):
        load_learner(path)
    assert load_learner(path, which="last")[0].inner_steps == 5  # Proto-MAML's default
    with pytest.raises(ValueError, match="which='newest'; choose 'best'"):
        load_learner(path, which="newest")
    saved = torch.load(path, weights_only=True)
    saved["recipe"]["model"]["hidden"] = 16
    save_checkpoint(path, saved)
    with pytest.raises(ValueError, match="do not fit the protomaml learner.*hidden=16"):
        load_learner(path, which="last")


def test_load_learner_names_a_file_that_is_not_a_training_checkpoint(tmp_path) -> None:
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint")
    with pytest.raises(ValueError, match=r"notes.pt is not a metalearn checkpoint \(torch.load"):
        load_learner(text)
    other = save_checkpoint(tmp_path / "weights.pt", {"weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="not a metalearn training checkpoint .*'args'/'learner'"):
        load_learner(other)
    with pytest.raises(FileNotFoundError, match="a folder, not a checkpoint file"):
        load_learner(tmp_path)
    for bad in (text, other, tmp_path, tmp_path / "missing.pt"):
        assert not is_run_checkpoint(bad)
    assert is_run_checkpoint(experiment_checkpoint(tmp_path, _args()))


def test_image_folders_are_read_in_data_and_still_importable_from_deploy() -> None:
    import metalearn.data.folders as folders
    import metalearn.deploy as deploy

    for name in ("IMAGE_SUFFIXES", "SupportSet", "load_support_folder"):
        assert getattr(deploy, name) is getattr(folders, name) is getattr(metalearn.data, name)


@needs_data
def test_load_support_folder_decodes_like_the_training_data(tmp_path) -> None:
    folder = make_support_folder(tmp_path, shots=2)
    (folder / ".DS_Store").write_bytes(b"x")  # hidden files are skipped
    support = load_support_folder(folder, ways=5)
    assert support.x.shape == (10, 1, 28, 28) and support.x.dtype == torch.float32
    assert support.y.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert support.class_names == ("class0", "class1", "class2", "class3", "class4")
    # Reference: the MAML convention written out with PIL: grayscale, Lanczos, ink = 1 - png.
    first = sorted((folder / "class0").glob("*.png"))[0]
    with Image.open(first) as image:
        gray = np.asarray(image.convert("L").resize((28, 28), Image.Resampling.LANCZOS))
    want = torch.from_numpy(255 - gray.astype(np.int64)).float() / 255
    assert torch.equal(support.x[0, 0], want)


@needs_data
def test_load_support_folder_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist or is not a folder"):
        load_support_folder(tmp_path / "nowhere")
    (tmp_path / "none").mkdir()
    with pytest.raises(ValueError, match="holds no class folders"):
        load_support_folder(tmp_path / "none")
    folder = make_support_folder(tmp_path, shots=1)
    with pytest.raises(ValueError, match="holds 5 class folders .* but the model predicts 20"):
        load_support_folder(folder, ways=20)
    (folder / "class5").mkdir()
    with pytest.raises(ValueError, match="class folder .*class5 is empty"):
        load_support_folder(folder)
    (folder / "class5" / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"not images \(notes.txt\)"):
        load_support_folder(folder)
    (folder / "class5" / "notes.txt").unlink()
    (folder / "class5" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match="cannot decode .*broken.png"):
        load_support_folder(folder)
    shutil.rmtree(folder / "class5")
    (folder / "stray.png").write_bytes(b"")
    with pytest.raises(ValueError, match=r"files beside the class folders \(stray.png\)"):
        load_support_folder(folder)


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """A 5-way learner from an experiment checkpoint, adapted on real PNGs (2 per class)."""
    if not CHARACTERS.is_dir():
        pytest.skip(NO_OMNIGLOT)
    tmp = tmp_path_factory.mktemp("deploy")
    learner, recipe = load_learner(experiment_checkpoint(tmp, _args(algorithm="maml")))
    support = load_support_folder(make_support_folder(tmp), ways=recipe.model.ways)
    params = adapt_to_support(learner, support.x, support.y, steps=3)
    query = load_support_folder(make_support_folder(tmp, shots=3, offset=5)).x  # 15 other images
    learner.recipe = recipe  # for the package document
    return learner, support, params, query, tmp


def document_of(learner, support, norm: str) -> dict:
    """The package document metalearn-export writes for this adapted learner."""
    return package_document(learner.recipe, class_names=support.class_names, norm=norm,
                            evaluation_norm=learner.evaluation_norm, support_size=len(support.x),
                            dtype=support.x.dtype, source={"algorithm": "maml"})  # fmt: skip


def test_adapt_to_support_is_the_learners_inner_loop(adapted) -> None:
    learner, support, params, *_ = adapted
    theta = dict(learner.model.named_parameters())
    assert set(params) == set(theta)
    # Reference: three plain SGD steps on the support loss, written out with autograd, on
    # every weight but the batch norm's (MAML's default keeps them out of the inner loop).
    norms = {k for k in theta if ".norm." in k}
    fast = {k: v.detach().clone().requires_grad_() for k, v in theta.items() if k not in norms}
    held = {k: theta[k].detach() for k in norms}
    for _ in range(3):
        out = torch.func.functional_call(learner.model, {**fast, **held}, (support.x,))
        grads = torch.autograd.grad(torch.nn.functional.cross_entropy(out, support.y),
                                    list(fast.values()))  # fmt: skip
        fast = {k: (v - learner.inner_lr * g).detach().requires_grad_()
                for (k, v), g in zip(fast.items(), grads)}  # fmt: skip
    fast.update(held)
    for key in theta:
        torch.testing.assert_close(params[key], fast[key], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("norm", ["support", "transductive", "beside_support"])
def test_the_package_equals_the_adapted_model(adapted, norm) -> None:
    learner, support, params, query, tmp = adapted
    model = adapted_model(learner, params, norm=norm, support_x=support.x)
    path = write_package(tmp / f"pkg-{norm}", model, document_of(learner, support, norm))
    package = load_package(path)
    assert package.norm == norm and package.class_names == support.class_names
    assert package.image == learner.recipe.data.image
    assert sorted(p.name for p in tmp.iterdir() if p.name.startswith(".")) == []  # no staging
    for x in (query, query[:4], support.x):  # 15 and 4 images: not the support's 10
        with torch.inference_mode():
            torch.testing.assert_close(package.model(x), model(x), atol=0, rtol=0)
    prediction = predict(path, query)
    with torch.inference_mode():
        probabilities = torch.softmax(model(query), -1)
    torch.testing.assert_close(prediction.probabilities, probabilities, atol=0, rtol=0)
    assert torch.equal(prediction.classes, probabilities.argmax(-1))


@pytest.mark.parametrize("norm", ["support", "beside_support"])
def test_a_program_equals_the_adapted_model_and_loads_only_when_trusted(adapted, norm) -> None:
    learner, support, params, query, tmp = adapted
    model = adapted_model(learner, params, norm=norm, support_x=support.x)
    path = export_program(model, support.x, tmp / f"{norm}.pt2", metadata={"norm": norm})
    for load in (lambda: load_program(path), lambda: predict(path, query)):
        with pytest.raises(UntrustedProgramError, match=r"\.pt2 is a .*runs code .*trust=True"):
            load()
    program, meta = load_program(path, trust=True)
    assert meta == {"norm": norm}
    assert not [p for p in tmp.iterdir() if p.name.startswith(".")]  # no temporary file left
    for x in (query, query[:4], support.x):
        with torch.inference_mode():
            eager, exported = model(x), program.module()(x)
        torch.testing.assert_close(exported, eager, atol=1e-5, rtol=0)
    torch.testing.assert_close(predict(path, query, trust=True).probabilities,
                               predict(model, query).probabilities, atol=1e-6, rtol=0)  # fmt: skip


def test_frozen_statistics_reproduce_the_support_batch_and_drop_the_batch_dependence(
    adapted,
) -> None:
    learner, support, params, query, _ = adapted
    frozen = adapted_model(learner, params, norm="support", support_x=support.x)
    live = adapted_model(learner, params, norm="transductive")
    assert sum(isinstance(m, FrozenBatchNorm) for m in frozen.modules()) == 4
    assert not any(isinstance(m, MetaBatchNorm) for m in frozen.modules())
    with torch.inference_mode():
        # On the support batch itself, frozen statistics are the batch's own statistics.
        torch.testing.assert_close(frozen(support.x), live(support.x), atol=1e-5, rtol=0)
        # Frozen: an image's logits do not depend on its batch; transductive: they do.
        torch.testing.assert_close(frozen(query[:1])[0], frozen(query)[0], atol=1e-5, rtol=0)
        assert (live(query[:2])[0] - live(query)[0]).abs().max() > 1e-3


def test_adapt_to_support_errors(adapted) -> None:
    learner, support, *_ = adapted
    with pytest.raises(ValueError, match=r"labels span 1\.\.5 but the model predicts 5"):
        adapt_to_support(learner, support.x, support.y + 1)
    with pytest.raises(TypeError, match="support\\[0\\] is torch.float64.*to\\(torch.float32\\)"):
        adapt_to_support(learner, support.x.double(), support.y)
    with pytest.raises(TypeError, match="labels must be class indices"):
        adapt_to_support(learner, support.x, support.y.float())
    with pytest.raises(ValueError, match=r"must be \[N, C, H, W\] and labels \[N\]"):
        adapt_to_support(learner, support.x[:, 0], support.y)


def test_outputs_replace_a_file_only_when_asked_and_never_a_checkpoint(adapted) -> None:
    learner, support, params, _, tmp = adapted
    model = adapted_model(learner, params, norm="transductive")
    target = tmp / "existing.pt2"
    target.write_bytes(b"someone's data")
    with pytest.raises(FileExistsError, match="existing.pt2 exists; pass --overwrite"):
        export_program(model, support.x, target)
    assert target.read_bytes() == b"someone's data"
    export_program(model, support.x, target, overwrite=True, metadata={"n": 1})
    assert load_program(target, trust=True)[1] == {"n": 1}
    checkpoint = experiment_checkpoint(tmp / "other", _args())
    before = checkpoint.read_bytes()
    with pytest.raises(FileExistsError, match="training checkpoint, never overwritten"):
        export_program(model, support.x, checkpoint, overwrite=True)
    assert checkpoint.read_bytes() == before
    # A package: over a package only when asked; never over another folder, even asked.
    document = document_of(learner, support, "transductive")
    package = write_package(tmp / "pkg-over", model, document)
    with pytest.raises(FileExistsError, match="pkg-over exists; pass --overwrite"):
        write_package(package, model, document)
    write_package(package, model, {**document, "class_names": list("abcde")}, overwrite=True)
    assert load_package(package).class_names == tuple("abcde")
    mine = tmp / "my-folder"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is a folder, not a metalearn package, never"):
        write_package(mine, model, document, overwrite=True)
    assert (mine / "notes.txt").read_text() == "mine"
    assert not [p for p in tmp.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_predict_refuses_images_of_another_shape_in_one_line(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    dynamic = load_program(export_program(model, torch.randn(2, 1, 2, 2), tmp_path / "d.pt2"),
                           trust=True)[0]  # fmt: skip
    static = load_program(export_program(model, torch.randn(2, 1, 2, 2), tmp_path / "s.pt2",
                                         dynamic_batch=False), trust=True)[0]  # fmt: skip
    assert predict(dynamic, torch.randn(5, 1, 2, 2)).classes.shape == (5,)
    cases = [(dynamic, (5, 1, 3, 3), "[B, 1, 2, 2]"), (dynamic, (1, 2, 2), "[B, 1, 2, 2]"),
             (static, (5, 1, 2, 2), "[2, 1, 2, 2]")]  # fmt: skip
    for path, shape, wanted in cases:
        with pytest.raises(ValueError) as info:
            predict(path, torch.randn(shape))
        message = str(info.value)
        assert "\n" not in message
        assert message.startswith(f"images of shape {list(shape)}; this program takes {wanted}")
