"""The torchvision hook (``derender.translate.torchvision_ops``, installed in every process of the
virtualenv by a ``.pth`` file) acts once per process, however often it is installed or torchvision
is looked for: ``pytest tests/test_long_prompts.py`` alone once failed with "Only a single
TORCH_LIBRARY can be used to register the namespace torchvision" when transformers asked
``find_spec("torchvision")`` before the import and the filter installed the hook again."""

from __future__ import annotations

import subprocess
import sys

SEQUENCE = """
import importlib.util
import derender.translate.torchvision_ops as ops
for _ in range(3):
    ops.install()
    assert importlib.util.find_spec("torchvision") is not None  # as transformers asks, without importing it
import torchvision
import torchvision.transforms.functional
ops.install()
print("imported", ops.prepared)
"""


def test_the_hook_acts_once_however_often_it_is_installed_or_asked():
    out = subprocess.run([sys.executable, "-c", SEQUENCE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "imported True"
