"""metalearn.deploy.aot and metalearn-export --program --aot: the AOTInductor package of a
real adapted tiny learner gives the eager model's logits under both batch-norm modes,
carries the package's document, is read by predict only when trusted, and the script's
latency table has its four rows. Two compiles in all (about 30 s each), shared by the
module's tests."""

from __future__ import annotations

import errno
import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

from metalearn.deploy import (
    UntrustedProgramError,
    adapt_to_support,
    adapted_model,
    aot_package_path,
    check_tensorrt,
    compile_aot,
    export_program,
    is_aot_package,
    latency_table,
    load_aot,
    load_learner,
    load_package,
    load_program,
    load_support_folder,
    measure_latency,
    predict,
)
from metalearn.tools import export as script
from tests.conftest import NO_OMNIGLOT
from tests.deploy.test_deploy import CHARACTERS, _args, experiment_checkpoint, make_support_folder

pytestmark = [
    pytest.mark.skipif(not CHARACTERS.is_dir(), reason=NO_OMNIGLOT),
    # Inductor's compile runs torch code that warns about torch's own deprecated APIs.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
]

HAS_TORCH_TENSORRT = importlib.util.find_spec("torch_tensorrt") is not None
FORMS = ["eager", "eager, inference_mode", "exported program", "AOTInductor package"]


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> SimpleNamespace:
    """norm="support" compiled by the script end to end, "transductive" by compile_aot;
    the eager references rebuilt by hand from the same checkpoint and support folder."""
    tmp = tmp_path_factory.mktemp("aot")
    checkpoint = experiment_checkpoint(tmp, _args(eval_inner_steps=2))
    folder = make_support_folder(tmp, shots=1)
    out = tmp / "export" / "adapted"
    report = script.export(script.Args(checkpoint=str(checkpoint), support=str(folder),
                                     out=str(out), program=True, aot=True,
                                     latency_repeats=3))  # fmt: skip
    learner, _ = load_learner(checkpoint)
    support = load_support_folder(folder, ways=5)
    params = adapt_to_support(learner, support.x, support.y, steps=2)
    models = {norm: adapted_model(learner, params, norm=norm, support_x=support.x)
              for norm in ("support", "transductive")}  # fmt: skip
    meta = {"norm": "transductive", "class_names": ["a", "b", "c", "d", "e"]}
    exported = export_program(models["transductive"], support.x, tmp / "t.pt2", metadata=meta)
    program, _ = load_program(exported, trust=True)
    package = compile_aot(program, tmp / "t.aoti.pt2", metadata=meta)
    paths = {"support": report.aot_path, "transductive": package}
    query = load_support_folder(make_support_folder(tmp, shots=3, offset=5)).x  # 15 images
    return SimpleNamespace(report=report, out=out, models=models, paths=paths, meta=meta,
                           support=support, query=query, tmp=tmp, checkpoint=checkpoint,
                           folder=folder)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["support", "transductive"])
def test_the_package_gives_the_eager_logits(packages, norm) -> None:
    path = packages.paths[norm]
    assert path.name == {"support": "adapted.aoti.pt2", "transductive": "t.aoti.pt2"}[norm]
    package, _ = load_aot(path, trust=True)
    model = packages.models[norm]
    for x in (packages.query, packages.query[:1], packages.support.x):  # 15, 1, 10 images
        with torch.inference_mode():
            want = model(x)
        got = package(x)
        assert got.shape == want.shape == (len(x), 5) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_the_metadata_travels_with_the_package(packages) -> None:
    assert load_aot(packages.paths["transductive"], trust=True)[1] == packages.meta
    # The script's programs carry the package's document, less its files.
    document = load_package(packages.out).document
    from_pt2 = load_program(packages.report.program_path, trust=True)[1]
    assert from_pt2 == {k: v for k, v in document.items() if k != "files"}
    assert load_aot(packages.paths["support"], trust=True)[1] == from_pt2
    assert from_pt2["norm"] == "support"
    assert from_pt2["class_names"] == [f"class{c}" for c in range(5)]
    assert packages.report.aot_max_abs_diff <= 1e-5 and packages.report.aot_seconds > 0
    assert packages.report.program_max_abs_diff <= 1e-5
    assert sorted(p.name for p in packages.out.parent.iterdir()) == [
        "adapted", "adapted.aoti.pt2", "adapted.latency.md", "adapted.pt2"]  # fmt: skip


@pytest.mark.slow
def test_predict_reads_a_package_path_and_tells_it_from_a_pt2(packages) -> None:
    path, model = packages.paths["support"], packages.models["support"]
    with torch.inference_mode():
        probabilities = torch.softmax(model(packages.query), -1)
    program = packages.report.program_path
    for source in (path, load_aot(path, trust=True)[0], program, packages.out):
        prediction = predict(source, packages.query, trust=True)
        torch.testing.assert_close(prediction.probabilities, probabilities, atol=1e-6, rtol=0)
        assert torch.equal(prediction.classes, probabilities.argmax(-1))
    for source in (path, program):  # code: only with trust
        with pytest.raises(UntrustedProgramError, match="runs code from the file"):
            predict(source, packages.query)
    with pytest.raises(UntrustedProgramError, match="AOTInductor package .native code."):
        load_aot(path)
    text = packages.tmp / "notes.pt2"
    text.write_text("not an archive")
    assert is_aot_package(path)
    assert not any(map(is_aot_package, (program, text, packages.tmp / "missing.pt2")))
    with pytest.raises(ValueError, match="not an AOTInductor package .*load_program"):
        load_aot(program, trust=True)
    with pytest.raises(FileNotFoundError, match="missing.pt2 does not exist"):
        load_aot(packages.tmp / "missing.pt2", trust=True)


@pytest.mark.slow
def test_the_latency_table_has_the_four_forms(packages) -> None:
    report = packages.report
    assert report.latency_path == packages.out.with_name("adapted.latency.md")
    assert report.latency_path.read_text() == report.latency
    caption, blank, header, rule, *rows = report.latency.splitlines()
    assert caption.startswith("Per-image latency: batch 1, median of 3 calls after 5 warm-up")
    assert (blank, header) == ("", "| form | device | ms per image | speed-up vs eager |")
    cells = [row.strip("|").split(" | ") for row in rows]
    assert [c[0].strip() for c in cells] == FORMS
    assert all(c[1] == "cpu" and float(c[2]) > 0 for c in cells)
    assert cells[0][3].strip() == "1x"


@pytest.mark.slow
def test_a_full_disk_while_writing_the_aot_package_is_one_line_and_keeps_the_old_one(
    packages, tmp_path, monkeypatch, capsys
) -> None:
    """The disk fills while the AOTInductor package is written (the write itself is the
    real `write_atomically`; only the bytes handed to it stop with ENOSPC halfway)."""
    import metalearn.deploy.aot as aot

    out = tmp_path / "adapted"
    package = aot_package_path(out)
    package.write_bytes(b"the previous package")
    real = aot.write_atomically

    def full(path, data, **kwargs):
        def half_then_full(file) -> None:
            file.write(bytes(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        return real(path, half_then_full, **kwargs)

    monkeypatch.setattr(aot, "write_atomically", full)
    code = script.main(["--checkpoint", str(packages.checkpoint), "--support",
                       str(packages.folder), "--out", str(out), "--aot", "--overwrite",
                       "--latency-repeats", "3"])  # fmt: skip
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert code == 2 and err == (
        f"metalearn-export: error: could not write --aot package {package}: No space left on "
        f"device; free space on the disk holding {tmp_path}, or write elsewhere (nothing was "
        "replaced)\n"
    )
    assert package.read_bytes() == b"the previous package"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapted", "adapted.aoti.pt2"]


def test_measure_latency_times_every_form_after_its_warm_up() -> None:
    calls: dict[str, list[int]] = {"double": [], "negate": []}

    def counted(name, fn):
        def run(x):
            calls[name].append(len(x))
            return fn(x)

        return run

    x = torch.ones(4, 1, 2, 2)
    runners = {"double": (counted("double", lambda t: 2 * t), x),
               "negate": (counted("negate", torch.neg), x[:1])}  # fmt: skip
    latencies = measure_latency(runners, repeats=7, warmup=2)
    assert list(latencies) == ["double", "negate"] and all(s > 0 for s in latencies.values())
    assert calls == {"double": [4] * 9, "negate": [1] * 9}
    table = latency_table({"a": 2e-3, "b": 5e-4}, batch=1, repeats=7, warmup=2,
                          devices={"a": "cpu", "b": "cuda"})  # fmt: skip
    assert table.splitlines()[-2:] == ["| a | cpu | 2 | 1x |", "| b | cuda | 0.5 | 4x |"]
    with pytest.raises(ValueError, match="repeats >= 1 .*got 0 .*--latency-repeats"):
        measure_latency(runners, repeats=0)


def test_compile_aot_refuses_before_compiling_and_changes_nothing(tmp_path) -> None:
    model = torch.nn.Linear(3, 2).eval()
    program = torch.export.export(model, (torch.ones(1, 3),))
    existing = tmp_path / "kept.aoti.pt2"
    existing.write_bytes(b"an earlier package")
    checkpoint = experiment_checkpoint(tmp_path, _args())
    before = {p: p.read_bytes() for p in (existing, checkpoint)}
    with pytest.raises(FileExistsError, match="the --aot package .*kept.aoti.pt2 exists"):
        compile_aot(program, existing)
    with pytest.raises(FileExistsError, match="training checkpoint, never overwritten"):
        compile_aot(program, checkpoint, overwrite=True)
    with pytest.raises(ValueError, match=r"must end in \.pt2; name it e\.g\. .*\.so\.pt2"):
        compile_aot(program, tmp_path / "model.so")
    no_compiler = {"cpp.cxx": (None, str(tmp_path / "no-c++"))}  # Inductor's own search list
    with (
        torch._inductor.config.patch(no_compiler),
        pytest.raises(ValueError, match="--aot needs a C\\+\\+ compiler: install g\\+\\+"),
    ):
        compile_aot(program, tmp_path / "new.aoti.pt2")
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.aoti.pt2", "run"]


@pytest.mark.skipif(
    torch.cuda.is_available() and HAS_TORCH_TENSORRT, reason="TensorRT can be built here"
)
def test_tensorrt_names_what_it_needs() -> None:
    with pytest.raises(ValueError) as err:
        check_tensorrt()
    message = str(err.value)
    assert "\n" not in message and message.startswith("--tensorrt needs ")
    package = f"pip install torch-tensorrt, the release matching torch {torch.__version__}"
    assert (package in message) != HAS_TORCH_TENSORRT
    assert ("a CUDA device" in message) != torch.cuda.is_available()
