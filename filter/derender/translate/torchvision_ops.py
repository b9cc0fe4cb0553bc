"""torchvision beside the CPU torch: its compiled operators declared when they cannot load.

PyPI's torchvision wheels are CUDA builds. Beside ``torch==*+cpu`` their ops
library (``_C``: nms, roi_align and the other detection kernels) does not load,
and ``import torchvision`` then fails: it registers fake kernels for
``torchvision::nms`` and ``torchvision::qnms``, operators that do not exist. And
transformers imports torchvision as soon as it is installed (its image utilities),
so every process that imports vLLM would fail, not only those serving a VLM.

``install`` puts a finder first on ``sys.meta_path`` that acts once in a process
(installing it again, or asking again, changes nothing), when torchvision is first
looked for: if the ops library loads, nothing changes;
otherwise the two operators' schemas are declared (no kernel) and the import
completes, with torchvision's transforms (plain torch, what image processors use)
working and its detection ops failing loudly if ever called. Set-up runs it in
every process of the virtualenv through a ``.pth`` file (``make setup``), since
vLLM and the tests start Python children of their own.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path
from typing import Any

SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library: Any = None  # torch.library.Library("torchvision", "DEF"), alive for the process
declared = False  # whether the schemas had to be declared
prepared = False  # whether _prepare ran: it runs once in a process, whoever asks again


def _prepare() -> None:
    global _library, declared, prepared
    if prepared:
        return
    prepared = True
    spec = importlib.machinery.PathFinder.find_spec("torchvision")
    if spec is None or not spec.origin:
        return
    import torch

    try:
        torch.ops.load_library(str(Path(spec.origin).parent / "_C.so"))
        return
    except (OSError, RuntimeError):
        pass
    _library = torch.library.Library("torchvision", "DEF")
    for schema in SCHEMAS:
        _library.define(schema)
    declared = True


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torchvision":
            uninstall()
            _prepare()
        return  # the ordinary finders import it


_finder = _Finder()


def install() -> None:
    """Prepare torchvision's first import in this process (a no-op once it is imported, or once the
    finder has acted: a ``find_spec("torchvision")`` that did not import it, as transformers asks
    whether torchvision is there, must not make it act twice)."""
    if "torchvision" not in sys.modules and not prepared and _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
