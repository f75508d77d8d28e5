"""Deploy an adapted learner: checkpoint -> adapt on a support folder -> a package of data.

The pipeline, one function per step (``metalearn-export`` is the command line, and
``metalearn-predict`` classifies a folder of images with what it writes)::

    learner, recipe = load_learner("runs/NAME/checkpoint.pt", which="best")
    support = load_support_folder("my_support/", image=recipe.data.image,  # as in training
                                  ways=recipe.model.ways)                  # a folder per class
    params = adapt_to_support(learner, support.x, support.y,
                              steps=recipe.training.eval_inner_steps)
    model = adapted_model(learner, params, support_x=support.x)   # an ordinary nn.Module
    export_from_checkpoint(...)                      # all of it: writes the package folder
    package = load_package("adapted/")               # tensors and JSON: safe from anyone
    prediction = predict(package, images)            # classes, probabilities
    program, meta = load_program("adapted.pt2", trust=True)   # --program: code, yours only

**Data, never code.** The package (`package`) is a folder of one JSON document (the
architecture from metalearn's model registry and its constructor arguments, the batch-norm
reading, the class names, the image decoding, a format version, each tensor file's checksum)
and the adapted weights and batch-norm statistics as safetensors; `load_package` rebuilds
the network from metalearn's own code and fills it with tensors checked against it. A
``torch.export`` program (`program`) or an AOTInductor package (`aot`) is code, as a ``.so``
is: written for the machine that compiled it, loaded only with ``trust=True``.

One concept per module: `run_checkpoint` (a run's checkpoint and the learner in it),
`adapt` (the inner loop on a support set), `model` (the adapted network in one of three
batch-norm readings), `package` (the data package, written and read), `program` (the
``torch.export`` program and the rules for every file written beside the package), `aot`
(the program compiled ahead of time by AOTInductor), `tensorrt` (a TensorRT engine, CUDA
only), `latency` (per-image latency of each form, as a table), `predict`, and `pipeline`
(all of it, self-checked). Image folders are read by `metalearn.data.folders`;
`load_support_folder`, `SupportSet` and `IMAGE_SUFFIXES` are re-exported here.

**Batch norm at inference.** Conv4's `MetaBatchNorm` is transductive: it normalises with
the statistics of the batch it is given, in training and in evaluation alike, so an
image's logits depend on the other images in its batch. ``norm="support"`` (the default,
but for a learner evaluated as the third reading reads) freezes each batch norm's
statistics at those of the support set (`FrozenBatchNorm`), so every image is classified
on its own, whatever else is in its batch. ``norm="transductive"`` keeps the training
behaviour exactly: the network takes any batch size and normalises each call's batch
together, which is right for a whole balanced query set in one call and wrong for one
image at a time. ``norm="beside_support"`` classifies each image as the last row of a
batch of the support set and that image (`BesideSupport`: batch norm sees the support set
plus that one image), which is how Reptile's default evaluation scores queries: a Reptile
learner gets it by default (`default_norm`), so its deployed network reproduces its
`evaluate`. Measured for the first two on 200 Omniglot 5-way 1-shot test tasks
(``docs/deploy.md``): transductive with the 75 query images in one batch 88.6%, frozen
support statistics 86.1%, transductive one image per call 18.3% (chance is 20%).
"""

from metalearn.data.folders import IMAGE_SUFFIXES, SupportSet, load_support_folder
from metalearn.deploy.adapt import adapt_to_support
from metalearn.deploy.aot import aot_package_path, compile_aot, is_aot_package, load_aot
from metalearn.deploy.latency import latency_table, latency_table_path, measure_latency
from metalearn.deploy.model import (
    NORMS,
    BesideSupport,
    FrozenBatchNorm,
    GroupBatchNorm,
    Norm,
    adapted_model,
    default_norm,
    merge_lora,
)
from metalearn.deploy.package import (
    Package,
    PackageError,
    check_document,
    is_package,
    load_package,
    write_package,
)
from metalearn.deploy.pipeline import ExportReport, export_from_checkpoint, package_document
from metalearn.deploy.predict import Prediction, load_model, predict
from metalearn.deploy.program import (
    UntrustedProgramError,
    check_export_target,
    export_program,
    load_program,
    program_path,
    save_program,
)
from metalearn.deploy.run_checkpoint import (
    is_run_checkpoint,
    learner_from,
    load_learner,
    read_run_checkpoint,
)
from metalearn.deploy.tensorrt import check_tensorrt, compile_tensorrt

__all__ = [
    "NORMS",
    "BesideSupport",
    "ExportReport",
    "FrozenBatchNorm",
    "GroupBatchNorm",
    "IMAGE_SUFFIXES",
    "Norm",
    "Package",
    "PackageError",
    "Prediction",
    "SupportSet",
    "UntrustedProgramError",
    "adapt_to_support",
    "adapted_model",
    "aot_package_path",
    "check_document",
    "check_export_target",
    "check_tensorrt",
    "compile_aot",
    "compile_tensorrt",
    "default_norm",
    "export_from_checkpoint",
    "export_program",
    "is_aot_package",
    "is_package",
    "is_run_checkpoint",
    "latency_table",
    "latency_table_path",
    "learner_from",
    "load_aot",
    "load_learner",
    "load_model",
    "load_package",
    "load_program",
    "load_support_folder",
    "measure_latency",
    "merge_lora",
    "package_document",
    "predict",
    "program_path",
    "read_run_checkpoint",
    "save_program",
    "write_package",
]
